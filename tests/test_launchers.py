"""Launchers, validated for real: hadolint, shellcheck, the Compose Specification, the Kubernetes and
Kubeflow schemas, kustomize, a simulated training operator running the PyTorchJob's own commands,
and TorchX (a real local_cwd run and the kubernetes and slurm dry runs)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import ROOT, env, free_port, made_once, run, slow_steps

sys.path.insert(0, str(ROOT / "k8s"))  # render.py, the manifests' renderer

SCHEMAS = ROOT / "tests" / "schemas"
K8S_DIRS = [
    "storage",
    "multi-node",
    "single-gpu",
    "elastic",
    "elastic-etcd",
    "trainjob-runtime",
    "trainjob-runtime-gang",
    "trainjob",
    "trainjob-single",
]
RUNTIME_DIRS = ("trainjob-runtime", "trainjob-runtime-gang")
JOB_DIRS = K8S_DIRS[1:]
TRAINJOBS = ("trainjob", "trainjob-single")
"""The folders of a TrainJob alone: its pods are the runtime's (k8s/trainjob-runtime), as the Trainer makes them for
it."""
CRDS = {
    "PyTorchJob": "kubeflow.org_pytorchjobs.yaml",
    "TrainJob": "kubeflow-trainer-v2/trainer.kubeflow.org_trainjobs.yaml",
    "ClusterTrainingRuntime": "kubeflow-trainer-v2/trainer.kubeflow.org_clustertrainingruntimes.yaml",
}
TINY_JOB = [
    "model.name=tinynet",
    "data.name=synthetic",
    "data.synthetic_train_size=512",
    "data.synthetic_test_size=128",
    "train.batch_size=32",
    "train.epochs=1",
    "train.plot=false",
    "train.log_every=8",
]


def bin_(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else (shutil.which(name) or name)


def schema(name: str) -> dict:
    """A vendored schema, after checking it is the file tests/schemas/SOURCES.md lists."""
    path = SCHEMAS / name
    listed = dict(re.findall(r"^\| (\S+) \|.*\| ([0-9a-f]{64}) \|$", (SCHEMAS / "SOURCES.md").read_text(), re.M))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == listed[name], f"{name} is not the file SOURCES.md lists"
    return yaml.safe_load(path.read_text())


def crd_schema(name: str) -> dict:
    return next(v for v in schema(name)["spec"]["versions"] if v.get("storage"))["schema"]["openAPIV3Schema"]


def unknown_fields(doc, sch: dict, where: str = "") -> list[str]:
    """Fields a CRD's structural schema does not know: the API server drops them without a word
    (pruning), so a misspelt setting would silently not apply."""
    if isinstance(doc, dict) and sch.get("type") == "object" and not sch.get("x-kubernetes-preserve-unknown-fields"):
        props, extra = sch.get("properties"), sch.get("additionalProperties")
        out = []
        for k, v in doc.items():
            if props is not None and k in props:
                out += unknown_fields(v, props[k], f"{where}.{k}")
            elif isinstance(extra, dict):
                out += unknown_fields(v, extra, f"{where}.{k}")
            elif props is not None:
                out.append(f"{where}.{k}")
        return out
    if isinstance(doc, list) and isinstance(sch.get("items"), dict):
        return [u for i, v in enumerate(doc) for u in unknown_fields(v, sch["items"], f"{where}[{i}]")]
    return []


def pod_templates(doc: dict, runtime: dict | None = None) -> dict[str, dict]:
    """A job's pod templates by replica: a PyTorchJob's replicas, a runtime's replicated Jobs, a
    TrainJob's (``runtime``'s as the Trainer makes them for it)."""
    from render import as_the_trainer_makes_it

    if doc["kind"] == "PyTorchJob":
        return {role: r["template"] for role, r in doc["spec"]["pytorchReplicaSpecs"].items()}
    if doc["kind"] == "ClusterTrainingRuntime":
        return {j["name"]: j["template"]["spec"]["template"] for j in doc["spec"]["template"]["spec"]["replicatedJobs"]}
    if doc["kind"] == "TrainJob" and runtime is not None:
        return {j["name"]: j["template"]["spec"]["template"] for j in as_the_trainer_makes_it(runtime, doc)}
    return {}


def runtime() -> dict:
    """The ClusterTrainingRuntime every TrainJob of ours names."""
    return manifests("trainjob-runtime")[0]


def pods_of(docs: list[dict]) -> list[dict]:
    """The pod specs a folder's (rendered) manifests make: a TrainJob's as made on our runtime."""
    return [t["spec"] for d in docs for t in pod_templates(d, runtime()).values()]


def every_pod_template(doc: dict) -> dict[str, dict]:
    """A job's pod templates and a Deployment's (the etcd of k8s/elastic-etcd)."""
    return {doc["metadata"]["name"]: doc["spec"]["template"]} if doc["kind"] == "Deployment" else pod_templates(doc)


def manifests(folder: str) -> list[dict]:
    """The folder's manifests; an overlay (a kustomization on another folder: k8s/elastic,
    k8s/elastic-etcd) as kustomize builds it."""
    files = [
        f
        for f in sorted((ROOT / "k8s" / folder).glob("*.yaml"))
        if f.name not in ("kustomization.yaml", "kustomizeconfig.yaml")
    ]
    if not files or "../" in (ROOT / "k8s" / folder / "kustomization.yaml").read_text():
        kubectl = shutil.which("kubectl")
        assert kubectl, "kubectl is needed (.ci/run installs Debian's kubernetes-client when it is missing)"
        built = subprocess.run(
            [kubectl, "kustomize", f"k8s/{folder}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        return [d for d in yaml.safe_load_all(built) if d]
    return [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]


# ------------------------------------------------------------------------------------------------
# Docker


def test_dockerfile_is_hadolint_clean_pinned_and_non_root():
    p = subprocess.run([bin_("hadolint"), "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    assert re.fullmatch(r"python:3\.\d+-slim-\w+", base), base
    # one torch everywhere: the image installs the constraints CI tests, which pin torch exactly
    # python-etcd: etcd-v2 rendezvous; onnx, onnxruntime, safetensors: trainer export
    assert re.search(r"COPY [^\n]*constraints\.txt", text) and '-c constraints.txt ".[etcd,export]"' in text
    assert "TORCH_HOME=/checkpoints/.torch" in text  # pretrained weights cached on the checkpoint volume
    assert not re.search(r"torch==|torchvision==", text), "versions live in constraints.txt alone"
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    readme = (ROOT / "docs" / "launchers.md").read_text()
    assert f"torch {pins['torch']}" in readme and f"torchvision {pins['torchvision']}" in readme
    assert re.search(r"^USER [1-9]\d*:", text, re.M), "a numeric non-root user"
    assert 'VOLUME ["/data", "/checkpoints"]' in text
    assert re.search(r'^ENTRYPOINT \["trainer", "launch"', text, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "data", "checkpoints"} <= set(ignored) and "constraints.txt" not in ignored
    assert not re.search(r"(?i)(secret|token|password|api_key)\s*=", text)


def test_compose_files_are_valid_and_only_the_override_asks_for_gpus():
    schema = yaml.safe_load((SCHEMAS / "compose-spec.json").read_text())
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    override = yaml.safe_load((ROOT / "docker-compose.override.yml").read_text())
    for doc in (base, override):
        jsonschema.Draft7Validator(schema).validate(doc)
    assert "name" not in base, "docker-compose v1 rejects a top-level name"
    train, data = base["services"]["train"], base["services"]["data"]
    assert "deploy" not in train, "the base file runs on a machine without GPUs"
    device = override["services"]["train"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    assert [s for s in base["services"].values() if "build" in s] == [data], "one build for both services"
    assert train["pull_policy"] == "never" and train["image"] == data["image"]
    assert train["shm_size"] == "${SHM_SIZE:-8g}" and "8g" in (ROOT / "docs" / "launchers.md").read_text()
    assert (
        "${DATA:-./data}:/data:ro" in train["volumes"]
        and "${CHECKPOINTS:-./checkpoints}:/checkpoints" in train["volumes"]
    )
    assert train["user"] == "${USER_ID:-1000}:${GROUP_ID:-1000}"
    assert "NPROC_PER_NODE" in train["environment"]
    # an engine's on-failure policy would retry exit 2 (bad input) too: crashes are retried by torchrun inside
    assert train["restart"] == "no" and train["environment"]["MAX_RESTARTS"] == "${MAX_RESTARTS:-3}"


# ------------------------------------------------------------------------------------------------
# Slurm and shell


def test_shell_scripts_are_shellcheck_clean():
    scripts = [
        *map(str, (ROOT / "slurm").glob("*.sh")),
        *map(str, (ROOT / "tests" / "slurm").glob("*.sh")),
        str(ROOT / ".ci" / "run"),
    ]
    p = subprocess.run([bin_("shellcheck"), "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_slurm_jobs_that_share_a_node_get_their_own_rendezvous_port_and_one_gpu_no_whole_node():
    """The batch script picks a port free on the first node, never one another job holds there
    (29500 + job id % 1000 gave jobs 7 and 1007 the same). single.sh asks memory by the CPU, not --mem=0."""
    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    picks = subprocess.run(
        [
            "bash",
            "-c",
            'source <(sed -n "/^pick_port()/,/^}/p" slurm/steps.sh); for id in 7 1007; do SLURM_JOB_ID=$id pick_port; '
            "done",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    with held:
        assert len(picks) == 2 and all(p.isdigit() and int(p) != held.getsockname()[1] for p in picks)
        for p in map(int, picks):  # free: a torchrun there can bind it
            with socket.socket() as probe:
                probe.bind(("", p))
    sbatch = [line for line in (ROOT / "slurm" / "single.sh").read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --mem=0" not in sbatch and "#SBATCH --mem-per-cpu=4G" in sbatch


# ------------------------------------------------------------------------------------------------
# Kubernetes


@pytest.mark.parametrize("folder", K8S_DIRS)
def test_every_manifest_validates(folder):
    """Custom resources against their CRDs (with no field the API server would drop), their pod
    templates and a runtime's Job templates against the strict Kubernetes schemas, the rest with
    kubernetes-validate."""
    pod_template = schema("k8s/podtemplatespec-v1.json")
    job = schema("k8s/job-batch-v1.json")
    pvc = schema("k8s/persistentvolumeclaim-v1.json")
    docs = manifests(folder)
    assert docs
    for doc in docs:
        if doc["kind"] in CRDS:
            assert doc["apiVersion"] == (
                "kubeflow.org/v1" if doc["kind"] == "PyTorchJob" else "trainer.kubeflow.org/v1alpha1"
            )
            crd = crd_schema(CRDS[doc["kind"]])
            jsonschema.Draft7Validator(crd).validate(doc)
            assert unknown_fields(doc, crd) == []
            for template in pod_templates(doc, runtime()).values():  # a TrainJob's: as the Trainer makes them
                jsonschema.Draft7Validator(pod_template).validate(template)
            for replicated in (
                doc["spec"]["template"]["spec"]["replicatedJobs"] if doc["kind"] == "ClusterTrainingRuntime" else []
            ):
                wrapped = {"apiVersion": "batch/v1", "kind": "Job", **replicated["template"]}
                jsonschema.Draft7Validator(job).validate(wrapped)
                kubernetes_validate.validate(wrapped, "1.30", strict=True)
        else:
            kubernetes_validate.validate(doc, "1.30", strict=True)
            if doc["kind"] == "PersistentVolumeClaim":
                jsonschema.Draft7Validator(pvc).validate(doc)


def test_a_broken_manifest_fails_validation():
    doc = manifests("multi-node")[0]
    doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema("k8s/podtemplatespec-v1.json")).validate(
            doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
        )
    shared, (trainjob,) = runtime(), manifests("trainjob")
    del shared["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][0][
        "onExitCodes"
    ]["values"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(crd_schema(CRDS["ClusterTrainingRuntime"])).validate(shared)
    trainjob["spec"]["trainer"]["numProcsPerNode"] = 8  # misspelt: the CRD accepts it, the API server would drop it
    jsonschema.Draft7Validator(crd_schema(CRDS["TrainJob"])).validate(trainjob)
    assert unknown_fields(trainjob, crd_schema(CRDS["TrainJob"])) == [".spec.trainer.numProcsPerNode"]


@pytest.mark.parametrize("folder", K8S_DIRS)
def test_kustomize_builds(folder):
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed (.ci/run installs Debian's kubernetes-client when it is missing)"
    out = subprocess.run([kubectl, "kustomize", f"k8s/{folder}"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(out.stdout) if d]
    # the PVCs are theirs alone: `kubectl delete -k k8s/<job>` deletes only what this builds
    expected = {
        "storage": ["PersistentVolumeClaim"] * 2,
        "trainjob-runtime": ["ClusterTrainingRuntime"],
        "trainjob-runtime-gang": ["ClusterTrainingRuntime"],
        "trainjob": ["TrainJob"],
        "trainjob-single": ["TrainJob"],
        "elastic-etcd": ["Service", "Deployment", "PyTorchJob"],
    }
    assert kinds == expected.get(folder, ["PyTorchJob"]), kinds
    if folder != "storage":
        assert "ghcr.io/cluster-trainer/cluster-trainer:0.1.0" in out.stdout


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted(pod: dict) -> list[str]:
    """What Pod Security admission's "restricted" level (Kubernetes 1.30) finds wrong with a pod
    spec; an empty list admits it."""
    bad, psc = [], pod.get("securityContext", {})
    bad += [f"volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    bad += [k for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation != false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []) or set(sc.get("capabilities", {}).get("add", [])) - {
            "NET_BIND_SERVICE"
        }:
            bad.append(f"{name}: capabilities")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")) or sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: may run as root")
        if sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile")
        bad += [f"{name}: hostPort" for p in c.get("ports", []) if p.get("hostPort")]
    return bad


def test_a_trainjob_names_its_own_volumes_and_the_runtime_holds_only_defaults():
    """The shared runtime's claims are defaults; a TrainJob's runtimePatches name its own, which the
    Trainer merges by volume name into its pods."""
    from render import as_the_trainer_makes_it

    (job,) = manifests("trainjob")
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    volumes = patch["template"]["spec"]["template"]["spec"]["volumes"]
    assert {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in volumes} == {
        "dshm": None,
        "checkpoints": "cifar-checkpoints",
        "data": "cifar-data",
    }
    next(v for v in volumes if v["name"] == "checkpoints")["persistentVolumeClaim"]["claimName"] = "team-a-checkpoints"
    pod = as_the_trainer_makes_it(runtime(), job)[0]["template"]["spec"]["template"]["spec"]
    assert {
        v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
    } == {"checkpoints": "team-a-checkpoints", "data": "cifar-data"}


def test_every_pod_passes_pod_security_restricted():
    pods = [t["spec"] for f in JOB_DIRS for d in manifests(f) for t in every_pod_template(d).values()]
    # elastic-etcd's etcd pod too; the runtime's pod, and its gang form's (the TrainJobs' pods are made from it)
    assert len(pods) == 8
    for pod in pods:
        assert restricted(pod) == []
    broken = copy.deepcopy(pods[0])
    del broken["containers"][0]["securityContext"]
    del broken["securityContext"]["seccompProfile"]
    assert restricted(broken) == [
        "data: seccompProfile",
        "pytorch: allowPrivilegeEscalation != false",
        "pytorch: capabilities",
        "pytorch: seccompProfile",
    ]


CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"


def checkov(path: Path, framework: str) -> dict:
    assert CHECKOV.exists(), "checkov is missing: make test-slow installs it (.venv-checkov)"
    p = subprocess.run(
        [str(CHECKOV), "-f", str(path), "--framework", framework, "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        env={**env(), "BC_SKIP_MAPPING": "TRUE"},
    )
    assert p.stdout.lstrip().startswith("{"), p.stderr[-3000:]
    return json.loads(p.stdout)["results"]


@pytest.mark.slow
@pytest.mark.parametrize("folder", JOB_DIRS)
def test_checkov_finds_nothing_unwaived_in_the_pod_templates(folder, tmp_path):
    """checkov (`make test-slow` installs it) on every pod template, each wrapped as the Job that
    checkov knows (render.py --as-jobs, as `make k8s-checkov` runs it), with the job's waivers:
    every check passes or is waived in the manifest with its reason. A TrainJob's pods: the
    runtime's as the Trainer makes them for it (its image, arguments, resources, shared memory)."""
    built = "\n---\n".join(
        subprocess.run(
            ["kubectl", "kustomize", f"k8s/{f}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        for f in [folder, *(["trainjob-runtime"] if folder in TRAINJOBS else [])]
    )
    wrapped = subprocess.run(
        [sys.executable, "k8s/render.py", "--as-jobs"],
        cwd=ROOT,
        input=built,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    jobs = [d for d in yaml.safe_load_all(wrapped) if d]
    services = [d for d in manifests(folder) if d["kind"] == "Service"]  # scanned as they are, with their own waivers
    assert (
        len(jobs)
        == sum(len(every_pod_template(d)) for d in manifests(folder)) + (folder in TRAINJOBS) + len(services)
        >= 1
    )
    if folder in TRAINJOBS:  # checkov saw the job's own image and resources
        made = jobs[0]["spec"]["template"]["spec"]["containers"][0]
        assert made["resources"] == manifests(folder)[0]["spec"]["trainer"]["resourcesPerNode"] and made["args"][
            -1
        ].startswith("checkpoint.dir=")
    waivers = {
        v.split("=", 1)[0]: v.split("=", 1)[1]
        for job in jobs
        for k, v in job["metadata"].get("annotations", {}).items()
        if k.startswith("checkov.io/skip")
    }
    assert all(len(reason) > 20 for reason in waivers.values()), waivers  # each with its reason
    (tmp_path / "jobs.yaml").write_text(wrapped)
    results = checkov(tmp_path / "jobs.yaml", "kubernetes")
    failed = [(c["check_id"], c["resource"]) for c in results["failed_checks"]]
    skipped = {c["check_id"] for c in results["skipped_checks"]}
    assert not failed, failed
    assert skipped == set(waivers), (skipped, waivers)  # no stale waiver either
    scanned = {c["resource"].split(".")[0] for c in results["passed_checks"] + results["skipped_checks"]}
    assert all("Service" in scanned for _ in services), scanned
    assert len(results["passed_checks"]) >= 40 * len(jobs)  # it did look (about 84 checks a template)


@pytest.mark.slow
def test_checkov_finds_nothing_unwaived_in_the_dockerfile():
    results = checkov(ROOT / "Dockerfile", "dockerfile")
    assert not results["failed_checks"], [c["check_id"] for c in results["failed_checks"]]
    assert {c["check_id"] for c in results["skipped_checks"]} == {
        "CKV_DOCKER_2"
    }  # HEALTHCHECK, waived in the file with its reason
    assert len(results["passed_checks"]) >= 10


def test_render_sets_the_storage_class_of_every_pvc():
    from render import render

    docs = render(manifests("storage"), None, None, None, storage_class="efs-sc")
    assert [d["spec"]["storageClassName"] for d in docs] == ["efs-sc", "efs-sc"]
    assert all(d["spec"]["accessModes"] == ["ReadWriteMany"] for d in docs)


def test_pytorchjob_has_what_a_cluster_needs():
    job = next(d for d in manifests("multi-node") if d["kind"] == "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    for replica in specs.values():
        assert replica["restartPolicy"] == "ExitCode"  # 2 fails the job; 75 and crashes, moved to 128+, are retried
        assert {"name": "TRAINER_EXIT_POLICY", "value": "exitcode"} in next(
            c for c in replica["template"]["spec"]["containers"]
        )["env"]
        pod = replica["template"]["spec"]
        c = next(c for c in pod["containers"] if c["name"] == "pytorch")
        assert c["resources"]["limits"]["nvidia.com/gpu"] == int(job["spec"]["nprocPerNode"])
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/data"].get("readOnly") is True and not mounts["/checkpoints"].get("readOnly")
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
        assert pod["securityContext"]["runAsNonRoot"] is True
    pvc = {d["metadata"]["name"]: d for d in manifests("storage")}
    assert pvc["cifar-checkpoints"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_elastic_job_takes_its_range_from_the_operator_and_refuses_a_batch_it_does_not_split(tmp_path):
    """The operator sets PET_NNODES=MIN:MAX and PET_RDZV_ENDPOINT (worker 0); `trainer torchrun`
    reads them as torchrun does. The range is checked at launch: the job's own batch splits over
    3 and 4 pods of 8 processes; the multi-node job's 512 would not, and stops in one line."""
    job = next(d for d in manifests("elastic") if d["kind"] == "PyTorchJob")
    admit(job)
    variables = operator_env(job, "Worker", 0)
    assert variables["PET_NNODES"] == "3:4" and variables["PET_RDZV_ENDPOINT"] == "cifar-elastic-worker-0:23456"
    c = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    args = [expand(a, variables) for a in c["args"]]
    # the operator's, not ours
    assert not any(a.startswith("--rdzv-endpoint") or a.startswith("--nnodes") for a in args)
    paths = {"/checkpoints": tmp_path / "checkpoints", "/data": tmp_path / "data"}
    cmd = local_command(c, variables, paths, ["train.batch_size=512", "data.name=synthetic"])
    p = run(cmd, env=env(**variables), check=False, timeout=60)  # PET_NPROC_PER_NODE=8, as the job asks
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "(--nnodes 3:4)" in lines[0] and "24, 32 processes" in lines[0], (
        p.stderr
    )
    from trainer.config import check_world_range
    from trainer.config_loader import load_config

    check_world_range(
        load_config(ROOT / "configs" / "default.yaml", ["train.batch_size=480"]), variables["PET_NNODES"], 8
    )
    from render import render

    spec = render([job], "reg/img:2", nodes=6, gpus=4)[0]["spec"]  # NODES is the most pods; the least stays
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 6 and spec["elasticPolicy"] == {
        **spec["elasticPolicy"],
        "minReplicas": 3,
        "maxReplicas": 6,
    }
    assert render([copy.deepcopy(job)], None, nodes=2, gpus=None)[0]["spec"]["elasticPolicy"]["minReplicas"] == 2


def test_render_sets_image_nodes_and_gpus():
    from render import render

    docs = render(manifests("multi-node"), "reg/img:2", nodes=4, gpus=2)
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    assert job["spec"]["nprocPerNode"] == "2" and job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    c = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert c["image"] == "reg/img:2" and c["resources"]["limits"]["nvidia.com/gpu"] == 2


# ------------------------------------------------------------------------------------------------
# The training operator, played here (facts from kubeflow/trainer v1.9 pkg/controller.v1/pytorch)

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def admit(job: dict) -> None:
    """The operator's admission webhook checks (an elastic job: Workers only, within its range)."""
    assert DNS1035.match(job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    specs = job["spec"]["pytorchReplicaSpecs"]
    if "elasticPolicy" in job["spec"]:
        policy = job["spec"]["elasticPolicy"]
        assert set(specs) == {"Worker"} and policy.get("rdzvBackend", "c10d") in ("c10d", "etcd", "etcd-v2")
        assert policy["minReplicas"] <= specs["Worker"]["replicas"] <= policy["maxReplicas"]
    else:
        assert "Master" in specs and specs["Master"].get("replicas", 1) == 1
    for replica in specs.values():
        containers = replica["template"]["spec"]["containers"]
        assert any(c["name"] == "pytorch" and c.get("image") for c in containers)


def operator_env(job: dict, role: str, index: int) -> dict[str, str]:
    specs = job["spec"]["pytorchReplicaSpecs"]
    if (
        "elasticPolicy" in job["spec"]
    ):  # the training operator's elastic variables (pkg/controller.v1/pytorch/elastic.go)
        policy, name = job["spec"]["elasticPolicy"], job["metadata"]["name"]
        worker = specs["Worker"]["template"]["spec"]["containers"][0]
        port = policy.get("rdzvPort") or next(
            (p["containerPort"] for p in worker.get("ports", []) if p["name"] == "pytorchjob-port"), 23456
        )
        return {
            "PYTHONUNBUFFERED": "1",
            "PET_NPROC_PER_NODE": job["spec"].get("nprocPerNode", "1"),
            "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
            "PET_RDZV_ENDPOINT": f"{policy.get('rdzvHost', f'{name}-worker-0')}:{port}",
            "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
            "PET_MAX_RESTARTS": str(policy.get("maxRestarts", 3)),
        }
    pods = sum(r.get("replicas", 1) for r in specs.values())
    nproc = job["spec"].get("nprocPerNode", "1")
    master = specs["Master"]["template"]["spec"]["containers"][0]
    port = next((p["containerPort"] for p in master.get("ports", []) if p["name"] == "pytorchjob-port"), 23456)
    rank = 0 if role == "Master" else index + 1
    addr = f"{job['metadata']['name']}-master-0"
    world = pods * int(nproc) if nproc.isdigit() else pods
    return {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": nproc,
        "PET_NNODES": str(pods),
        "MASTER_ADDR": addr,
        "PET_MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
    }


def expand(arg: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables.get(m.group(1), m.group(0)), arg)


def local_command(c: dict, variables: dict[str, str], paths: dict[str, Path], extra: list[str]) -> list[str]:
    """The container's command and args, $(VAR)-expanded like the kubelet, with volume paths mapped."""
    out = []
    for a in [*c.get("command", []), *c.get("args", [])]:
        a = expand(a, variables)
        for mount, local in paths.items():
            a = a.replace(f"={mount}", f"={local}")
        out.append(a)
    exe = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "trainer": [sys.executable, "-m", "trainer"],
        "etcd": ["etcd"],
    }[out[0]]
    return [*exe, *out[1:], *extra]


class Pods:
    """A job's pods as local processes (one per pod, its main container after its init containers),
    started again as a controller replaces them. ``decide(pod, code, disrupted)`` is the
    controller's rule for a pod that ended: 'done', 'replace' or 'fail' (the job)."""

    def __init__(self, tmp_path: Path, specs: dict[str, Callable[[int], tuple[list[list[str]], list[str], dict]]]):
        self.tmp, self.specs = tmp_path, specs
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, list[Path]] = {name: [] for name in specs}
        self.codes: dict[str, list[int]] = {name: [] for name in specs}
        self.disrupted: set[str] = set()

    def start(self, name: str) -> None:
        inits, cmd, pod_env = self.specs[name](len(self.logs[name]))
        for init in inits:
            run(init, env=pod_env)
        log = self.tmp / f"{name}-{len(self.logs[name])}.log"
        self.logs[name].append(log)
        self.procs[name] = subprocess.Popen(
            cmd, cwd=ROOT, env=pod_env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def out(self, name: str, attempt: int = -1) -> str:
        return self.logs[name][attempt].read_text()

    def evict(self, name: str) -> None:
        """The kubelet's part in an eviction or preemption: SIGTERM to the container; the pod gets DisruptionTarget."""
        self.disrupted.add(name)
        self.procs[name].send_signal(signal.SIGTERM)

    def kill(self, name: str) -> None:
        """The container killed outright (an OOM kill): exit 137."""
        self.procs[name].kill()

    def run(
        self, decide: Callable[[str, int, bool], str], faults: list[tuple[str, str, str]] = (), timeout: float = 300
    ) -> str:
        """Start every pod, act on each end by ``decide``, do each fault (pod whose log to watch, or
        '*' for every pod's, pattern, action on the other pod: 'evict:NAME' or 'kill:NAME') once;
        'Succeeded' or 'Failed'."""
        for name in self.specs:
            self.start(name)
        pending, deadline, done = list(faults), time.time() + timeout, set()
        while time.time() < deadline:
            for watch, pattern, action in list(pending):
                if re.search(pattern, "".join(self.out(n) for n in self.logs) if watch == "*" else self.out(watch)):
                    pending.remove((watch, pattern, action))
                    verb, target = action.split(":")
                    getattr(self, verb)(target)
            for name, proc in list(self.procs.items()):
                if proc.poll() is None:
                    continue
                # as the kubelet reports a signal
                code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
                self.codes[name].append(code)
                del self.procs[name]
                verdict = decide(name, code, name in self.disrupted)
                self.disrupted.discard(name)
                if verdict == "fail":
                    self.stop()
                    return "Failed"
                if verdict == "replace":
                    self.start(name)
                else:
                    done.add(name)
            if done == set(self.specs):
                return "Succeeded"
            time.sleep(0.2)
        self.stop()
        raise AssertionError(
            f"the job did not end within {timeout} s: {self.codes}\n"
            + "\n".join(self.out(n)[-2000:] for n in self.specs)
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs.clear()


SLOW_STEPS = slow_steps(0.1)


def pytorchjob_pods(job: dict, paths: dict[str, Path], extra: list[str], environ: dict[str, str] | None = None) -> dict:
    """The operator's pods of a PyTorchJob: its PET_* and MASTER_* variables, the kubelet's
    HOSTNAME and $(VAR) expansion, the volumes mapped to folders here."""

    def spec(role: str, i: int):
        def make(attempt: int):
            pod = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
            variables = operator_env(job, role, i)
            variables["MASTER_ADDR"] = variables["PET_MASTER_ADDR"] = "127.0.0.1"  # the master's service name
            pod_env = env(**variables, HOSTNAME=f"{job['metadata']['name']}-{role.lower()}-{i}", **(environ or {}))
            c = next(c for c in pod["containers"] if c["name"] == "pytorch")
            pod_env.update({e["name"]: e["value"] for e in c.get("env", [])})
            inits = [local_command(init, variables, paths, TINY_JOB) for init in pod.get("initContainers", [])]
            return inits, local_command(c, variables, paths, [*TINY_JOB, *extra]), pod_env

        return make

    return {
        f"{role.lower()}-{i}": spec(role, i)
        for role, r in job["spec"]["pytorchReplicaSpecs"].items()
        for i in range(r.get("replicas", 1))
    }


def exitcode_policy(pod: str, code: int, disrupted: bool) -> str:
    """The training operator's ExitCode policy: 0 done, 128-255 retried (the pod deleted and made
    again), 1-127 fail the job."""
    return "done" if code == 0 else "replace" if code >= 128 else "fail"


def volumes(root: Path) -> dict[str, Path]:
    """The pods' volumes (checkpoints, data) as folders here."""
    paths = {"/checkpoints": root / "checkpoints", "/data": root / "data"}
    for p in paths.values():
        p.mkdir(parents=True)
    return paths


def operator_job(folder: str) -> tuple[dict, dict]:
    """The PyTorchJob a job folder ships, admitted, its master's port a free one here; and the
    master's container. The operator simulations: the job's own commands, run as the training
    operator would (1 CPU process a pod on this small machine), under the ExitCode policy."""
    job = next(d for d in manifests(folder) if d["kind"] == "PyTorchJob")
    admit(job)
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    master["ports"][0]["containerPort"] = free_port()
    return job, master


@pytest.mark.slow
def test_operator_simulation_an_evicted_pod_exits_203_is_replaced_and_the_job_resumes(tmp_path):
    """An evicted pod saves and exits 203 (75 + 128): the operator replaces it, the job resumes and succeeds."""
    job, _ = operator_job("multi-node")
    job["spec"]["nprocPerNode"] = "1"
    paths = volumes(tmp_path)
    pods = Pods(tmp_path, pytorchjob_pods(job, paths, ["train.epochs=4"], SLOW_STEPS))
    assert pods.run(exitcode_policy, [("master-0", r"epoch 2/4 step", "evict:worker-0")]) == "Succeeded"
    assert pods.codes["worker-0"] == [203, 0] and "exit 203 (run the same command to resume from step-" in pods.out(
        "worker-0", 0
    )
    # rank 0 (which prints) is on whichever pod the re-formed group gave it to
    assert (
        "resuming from" in pods.out("master-0") + pods.out("worker-0")
        and (paths["/checkpoints"] / "cifar-ddp" / "step-64" / "meta.json").is_file()
    )


@pytest.mark.slow
def test_operator_simulation_bad_input_exits_2_and_fails_the_job_with_nothing_retried(tmp_path):
    job, _ = operator_job("multi-node")
    job["spec"]["nprocPerNode"] = "1"
    pods = Pods(tmp_path, pytorchjob_pods(job, volumes(tmp_path), ["train.epochs=4", "train.epoch=3"]))
    assert pods.run(exitcode_policy) == "Failed"
    assert 2 in pods.codes["master-0"] + pods.codes["worker-0"] and all(len(c) <= 1 for c in pods.codes.values())


@pytest.mark.slow
def test_operator_simulation_a_crash_without_progress_is_retried_until_the_third_fails_the_job(tmp_path):
    """A crash that repeats with no newer checkpoint is retried (129) until the node's third, which
    exits 1 and fails the job."""
    job, master = operator_job("single-gpu")
    master["args"] = [
        a if not a.startswith("--max-restarts") else "--max-restarts=0" for a in master["args"]
    ]  # each crash reaches the operator
    pods = Pods(
        tmp_path,
        pytorchjob_pods(
            job, volumes(tmp_path), ["train.epochs=4"], {"TRAINER_FAULT": "batch@5:kill", "TRAINER_FAULT_RANK": "0"}
        ),
    )
    assert pods.run(exitcode_policy) == "Failed"
    assert pods.codes["master-0"] == [129, 129, 1], pods.codes
    assert "cifar-single-master-0: 3 crashes in a row before any checkpoint, no progress: exit 1" in pods.out(
        "master-0"
    )


# ------------------------------------------------------------------------------------------------
# Kubeflow Trainer v2 and the Job controller, played here (facts in tests/schemas/SOURCES.md)


def trainjob_pods(
    shared: dict,
    trainjob: dict,
    paths: dict[str, Path],
    extra: list[str],
    port: int,
    environ: dict[str, str] | None = None,
) -> dict:
    """The pods of the TrainJob's JobSet: one per node of the indexed Job made from the runtime
    for this TrainJob (its image and arguments in the container named node), with what the torch
    plugin injects there (PET_*), the pod's labels for the downward API, the kubelet's HOSTNAME and
    $(VAR) expansion."""
    from render import as_the_trainer_makes_it

    name, trainer = trainjob["metadata"]["name"], trainjob["spec"]["trainer"]
    replicated = as_the_trainer_makes_it(shared, trainjob)[0]
    pod = replicated["template"]["spec"]["template"]["spec"]

    def make(index: int):
        def start(attempt: int):
            if index > 0 and attempt == 0:
                # on the cluster the rendezvous address is node 0's alone, so node 0 hosts its store;
                # here every pod is on 127.0.0.1 and the first to bind would: let node 0 bind first
                wait_for_port(port)
            labels = {
                "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                "batch.kubernetes.io/job-completion-index": str(index),
            }
            variables = {
                "PET_NNODES": str(trainer["numNodes"]),
                "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                "PET_NODE_RANK": str(index),
                "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
                "PET_MASTER_PORT": "29500",
            }
            # the headless service's name and port, here
            variables.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
            c = next(c for c in pod["containers"] if c["name"] == "node")
            for e in c.get("env", []):
                if "value" in e:
                    variables[e["name"]] = e["value"]
                else:
                    label = re.fullmatch(r"metadata\.labels\['(.+)'\]", e["valueFrom"]["fieldRef"]["fieldPath"]).group(
                        1
                    )
                    variables[e["name"]] = labels[label]
            pod_env = env(**variables, HOSTNAME=f"{name}-node-0-{index}", **(environ or {}))
            inits = [local_command(init, variables, paths, TINY_JOB) for init in pod.get("initContainers", [])]
            return inits, local_command(c, variables, paths, [*TINY_JOB, *extra]), pod_env

        return start

    return {f"node-{i}": make(i) for i in range(trainer["numNodes"])}


def wait_for_port(port: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {timeout:.0f} s")


class JobController:
    """batch/v1 Job: a failed pod goes through ``podFailurePolicy``'s rules in order (FailJob,
    Ignore: replaced, not counted; Count, and no match: counted against ``backoffLimit``)."""

    def __init__(self, job_spec: dict):
        self.rules, self.backoff, self.failures = job_spec["podFailurePolicy"]["rules"], job_spec["backoffLimit"], 0
        self.log: list[tuple[str, int, str]] = []

    def __call__(self, pod: str, code: int, disrupted: bool) -> str:
        if code == 0:
            return "done"
        action = next((r["action"] for r in self.rules if self.matches(r, code, disrupted)), "Count")
        self.log.append((pod, code, action))
        if action == "FailJob":
            return "fail"
        if action == "Count":
            self.failures += 1
            if self.failures > self.backoff:
                return "fail"
        return "replace"

    @staticmethod
    def matches(rule: dict, code: int, disrupted: bool) -> bool:
        if "onExitCodes" in rule:
            values = set(rule["onExitCodes"]["values"])
            return (code in values) == (rule["onExitCodes"]["operator"] == "In")
        return any(c["type"] == "DisruptionTarget" and disrupted for c in rule.get("onPodConditions", []))


def test_the_runtime_keeps_the_exit_contract_in_its_pod_failure_policy():
    shared = runtime()
    job = shared["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # what a podFailurePolicy needs
    assert shared["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == 0
    for folder in TRAINJOBS:
        trainjob = manifests(folder)[0]
        assert trainjob["spec"]["runtimeRef"] == {
            "apiGroup": "trainer.kubeflow.org",
            "kind": "ClusterTrainingRuntime",
            "name": shared["metadata"]["name"],
        }
    assert {r["action"] for r in job["podFailurePolicy"]["rules"]} <= {"FailJob", "Ignore", "Count", "FailIndex"}
    controller = JobController(job)
    assert [controller("p", c, d) for c, d in ((2, False), (75, False), (137, True), (1, False), (124, False))] == [
        "fail",
        "replace",
        "replace",
        "replace",
        "replace",
    ]
    assert controller.failures == 2  # the crashes only
    assert [controller("p", 1, False) for _ in range(3)] == [
        "replace",
        "replace",
        "fail",
    ]  # the 5th crash fails the job


def trainjob_case(root: Path, extra: list[str], environ: dict | None = None) -> tuple[Pods, JobController, Path]:
    """The TrainJob's runtime commands, run as the Trainer and the Job controller would (2 nodes, 1
    process each): its pods, the controller, its checkpoint folder."""
    shared, (trainjob,) = runtime(), manifests("trainjob")
    trainjob["spec"]["trainer"]["numProcPerNode"] = 1
    job_spec = shared["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    paths = volumes(root)
    pods = Pods(root, trainjob_pods(shared, trainjob, paths, extra, free_port(), environ))
    return pods, JobController(job_spec), paths["/checkpoints"] / trainjob["metadata"]["name"]


@pytest.mark.slow
def test_trainer_v2_simulation_an_evicted_pod_is_ignored_replaced_and_the_trainjob_resumes(tmp_path):
    """An evicted pod (SIGTERM, DisruptionTarget) saves; 75 is ignored, the pods are replaced and resume."""
    pods, controller, ckpt = trainjob_case(tmp_path, ["train.epochs=4"], SLOW_STEPS)
    # rank 0, which prints, is on the pod that reached the rendezvous first
    assert pods.run(controller, [("*", r"epoch 2/4 step", "evict:node-1")]) == "Succeeded"
    assert ("node-1", 75, "Ignore") in controller.log and controller.failures == 0, controller.log
    # rank 0 (which prints) is on whichever pod the re-formed group gave it to
    last = pods.out("node-0") + pods.out("node-1")
    assert "strategy ddp x2" in last and "resuming from" in last and (ckpt / "step-64" / "meta.json").is_file()


@pytest.mark.slow
def test_trainer_v2_simulation_a_pod_killed_outright_counts_once_and_the_trainjob_finishes(tmp_path):
    pods, controller, ckpt = trainjob_case(tmp_path, ["train.epochs=4"], SLOW_STEPS)
    assert pods.run(controller, [("*", r"epoch 2/4 step", "kill:node-1")]) == "Succeeded"
    assert ("node-1", 137, "Count") in controller.log and controller.failures == 1, controller.log
    assert (ckpt / "step-64" / "meta.json").is_file()


@pytest.mark.slow
def test_trainer_v2_simulation_bad_input_fails_the_trainjob_at_once(tmp_path):
    pods, controller, _ = trainjob_case(tmp_path, ["train.epochs=4", "train.epoch=3"])
    assert pods.run(controller) == "Failed"
    assert controller.log[0][1:] == (2, "FailJob") and all(len(c) <= 1 for c in pods.codes.values()), (
        controller.log,
        pods.codes,
    )


# ------------------------------------------------------------------------------------------------
# TorchX


def torchx(*args: str, **kw) -> subprocess.CompletedProcess:
    return run([bin_("torchx"), *args], **kw)


def scheduler_request(out: str) -> str:
    return out.split("=== SCHEDULER REQUEST ===", 1)[1]


@pytest.mark.slow
def test_torchx_local_cwd_runs_the_ddp_component_from_a_venv_not_activated(tmp_path):
    # `.venv/bin/torchx run ...` with nothing of the venv on PATH (no torchrun, no trainer, no python)
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not shutil.which("torchrun", path=d))
    p = torchx(
        "run",
        "--workspace",
        "",
        "-s",
        "local_cwd",
        "trainer/launch/components.py:train_ddp",
        "--j",
        "1x2",
        "--gpu",
        "0",
        "--config",
        "configs/smoke.yaml",
        "--checkpoint_mount",
        "",
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--data_dir",
        str(tmp_path / "data"),
        "--",
        "train.epochs=1",
        "train.plot=false",
        env=env(TORCHX_LOG_DIR=str(tmp_path / "logs"), PATH=path),
        timeout=600,
    )
    out = p.stdout + p.stderr
    assert "Job finished: SUCCEEDED" in out and "strategy ddp x2" in out, out[-3000:]
    assert (tmp_path / "ck" / "step-32" / "meta.json").is_file()
    assert "CUDA_VISIBLE_DEVICES" not in out  # a CPU job (--gpu 0) asks for no GPU: no TorchX warning block


@pytest.mark.slow
def test_torchx_trains_from_shards_on_its_data_dir(tmp_path):
    """Your own images under TorchX: the shards on --data_dir, data.name=shards after --, streamed."""
    from conftest import make_jpegs

    from trainer.worker.data.shards import write

    write(make_jpegs(tmp_path / "myset", train=12, test=3, size=32), tmp_path / "shards")
    p = torchx(
        "run",
        "--workspace",
        "",
        "-s",
        "local_cwd",
        "trainer/launch/components.py:train_ddp",
        "--j",
        "1x2",
        "--gpu",
        "0",
        "--config",
        "configs/smoke.yaml",
        "--checkpoint_mount",
        "",
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--data_dir",
        str(tmp_path / "shards"),
        "--",
        "data.name=shards",
        "data.loader=stream",
        "train.epochs=1",
        "train.batch_size=24",
        "train.plot=false",
        env=env(TORCHX_LOG_DIR=str(tmp_path / "logs")),
        timeout=600,
    )
    out = p.stdout + p.stderr
    assert (
        "Job finished: SUCCEEDED" in out
        and f"shards {tmp_path / 'shards'}: 120 train / 30 test images, 10 classes" in out
    ), out[-3000:]
    assert "streamed from shards" in out and (tmp_path / "ck" / "step-5" / "meta.json").is_file()


@pytest.mark.slow
def test_torchx_local_from_the_tools_venv_runs_the_repositorys_venv_or_says_what_to_install(tools_venv, tmp_path):
    """docs/launchers.md's TorchX block in order: `make tools` (TorchX, no torch), then a local run. With
    the repository's .venv the job runs in it; in a clone without one, the job stops in one line
    that says what to install (no ModuleNotFoundError, no 'python: not found')."""
    local = [
        "run",
        "--workspace",
        "",
        "-s",
        "local_cwd",
        "trainer/launch/components.py:train_ddp",
        "--j",
        "1x1",
        "--gpu",
        "0",
        "--config",
        "configs/smoke.yaml",
        "--checkpoint_mount",
        "",
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--data_dir",
        str(tmp_path / "data"),
        "--",
        "train.epochs=1",
        "train.plot=false",
    ]
    no_torch = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if ".venv" not in d)
    torchx_bin = str(tools_venv / "bin" / "torchx")
    # as written: the venv activated, then `torchx run ...` from PATH
    p = run(
        ["bash", "-c", f'source {tools_venv}/bin/activate && exec torchx "$@"', "torchx", *local],
        env=env(TORCHX_LOG_DIR=str(tmp_path / "logs"), PATH=no_torch),
        timeout=600,
        check=False,
    )
    out = p.stdout + p.stderr
    assert "Job finished: SUCCEEDED" in out and list((tmp_path / "ck").glob("step-*/meta.json")), out[-3000:]
    clone = tmp_path / "clone"  # the tracked files, no .venv
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, clone / f)
    p = run(
        [torchx_bin, *local],
        cwd=clone,
        env=env(TORCHX_LOG_DIR=str(tmp_path / "logs2"), PATH=no_torch),
        timeout=300,
        check=False,
    )
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if "error: no Python here has torch and the trainer" in line]
    assert "Job finished: FAILED" in out and errors and "make venv" in errors[0] and "TRAINER_PYTHON" in errors[0], out[
        -3000:
    ]
    assert "ModuleNotFoundError" not in out and "not found" not in out.replace("error: no Python", ""), out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        # train_single asks for a GPU by default: the fix is the component's flag
        (
            ["trainer/launch/components.py:train_single", "--checkpoint_mount", ""],
            "none is visible; pass --gpu 0 to the component",
        ),
        # the local scheduler mounts nothing: checkpoints would land on a folder of the node
        (
            ["trainer/launch/components.py:train_ddp", "--gpu", "0"],
            "nothing is mounted there: this scheduler mounts nothing",
        ),
    ],
)
def test_torchx_local_bad_input_is_one_line_with_the_components_fix_and_no_traceback(tmp_path, args, words):
    p = torchx(
        "run",
        "--workspace",
        "",
        "-s",
        "local_cwd",
        *args,
        "--config",
        "configs/smoke.yaml",
        "--checkpoint_dir",
        str(tmp_path / "ck" / "run"),
        "--data_dir",
        str(tmp_path / "data"),
        env=env(TORCHX_LOG_DIR=str(tmp_path / "logs")),
        timeout=300,
        check=False,
    )
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if "error: " in line and "structured_error_msg" not in line]
    assert p.returncode != 0 and "Job finished: FAILED" in out, out[-3000:]
    assert errors and words in errors[0], out[-3000:]
    assert "Traceback" not in out and "py_callstack" not in out and "SignalException" not in out, out[-3000:]
    assert not list((tmp_path / "ck").rglob("step-*"))


def test_torchx_kubernetes_dryrun_is_a_valid_volcano_job():
    p = torchx(
        "run",
        "--workspace",
        "",
        "--dryrun",
        "-s",
        "kubernetes",
        "trainer/launch/components.py:train_ddp",
        "--image",
        "reg/cluster-trainer:1",
        "--j",
        "2x8",
        "--gpu",
        "8",
        "--checkpoint_mount",
        "cifar-checkpoints",
        "--data_mount",
        "cifar-data",
        "--",
        "train.epochs=3",
    )
    job = yaml.safe_load(scheduler_request(p.stdout))
    assert job["kind"] == "Job" and job["apiVersion"] == "batch.volcano.sh/v1alpha1"
    jsonschema.Draft7Validator(crd_schema("batch.volcano.sh_jobs.yaml")).validate(job)
    assert job["spec"]["queue"] == "default"  # from .torchxconfig
    tasks = job["spec"]["tasks"]
    assert len(tasks) == 2
    for task in tasks:
        c = task["template"]["spec"]["containers"][0]
        assert c["image"] == "reg/cluster-trainer:1" and c["resources"]["limits"]["nvidia.com/gpu"] in (8, "8")
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert "/checkpoints" in mounts and not mounts["/data"].get("readOnly")  # the first job fills the data volume
        claims = {
            v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in task["template"]["spec"]["volumes"]
        }
        assert claims[mounts["/checkpoints"]["name"]] == "cifar-checkpoints"
        assert "-m trainer train" in c["command"][-1] and "--max-restarts 3" in c["command"][-1]
        # pretrained weights (model.weights) are cached on the checkpoint volume, which outlives the job
        assert {e["name"]: e.get("value") for e in c["env"]}["TORCH_HOME"] == "/checkpoints/.torch"


def readme_torchx_commands() -> list[tuple[dict, list[str]]]:
    """docs/launchers.md's `torchx run` commands: (their environment assignments, their arguments)."""
    block = (
        (ROOT / "docs" / "launchers.md")
        .read_text()
        .split("## Kubernetes and Slurm: TorchX", 1)[1]
        .split("```bash", 1)[1]
        .split("```", 1)[0]
    )
    commands = []
    for cmd in block.replace("\\\n", " ").splitlines():
        words = shlex.split(cmd.split("#", 1)[0])
        if "torchx" in words:
            at = words.index("torchx")
            commands.append((dict(w.split("=", 1) for w in words[:at]), words[at + 1 :]))
    return commands


def test_the_readmes_torchx_commands_dry_run_as_written():
    commands = readme_torchx_commands()
    assert {args[args.index("-s") + 1] for _, args in commands} == {"kubernetes", "slurm", "local_cwd"}
    for assigned, args in commands:
        p = torchx(args[0], "--dryrun", *args[1:], env=env(**assigned))
        request = scheduler_request(p.stdout)
        assert "TRAINER_SLURM_SUPERVISE" in request, request
        if "slurm" in args:  # the CPUs srun must pass on, and the time limit the job saves before
            assert (
                assigned == {"SRUN_CPUS_PER_TASK": "8"}
                and "--cpus-per-task=8" in request
                and "--time=04:00:00" in request
            ), request


def test_torchx_slurm_dryrun_asks_for_the_right_resources():
    p = torchx(
        "run",
        "--workspace",
        "",
        "--dryrun",
        "-s",
        "slurm",
        "trainer/launch/components.py:train_ddp",
        "--j",
        "2x4",
        "--gpu",
        "4",
        "--cpu",
        "16",
        "--checkpoint_dir",
        "/shared/ckpt/cifar",
    )
    script = scheduler_request(p.stdout)
    jobs = [line for line in script.splitlines() if line.startswith("#SBATCH --job-name")]
    assert len(jobs) == 2  # one het group per node
    for line in jobs:
        assert "--gpus-per-task=4" in line and "--cpus-per-task=16" in line and "--ntasks-per-node=1" in line
        assert "--partition" not in line  # the cluster's default partition, unless -cfg names one
    assert "--nproc-per-node 4" in script and "--nnodes 2" in script and "checkpoint.dir=/shared/ckpt/cifar" in script
    assert "/root/" not in script and sys.executable not in script  # no path of the submitting machine in the job
    assert "--rdzv-backend c10d" in script


def test_torchx_slurm_jobs_sharing_a_node_get_their_own_port_and_memory_by_the_gpu():
    """Two TorchX jobs on one Slurm node: rendezvous ports of their own, agreed by every node with no
    word (from the job id); elsewhere (a pod) 29500. An 8-GPU node asks 8 GiB per GPU, not 32 GB."""
    import re

    p = torchx(
        "run",
        "--workspace",
        "",
        "--dryrun",
        "-s",
        "slurm",
        "trainer/launch/components.py:train_ddp",
        "--j",
        "2x8",
        "--checkpoint_dir",
        "/shared/ckpt/cifar",
    )
    script = scheduler_request(p.stdout)
    assert all("--mem=65536" in line for line in script.splitlines() if line.startswith("#SBATCH --job-name")), script
    endpoint = re.search(r"--rdzv-endpoint \"([^\"]+)\"", script)[1]
    ports = {
        job: subprocess.run(
            ["bash", "-c", f'echo "{endpoint}"'],
            capture_output=True,
            text=True,
            check=True,
            env={"PATH": os.environ["PATH"], "TORCHX_RANK0_HOST": "node1", **({"SLURM_JOB_ID": job} if job else {})},
        ).stdout.strip()
        for job in ("7", "1007", "")
    }
    assert ports[""].endswith(":29500") and len(set(ports.values())) == 3, ports
    assert all(20000 <= int(v.rsplit(":", 1)[1]) < 40000 for v in ports.values()), ports


def test_torchx_takes_an_etcd_rendezvous_endpoint():
    p = torchx(
        "run",
        "--workspace",
        "",
        "--dryrun",
        "-s",
        "slurm",
        "trainer/launch/components.py:train_ddp",
        "--j",
        "2:3x4",
        "--gpu",
        "4",
        "--rdzv_endpoint",
        "etcd.example.org:2379",
        "--checkpoint_dir",
        "/shared/ckpt/cifar",
    )
    script = scheduler_request(p.stdout)
    assert "--rdzv-backend etcd-v2" in script and '--rdzv-endpoint "etcd.example.org:2379"' in script, script


@pytest.mark.parametrize(
    "folder, args, words",
    [
        ("multi-node", ["--nodes", "0"], "--nodes=0 must be at least 1"),
        ("multi-node", ["--gpus", "0"], "--gpus=0 must be at least 1"),
        ("multi-node", ["--image", "cluster-trainer:0.1.0"], "is a local name that a cluster cannot pull"),
        ("single-gpu", ["--gpus", "8"], "is one pod with one GPU"),
        ("single-gpu", ["--nodes", "3", "--gpus", "4"], "is one pod with one GPU"),
        ("multi-node", ["--gpus", ""], "GPUS='' is not a whole number"),
        ("multi-node", ["--nodes", "two"], "NODES='two' is not a whole number"),
        ("multi-node", ["--namespace", "Team_A"], "is not a namespace name"),
        ("multi-node", ["--image", "Registry.io/Team/ct:1"], "is not an image reference"),
        ("multi-node", ["--image", "registry.example.com:5000/team/ct"], "has neither tag nor digest"),
        ("storage", [], "the PVCs need a storage class: pass STORAGE_CLASS="),
        ("storage", ["--storage-class", "Not A Name"], "is not a storage class name"),
        (
            "multi-node",
            ["--image", "ghcr.io/team/ct@sha256:0123abcd"],
            "the digest must be sha256: and 64 lower-case hex digits",
        ),
        (
            "multi-node",
            ["--image", "ghcr.io/team/ct@sha256:" + "ABCDEF0123456789" * 4],
            "the digest must be sha256: and 64",
        ),
        ("multi-node", ["--image", "ghcr.io/team/ct@md5:" + "0" * 32], "the digest must be sha256: and 64"),
        ("multi-node", ["--config", "configs/mine.yaml"], "CONFIG=configs/mine.yaml is not in the image"),
        ("multi-node", ["--config", "/etc/passwd"], "is not in the image"),
        ("multi-node", ["--args", "train.epoch=5"], "train.epoch"),
        ("multi-node", ["--args", "train.epochs=-1"], "(CONFIG / ARGS)"),
        ("trainjob-single", ["--gpus", "8"], "use K8S=trainjob for more"),
        ("trainjob-runtime", ["--nodes", "4"], "NODES and GPUS are a TrainJob's"),
        ("trainjob-runtime", ["--args", "train.epochs=5"], "CONFIG and ARGS are a TrainJob's"),
        ("trainjob", ["--no-gang"], "gang scheduling is its runtime's"),
    ],
)
def test_render_refuses_what_no_cluster_can_run_in_one_line(folder, args, words):
    stdin = yaml.safe_dump_all(manifests(folder))
    p = subprocess.run(
        [sys.executable, str(ROOT / "k8s" / "render.py"), *args], input=stdin, capture_output=True, text=True
    )
    assert (
        p.returncode == 2
        and p.stdout == ""
        and p.stderr.startswith("error: ")
        and words in p.stderr
        and p.stderr.count("\n") == 1
    ), p.stderr


@pytest.mark.parametrize(
    "image",
    [
        "registry.example.com:5000/team/ct:0.1.0",
        "localhost:5000/ct:0.1.0",
        "ghcr.io/team/ct@sha256:" + "0123456789abcdef" * 4,
        "ghcr.io/team/ct:0.1.0@sha256:" + "f" * 64,
    ],
)
def test_render_takes_registries_with_a_port_and_digests(image):
    from render import render

    docs = render(manifests("multi-node"), image, nodes=2, gpus=1, namespace="team-a")
    pods = [
        r["template"]["spec"]
        for d in docs
        if d["kind"] == "PyTorchJob"
        for r in d["spec"]["pytorchReplicaSpecs"].values()
    ]
    assert pods and all(c["image"] == image for pod in pods for c in pod["containers"] + pod["initContainers"])
    assert all(d["metadata"]["namespace"] == "team-a" for d in docs)


def test_render_honours_config_and_args_in_every_job_kind():
    from render import render

    for folder in ("multi-node", "trainjob"):
        docs = render(manifests(folder), None, None, None, config="configs/fast.yaml", args=["train.epochs=5"])
        pods = pods_of(docs)
        trainer = [c for pod in pods for c in pod["containers"]]
        data = [c for pod in pods for c in pod.get("initContainers", [])]
        assert trainer and all(
            c["args"][c["args"].index("--config") + 1] == "configs/fast.yaml" and c["args"][-1] == "train.epochs=5"
            for c in trainer
        )
        assert all(c["command"][c["command"].index("--config") + 1] == "configs/fast.yaml" for c in data)
        # the data container prepares the data the trainer reads
        assert all(c["command"][-1] == "train.epochs=5" for c in data)
        assert bool(data) == (folder == "multi-node")  # a TrainJob's workers fetch their data themselves


def test_render_gives_the_data_container_the_shards_too():
    """ARGS="data.name=shards ...": the init container checks the shards instead of fetching CIFAR-10."""
    from render import render

    for folder in ("multi-node", "trainjob", "elastic"):
        docs = render(manifests(folder), None, None, None, args=["data.name=shards", "model.name=resnet50"])
        for c in (c for pod in pods_of(docs) for c in pod["containers"] + pod.get("initContainers", [])):
            words = c.get("args") if c["name"] in ("pytorch", "node") else c.get("command")
            if c["name"] in ("pytorch", "node", "data"):
                assert words[-2:] == ["data.name=shards", "model.name=resnet50"], (folder, c["name"], words)


def test_render_sizes_a_trainjob_and_the_gangs():
    from render import render

    (job,) = render(manifests("trainjob"), "reg/img:2", nodes=4, gpus=2)
    assert job["spec"]["trainer"]["numNodes"] == 4 and job["spec"]["trainer"]["numProcPerNode"] == 2
    assert job["spec"]["trainer"]["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 2, "cpu": "4", "memory": "16Gi"}
    (pod,) = pods_of([job])
    assert [c["image"] for c in pod["containers"] + pod.get("initContainers", [])] == ["reg/img:2"]
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"] == {
        "medium": "Memory",
        "sizeLimit": "4Gi",
    }
    pytorchjob = render(manifests("multi-node"), None, nodes=4, gpus=None)[0]
    assert pytorchjob["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 4}  # all four pods or none
    elastic = render(manifests("elastic"), None, nodes=6, gpus=None)[0]
    assert elastic["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 3}  # the least it runs with


def test_two_trainjobs_with_other_settings_share_the_runtime_unchanged():
    """Each TrainJob carries its image, config, arguments and size; rendering one touches nothing
    of the runtime, and the pods the Trainer makes for the two differ only as the jobs do."""
    from render import render

    shared = runtime()
    one = render(manifests("trainjob"), "reg/a:1", nodes=2, gpus=8, namespace="team-a")
    two = render(
        manifests("trainjob-single"),
        "reg/b:2",
        None,
        None,
        namespace="team-b",
        config="configs/fast.yaml",
        args=["train.epochs=3"],
    )
    assert [d["kind"] for d in one + two] == ["TrainJob", "TrainJob"] and shared == runtime()
    (a,), (b,) = pods_of(one), pods_of(two)
    node_a, node_b = a["containers"][0], b["containers"][0]
    assert (node_a["image"], node_b["image"]) == ("reg/a:1", "reg/b:2")
    assert (
        "configs/default.yaml" in node_a["args"]
        and node_b["args"][-1] == "train.epochs=3"
        and "configs/fast.yaml" in node_b["args"]
    )
    # TRAINJOB_NAME, from the runtime
    assert node_a["env"] == node_b["env"] == pod_templates(shared)["node"]["spec"]["containers"][0]["env"]
    assert node_b["resources"]["limits"]["nvidia.com/gpu"] == 1 and node_a["resources"]["limits"]["nvidia.com/gpu"] == 8
    # installed once: an image (its default) and GANG, no namespace (cluster-scoped)
    (installed,) = render(manifests("trainjob-runtime"), "reg/c:3", None, None, namespace="team-a", gang=False)
    assert "namespace" not in installed["metadata"] and "podGroupPolicy" not in installed["spec"]
    assert pod_templates(installed)["node"]["spec"]["containers"][0]["image"] == "reg/c:3"


def gib(quantity: str) -> float:
    return float(quantity[:-2]) * {"Gi": 1, "Mi": 1 / 1024}[quantity[-2:]]


# the runtime's pods are its TrainJobs'
@pytest.mark.parametrize("folder", [f for f in JOB_DIRS if f not in RUNTIME_DIRS])
def test_shared_memory_fits_in_the_pods_memory_limit(folder):
    """A memory-backed /dev/shm counts against the pod's memory limit: it is a quarter of it, as
    shipped and as make k8s-apply sizes it."""
    from render import render

    for gpus in (None, 1, 8):
        if gpus == 8 and folder in ("single-gpu", "trainjob-single"):
            continue
        docs = render(manifests(folder), None, None, gpus)
        job = next(d for d in docs if d["kind"] in ("PyTorchJob", "TrainJob"))
        assert pods_of(docs)
        for pod in pods_of(docs):
            main = next(c for c in pod["containers"] if c["name"] in ("pytorch", "node"))
            limits = (
                job["spec"]["trainer"]["resourcesPerNode"]["limits"]
                if job["kind"] == "TrainJob"
                else main["resources"]["limits"]
            )
            shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
            assert gib(shm) <= gib(limits["memory"]) / 4, (folder, gpus, shm, limits)


@pytest.fixture(scope="module")
def tools_venv(tmp_path_factory):
    """`make tools`: the cluster targets' own venv, built as a user's would be."""

    def make(venv: Path) -> None:
        p = subprocess.run(
            ["make", "tools", f"TOOLS_VENV={venv}", f"PYTHON={sys.executable}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env(),
        )
        assert p.returncode == 0, p.stdout + p.stderr

    return made_once(tmp_path_factory, "tools-venv", make)


@pytest.mark.slow
def test_the_cluster_targets_need_only_a_small_venv_without_torch(tools_venv):
    py = str(tools_venv / "bin" / "python")
    assert subprocess.run([py, "-c", "import torch"], capture_output=True).returncode != 0
    assert subprocess.run([py, "-c", "import yaml, torchx, kubernetes"], capture_output=True).returncode == 0
    size = sum(f.stat().st_size for f in tools_venv.rglob("*") if f.is_file())
    assert size < 300 * 2**20, f"tools venv is {size / 2**20:.0f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        (["K8S=single-gpu", "GPUS=4", "NODES=3"], "is one pod with one GPU"),
        (["K8S=single-gpu", "NODES=2"], "is one pod with one GPU, not NODES=2; use K8S=multi-node"),
        (["K8S=trainjob-single", "GPUS=4"], "is one pod with one GPU, not GPUS=4; use K8S=trainjob"),
        (["GPUS="], "GPUS='' is not a whole number"),
        (["NODES=two"], "NODES='two' is not a whole number"),
        (["K8S=multinode"], "K8S=multinode is not a job folder of k8s/; use one of: "),
        (["K8S=storage"], "K8S=storage is not a job folder"),
        (["CONFIG=configs/mine.yaml"], "CONFIG=configs/mine.yaml is not in the image"),
        (["ARGS=train.epoch=3"], "train.epoch"),
        (["GANG=maybe"], "GANG=maybe is neither on nor off"),
        (
            ["K8S=multi-node", "NODES=3", "GPUS=8", "ARGS=train.batch_size=500"],
            "train.batch_size=500 is not a multiple of the world size 24",
        ),
        (["K8S=trainjob", "NODES=3", "GPUS=8"], "train.batch_size=512 is not a multiple of the world size 24"),
        (["K8S=elastic", "NODES=4", "GPUS=6"], "train.batch_size=480 does not split over 3 node(s) x 6 process(es)"),
    ],
)
def test_make_k8s_apply_refuses_a_bad_size_in_one_line(tools_venv, args, words):
    p = subprocess.run(
        ["make", "-s", "k8s-apply", f"TOOLS_VENV={tools_venv}", "IMAGE=registry.example.com:5000/team/ct:0.1.0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env(),
    )
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode != 0 and len(errors) == 1 and words in errors[0], p.stderr
    assert "usage:" not in p.stderr and "connection refused" not in p.stderr.lower(), p.stderr


@pytest.mark.slow
def test_make_k8s_apply_takes_single_gpu_without_a_size(tools_venv, tmp_path):
    """K8S=single-gpu with neither NODES nor GPUS (or both 1) renders and reaches kubectl apply
    (a stand-in kubectl here: no cluster), which gets the image."""
    for extra in ([], ["GPUS=1", "NODES=1"]):
        p = subprocess.run(
            [
                "make",
                "-s",
                "k8s-apply",
                f"TOOLS_VENV={tools_venv}",
                "K8S=single-gpu",
                "IMAGE=localhost:5000/ct:0.1.0",
                *extra,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=fake_kubectl(tmp_path),
        )
        assert p.returncode == 0, p.stderr
        assert "localhost:5000/ct:0.1.0" in (tmp_path / "applied.yaml").read_text()


def fake_kubectl(tmp_path: Path) -> dict[str, str]:
    """An environment whose kubectl builds kustomizations (the real one) and writes what it would
    apply to tmp_path/applied.yaml: no cluster here."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "kubectl").write_text(
        f'#!/bin/sh\nif [ "$1" = kustomize ]; then exec {shutil.which("kubectl") or "false"} "$@"; fi\n'
        f'if [ "$1" = get ]; then cat {tmp_path}/existing.json 2>/dev/null; exit 0; fi\ncat > {tmp_path}/applied.yaml\n'
    )
    (fake / "kubectl").chmod(0o755)
    return {**env(), "PATH": f"{fake}:{os.environ['PATH']}"}


@pytest.mark.slow
def test_make_k8s_apply_refuses_to_change_a_trainjob_that_exists(tools_venv, tmp_path):
    """A TrainJob's spec.trainer cannot change: applying other NODES over an existing job is refused
    in one line before anything is applied (the runtime would have changed first); the same
    settings apply again."""
    e = {**fake_kubectl(tmp_path), "USER": "alice"}
    base = ["make", "-s", "k8s-apply", f"TOOLS_VENV={tools_venv}", "K8S=trainjob", "IMAGE=localhost:5000/ct:0.1.0"]
    assert subprocess.run([*base, "NODES=2", "GPUS=8"], cwd=ROOT, capture_output=True, text=True, env=e).returncode == 0
    job = next(d for d in yaml.safe_load_all((tmp_path / "applied.yaml").read_text()) if d and d["kind"] == "TrainJob")
    (tmp_path / "existing.json").write_text(json.dumps({**job, "status": {}}))  # what the API server holds now
    (tmp_path / "applied.yaml").unlink()
    p = subprocess.run([*base, "NODES=4", "GPUS=8"], cwd=ROOT, capture_output=True, text=True, env=e)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode != 0 and len(errors) == 1 and "a TrainJob named trainjob-alice exists" in errors[0], p.stderr
    assert "with other numNodes" in errors[0] and "its own name (make k8s-apply JOB=...)" in errors[0], errors[0]
    assert "kubectl delete trainjob trainjob-alice" in errors[0] and not (tmp_path / "applied.yaml").exists()
    assert subprocess.run([*base, "NODES=2", "GPUS=8"], cwd=ROOT, capture_output=True, text=True, env=e).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["trainjob", "multi-node"])
def test_make_k8s_apply_names_each_users_job_and_run_folder_apart(tools_venv, tmp_path, folder):
    """Two users applying the same folder in one namespace: two jobs, two run folders. JOB= names one."""
    e = fake_kubectl(tmp_path)
    base = ["make", "-s", "k8s-apply", f"TOOLS_VENV={tools_venv}", f"K8S={folder}", "IMAGE=localhost:5000/ct:0.1.0"]
    seen = {}
    for user, extra in (("alice", []), ("bob", []), ("bob", ["JOB=Bob.Second-Run"])):
        p = subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True, env={**e, "USER": user})
        assert p.returncode == 0, p.stderr
        job = next(
            d
            for d in yaml.safe_load_all((tmp_path / "applied.yaml").read_text())
            if d and d["kind"] in ("TrainJob", "PyTorchJob")
        )
        args = (
            job["spec"]["trainer"]["args"]
            if folder == "trainjob"
            else [a for pod in pods_of([job]) for c in pod["containers"] for a in c.get("args", [])]
        )
        seen[job["metadata"]["name"]] = args
    assert list(seen) == [f"{folder}-alice", f"{folder}-bob", "bob-second-run"], list(seen)
    for name, args in seen.items():  # the run folder follows the name (a TrainJob's through $(TRAINJOB_NAME))
        assert (
            "checkpoint.dir=/checkpoints/$(TRAINJOB_NAME)"
            if folder == "trainjob"
            else f"checkpoint.dir=/checkpoints/{name}"
        ) in args, args


@pytest.mark.slow
def test_every_make_k8s_apply_a_manifest_shows_runs_as_written(tools_venv, tmp_path):
    """The `make k8s-apply ...` line in each kustomization's or manifest's comment, as written
    (kubectl a stand-in: no cluster): it renders and reaches kubectl apply with the image, and a
    one-GPU folder's keeps its one GPU (K8S=trainjob-single once exited 2: NODES=2 GPUS=8 by default)."""
    shown = [
        (f, line.split("#", 1)[1].strip())
        for f in sorted((ROOT / "k8s").glob("*/*.yaml"))
        for line in f.read_text().splitlines()
        if line.lstrip().startswith("#") and line.split("#", 1)[1].strip().startswith("make k8s-apply")
    ]
    assert len(shown) >= 6, shown
    for f, command in shown:
        words = shlex.split(command)
        p = subprocess.run(
            [*words[:2], "-s", f"TOOLS_VENV={tools_venv}", *words[2:]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=fake_kubectl(tmp_path),
        )
        assert p.returncode == 0, (f.relative_to(ROOT), command, p.stderr)
        docs = [d for d in yaml.safe_load_all((tmp_path / "applied.yaml").read_text()) if d]
        image = next(w.split("=", 1)[1] for w in words if w.startswith("IMAGE="))
        assert image in (tmp_path / "applied.yaml").read_text(), command
        job = next(d for d in docs if d["kind"] in ("PyTorchJob", "TrainJob", "ClusterTrainingRuntime"))
        if "single" in f.parent.name:
            from render import one_gpu

            assert one_gpu(job), (command, job["spec"])


@pytest.mark.slow
def test_gang_scheduling_is_the_runtimes_opt_in_and_gang_off_leaves_it_out(tools_venv, tmp_path):
    """The Trainer v2 runtime as shipped asks for no PodGroup: it installs on a cluster without
    scheduler-plugins. Its gang form asks for coscheduling's, as k8s/trainjob-runtime-gang or
    GANG=on; the PyTorchJob asks for minAvailable (ignored where the operator has no gang
    scheduler); GANG=off renders neither."""
    assert "podGroupPolicy" not in runtime()["spec"]
    assert manifests("trainjob-runtime-gang")[0]["spec"]["podGroupPolicy"] == {
        "coscheduling": {"scheduleTimeoutSeconds": 300}
    }
    for folder, kind in (("trainjob-runtime", "ClusterTrainingRuntime"), ("multi-node", "PyTorchJob")):
        for gang in ("", "on", "off"):
            p = subprocess.run(
                [
                    "make",
                    "-s",
                    "k8s-apply",
                    f"TOOLS_VENV={tools_venv}",
                    f"K8S={folder}",
                    "IMAGE=localhost:5000/ct:0.1.0",
                    f"GANG={gang}",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                env=fake_kubectl(tmp_path),
            )
            assert p.returncode == 0, p.stderr
            doc = next(
                d for d in yaml.safe_load_all((tmp_path / "applied.yaml").read_text()) if d and d["kind"] == kind
            )
            asked = "podGroupPolicy" in doc["spec"] or "schedulingPolicy" in doc["spec"].get("runPolicy", {})
            assert asked == (gang == "on" or (gang == "" and kind == "PyTorchJob")), (folder, gang, doc["spec"])


@pytest.mark.slow
def test_make_k8s_apply_sizes_the_etcd_job_and_leaves_etcd_as_it_is(tools_venv, tmp_path):
    """k8s/elastic-etcd's own command: the job gets the image and the size, the etcd Deployment
    keeps etcd's image, and the workers' rendezvous is the etcd Service."""
    shown = next(
        line
        for line in (ROOT / "k8s" / "elastic-etcd" / "kustomization.yaml").read_text().splitlines()
        if "make k8s-apply" in line
    )
    words = shlex.split(shown.lstrip("# "))
    p = subprocess.run(
        [*words[:2], "-s", f"TOOLS_VENV={tools_venv}", *words[2:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=fake_kubectl(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all((tmp_path / "applied.yaml").read_text())}
    assert set(docs) == {"Service", "Deployment", "PyTorchJob"}
    assert docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"].startswith("quay.io/coreos/etcd:")
    worker = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]
    c = worker["template"]["spec"]["containers"][0]
    assert (
        c["image"] == "ghcr.io/you/cluster-trainer:0.1.0"
        and worker["replicas"] == 4
        and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    )
    service = docs["Service"]
    assert f"--rdzv-endpoint={service['metadata']['name']}:{service['spec']['ports'][0]['port']}" in c["args"]


@pytest.mark.slow
def test_make_k8s_apply_honours_config_and_args(tools_venv, tmp_path):
    p = subprocess.run(
        [
            "make",
            "-s",
            "k8s-apply",
            f"TOOLS_VENV={tools_venv}",
            "K8S=trainjob",
            "IMAGE=localhost:5000/ct:0.1.0",
            "CONFIG=configs/fast.yaml",
            "ARGS=train.epochs=5 optim.lr=0.2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=fake_kubectl(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    (job,) = [d for d in yaml.safe_load_all((tmp_path / "applied.yaml").read_text()) if d]
    args = job["spec"]["trainer"]["args"]
    assert args[args.index("--config") + 1] == "configs/fast.yaml" and args[-2:] == ["train.epochs=5", "optim.lr=0.2"]


def test_make_slurm_submit_checks_the_args_and_passes_them_to_sbatch(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/submitted\n')
    (fake / "sbatch").chmod(0o755)
    p = subprocess.run(
        ["make", "-s", "slurm-submit", "NODES=2", "GPUS=8", "ARGS=train.epochs=3 optim.lr=0.2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env(), "PATH": f"{fake}:{os.environ['PATH']}"},
    )
    assert p.returncode == 0 and not p.stderr, p.stderr
    assert (tmp_path / "submitted").read_text().split() == [
        "--nodes=2",
        "--gpus-per-node=8",
        "slurm/ddp.sh",
        "train.epochs=3",
        "optim.lr=0.2",
    ]


@pytest.mark.parametrize(
    "args, words",
    [
        (["NODES=abc"], "NODES='abc' is not a whole number of at least 1"),
        (["GPUS=-1"], "GPUS='-1' is not a whole number"),
        (["NODES=0"], "NODES='0' is not a whole number"),
        (["CONFIG=configs/nope.yaml"], "CONFIG=configs/nope.yaml does not exist"),
        (["ARGS=train.epoch=3"], "unknown config key 'train.epoch'; did you mean train.epochs?"),
        (["NODES=3", "GPUS=7"], "is not a multiple of"),
    ],
)
def test_make_slurm_submit_refuses_bad_input_before_sbatch(tmp_path, args, words):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/submitted\n")
    (fake / "sbatch").chmod(0o755)
    p = subprocess.run(
        ["make", "-s", "slurm-submit", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env(), "PATH": f"{fake}:{os.environ['PATH']}"},
    )
    lines = [x for x in p.stderr.splitlines() if x.strip() and not x.startswith("make")]
    assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], p.stderr
    assert not (tmp_path / "submitted").exists()


@pytest.mark.slow
def test_make_torchx_k8s_refuses_a_local_image_and_a_missing_cluster_in_one_line(tools_venv, tmp_path):
    bare = {**env(), "HOME": str(tmp_path)}
    bare.pop("KUBECONFIG", None)
    for args, words in (
        ([], "error: --image=cluster-trainer:0.1.0 is a local name"),
        (["IMAGE=ghcr.io/team/ct:0.1.0"], "error: no Kubernetes cluster configured"),
    ):
        p = subprocess.run(
            ["make", "-s", "torchx-k8s", f"TOOLS_VENV={tools_venv}", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=bare,
        )
        lines = [x for x in p.stderr.splitlines() if x.strip() and not x.startswith("make")]
        assert p.returncode != 0 and len(lines) == 1 and words in lines[0], p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_make_torchx_k8s_uses_the_namespace_of_k8s_storage_and_k8s_apply(tools_venv, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    # a configured cluster whose current namespace is team-b
    (fake / "kubectl").write_text('#!/bin/sh\ncase "$2" in view) echo team-b;; esac\n')
    (fake / "kubectl").chmod(0o755)
    for extra, namespace in (([], "team-b"), (["NAMESPACE=team-a"], "team-a")):
        p = subprocess.run(
            [
                "make",
                "-s",
                "torchx-k8s",
                f"TOOLS_VENV={tools_venv}",
                "IMAGE=ghcr.io/team/ct:0.1.0",
                "TORCHX_FLAGS=--dryrun",
                *extra,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**env(), "PATH": f"{fake}:{os.environ['PATH']}"},
        )
        assert p.returncode == 0, p.stderr
        assert f"torchx-k8s: namespace {namespace} (" in p.stdout and "=== SCHEDULER REQUEST ===" in p.stdout, (
            p.stdout + p.stderr
        )[-3000:]


@pytest.mark.slow
def test_make_k8s_apply_stops_before_kubectl_apply_on_a_local_image_name(tools_venv):
    p = subprocess.run(
        ["make", "k8s-apply", f"TOOLS_VENV={tools_venv}"], cwd=ROOT, capture_output=True, text=True, env=env()
    )
    assert p.returncode != 0 and "error: --image=cluster-trainer:0.1.0 is a local name" in p.stderr, p.stderr
    assert "connection refused" not in p.stderr.lower() and "no objects passed" not in p.stderr, p.stderr


@pytest.mark.parametrize("component", ["train_ddp", "train_single"])
def test_torchx_checkpoints_go_to_the_storage_pvc_unless_told_otherwise(component):
    def claims(*extra: str) -> list:
        p = torchx(
            "run",
            "--workspace",
            "",
            "--dryrun",
            "-s",
            "kubernetes",
            f"trainer/launch/components.py:{component}",
            "--image",
            "reg/cluster-trainer:1",
            *extra,
        )
        pod = yaml.safe_load(scheduler_request(p.stdout))["spec"]["tasks"][0]["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        return [
            (v["persistentVolumeClaim"]["claimName"], mounts[v["name"]])
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        ]

    pvc = next(d for d in manifests("storage") if "checkpoints" in d["metadata"]["name"])["metadata"]["name"]
    assert claims() == [(pvc, "/checkpoints")]  # the PVC k8s/storage makes: checkpoints outlive the pods
    assert claims("--checkpoint_mount", "") == []


def test_torchx_ddp_asks_one_gpu_per_process_unless_told_otherwise():
    def limits(*extra: str) -> list:
        p = torchx(
            "run",
            "--workspace",
            "",
            "--dryrun",
            "-s",
            "kubernetes",
            "trainer/launch/components.py:train_ddp",
            "--image",
            "reg/cluster-trainer:1",
            "--j",
            "2x4",
            *extra,
        )
        job = yaml.safe_load(scheduler_request(p.stdout))
        return [
            t["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
            for t in job["spec"]["tasks"]
        ]

    assert [int(x) for x in limits()] == [4, 4]  # --j 2x4 without --gpu: GPU pods, not silent CPU pods
    assert all(x in (None, 0, "0") for x in limits("--gpu", "0"))


def test_torchx_elastic_range_reaches_torchrun_and_the_scheduler():
    """--j MIN:MAXxN: the Volcano job asks for MAX pods and starts with MIN (the tasks' minAvailable
    add up to it), and every pod's command hands torchrun the range, which `trainer torchrun`
    checks against the batch. (TorchX 0.7 also asks Volcano to restart the whole job when a pod
    fails: on Kubernetes through TorchX a lost pod restarts the job, which may then start with MIN.)"""
    p = torchx(
        "run",
        "--workspace",
        "",
        "--dryrun",
        "-s",
        "kubernetes",
        "trainer/launch/components.py:train_ddp",
        "--image",
        "reg/cluster-trainer:1",
        "--j",
        "2:3x8",
        "--",
        "train.batch_size=480",
    )
    job = yaml.safe_load(scheduler_request(p.stdout))
    assert len(job["spec"]["tasks"]) == 3 and sum(t["minAvailable"] for t in job["spec"]["tasks"]) == 2, job["spec"][
        "tasks"
    ]
    command = " ".join(job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["command"])
    assert "--nnodes 2:3" in command and "--nproc-per-node 8" in command and "train.batch_size=480" in command, command


def test_no_test_reads_anything_beside_the_repository():
    """A clone with nothing beside it runs `make test`: no test names a folder next to the checkout
    (real images come from $TRAINER_TEST_DATA, schemas from tests/schemas)."""
    beside = re.compile(r"\.\./shared|parent\s*/\s*\"shared\"|parents\[\d\]\s*/\s*\"shared\"")
    found = [
        f"{p.name}:{i}"
        for p in sorted((ROOT / "tests").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if beside.search(line)
    ]
    assert found == []


def test_the_component_names_the_mounts_variable_the_supervisor_reads():
    """components.py cannot import the trainer (torchx runs its text from a venv that may lack it):
    its copy of the variable's name must be the contract's."""
    from trainer import contract
    from trainer.launch import components

    assert components.MOUNTS_ENV == contract.MOUNTS_ENV


def test_make_takes_shards_or_an_image_folder_as_data(tmp_path):
    """make run-local DATA=... and make compose-up DATA=...: a folder of shards (it holds train.json)
    trains as data.name=shards, any other folder as an image folder."""
    from conftest import make_jpegs

    from trainer.worker.data.shards import write

    write(make_jpegs(tmp_path / "img", train=2, test=1), tmp_path / "sh")
    for data, name in ((tmp_path / "sh", "shards"), (tmp_path / "img", "imagefolder")):
        local = run(["make", "-n", "run-local", f"DATA={data}"], cwd=ROOT).stdout
        compose = run(["make", "-n", "compose-up", f"DATA={data}"], cwd=ROOT).stdout
        assert f"data.name={name} data.dir={data}" in local and f"DATA={data} DATA_NAME={name} " in compose, (
            local,
            compose,
        )


@pytest.mark.slow
def test_make_run_local_from_a_fresh_clone_offline_picks_a_cpu_job_on_the_synthetic_set(tmp_path):
    """The README's first command on a machine with no GPU and no internet: `make run-local` in a
    fresh clone says which job it picked and why, that CIFAR-10 could not be downloaded and what
    trains instead (with the line for real data), then trains with no torchrun banner, exit 0."""
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(ROOT), str(clone)])
    venv = ROOT / ".venv"  # the suite's own venv: a fresh one costs minutes (.ci/run builds it from a fresh clone)
    offline = {
        "https_proxy": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(clone),
    }
    e = env(**offline)
    e.pop("OMP_NUM_THREADS")  # as on a fresh machine: torchrun would print its banner about it
    p = subprocess.run(
        [
            "make",
            "run-local",
            f"VENV={venv}",
            "-o",
            f"{venv}/bin/.installed",
            "ARGS=train.epochs=1 data.synthetic_train_size=4096",
        ],
        cwd=clone,
        env=e,
        capture_output=True,
        text=True,
        timeout=600,
    )
    err = p.stderr.splitlines()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert err[0].startswith("no GPU here: configs/cpu.yaml, a small network for 4 epochs of CIFAR-10"), err[:3]
    assert err[1].startswith("CIFAR-10 could not be downloaded (") and err[1].endswith(
        "training on the synthetic set instead (generated images: its accuracy says nothing of CIFAR-10). "
        "With a copy of CIFAR-10 here: make run-local DATA=/path/to/cifar10"
    ), err[:3]
    assert "synthetic set (generated, not real images): 4,096 train" in p.stdout + p.stderr
    assert "OMP_NUM_THREADS" not in p.stdout + p.stderr
    assert (clone / "checkpoints" / "cpu" / "curves.png").exists()


def test_make_help_lists_every_target_with_one_line():
    out = run(
        ["make", "--no-print-directory", "help"], cwd=ROOT
    ).stdout.splitlines()  # no Entering-directory lines under make -C
    listed = {line.split()[0] for line in out[1:]}
    phony = set(re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split())
    assert listed == phony and all(len(line.split(None, 1)) == 2 for line in out[1:]), out


def test_make_run_local_names_the_config_only_when_given():
    assert "--config auto " in run(["make", "-n", "run-local"], cwd=ROOT).stdout
    assert (
        "--config configs/fast.yaml " in run(["make", "-n", "run-local", "CONFIG=configs/fast.yaml"], cwd=ROOT).stdout
    )
