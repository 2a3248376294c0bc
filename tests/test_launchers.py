"""Launchers, validated for real: hadolint, shellcheck, the Compose Specification, the Kubernetes and
Kubeflow schemas, kustomize, a simulated training operator running the PyTorchJob's own commands,
and TorchX (a real local_cwd run and the kubernetes and slurm dry runs)."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import ROOT, env, free_port, run

SCHEMAS = ROOT.parent / "shared" / "schemas"
K8S_DIRS = ["storage", "multi-node", "single-gpu", "elastic"]
TINY_JOB = ["model.name=tinynet", "data.name=synthetic", "data.synthetic_train_size=512", "data.synthetic_test_size=128",
            "train.batch_size=32", "train.epochs=1", "train.plot=false", "train.log_every=8"]


def bin_(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else (shutil.which(name) or name)


def crd_schema(name: str) -> dict:
    crd = yaml.safe_load((SCHEMAS / name).read_text())
    return next(v for v in crd["spec"]["versions"] if v.get("storage"))["schema"]["openAPIV3Schema"]


def manifests(folder: str) -> list[dict]:
    """The folder's manifests; an overlay (a kustomization alone, k8s/elastic) as kustomize builds it."""
    files = [f for f in sorted((ROOT / "k8s" / folder).glob("*.yaml")) if f.name != "kustomization.yaml"]
    if not files:
        kubectl = shutil.which("kubectl")
        assert kubectl, "kubectl is needed (.ci/run installs Debian's kubernetes-client when it is missing)"
        built = subprocess.run([kubectl, "kustomize", f"k8s/{folder}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
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
    assert re.search(r"COPY [^\n]*constraints\.txt", text) and "-c constraints.txt ." in text
    assert not re.search(r"torch==|torchvision==", text), "versions live in constraints.txt alone"
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    readme = (ROOT / "README.md").read_text()
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
    assert train["shm_size"] == "${SHM_SIZE:-8g}" and "8g" in (ROOT / "README.md").read_text()
    assert "${DATA:-./data}:/data:ro" in train["volumes"] and "${CHECKPOINTS:-./checkpoints}:/checkpoints" in train["volumes"]
    assert train["user"] == "${USER_ID:-1000}:${GROUP_ID:-1000}"
    assert "NPROC_PER_NODE" in train["environment"]


# ------------------------------------------------------------------------------------------------
# Slurm and shell


def test_shell_scripts_are_shellcheck_clean():
    scripts = [*map(str, (ROOT / "slurm").glob("*.sh")), *map(str, (ROOT / "tests" / "slurm").glob("*.sh")), str(ROOT / ".ci" / "run")]
    p = subprocess.run([bin_("shellcheck"), "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


# ------------------------------------------------------------------------------------------------
# Kubernetes


@pytest.mark.parametrize("folder", K8S_DIRS)
def test_every_manifest_validates(folder):
    pytorchjob = crd_schema("kubeflow.org_pytorchjobs.yaml")
    pod_template = yaml.safe_load((SCHEMAS / "k8s" / "podtemplatespec-v1.json").read_text())
    pvc = yaml.safe_load((SCHEMAS / "k8s" / "persistentvolumeclaim-v1.json").read_text())
    docs = manifests(folder)
    assert docs
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            assert doc["apiVersion"] == "kubeflow.org/v1"
            jsonschema.Draft7Validator(pytorchjob).validate(doc)
            for replica in doc["spec"]["pytorchReplicaSpecs"].values():
                jsonschema.Draft7Validator(pod_template).validate(replica["template"])
        else:
            kubernetes_validate.validate(doc, "1.30", strict=True)
            if doc["kind"] == "PersistentVolumeClaim":
                jsonschema.Draft7Validator(pvc).validate(doc)


def test_a_broken_manifest_fails_validation():
    doc = manifests("multi-node")[0]
    doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(yaml.safe_load((SCHEMAS / "k8s" / "podtemplatespec-v1.json").read_text())).validate(
            doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"])


@pytest.mark.parametrize("folder", K8S_DIRS)
def test_kustomize_builds(folder):
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed (.ci/run installs Debian's kubernetes-client when it is missing)"
    out = subprocess.run([kubectl, "kustomize", f"k8s/{folder}"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(out.stdout) if d]
    # the PVCs are theirs alone: `kubectl delete -k k8s/<job>` deletes only what this builds
    assert kinds == (["PersistentVolumeClaim"] * 2 if folder == "storage" else ["PyTorchJob"]), kinds
    if folder != "storage":
        assert "ghcr.io/cluster-trainer/cluster-trainer:0.1.0" in out.stdout


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}


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
        if "ALL" not in sc.get("capabilities", {}).get("drop", []) or set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")) or sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: may run as root")
        if sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile")
        bad += [f"{name}: hostPort" for p in c.get("ports", []) if p.get("hostPort")]
    return bad


def test_every_pod_passes_pod_security_restricted():
    pods = [r["template"]["spec"] for f in ("multi-node", "single-gpu", "elastic") for d in manifests(f) if d["kind"] == "PyTorchJob"
            for r in d["spec"]["pytorchReplicaSpecs"].values()]
    assert len(pods) == 4
    for pod in pods:
        assert restricted(pod) == []
    broken = copy.deepcopy(pods[0])
    del broken["containers"][0]["securityContext"]
    del broken["securityContext"]["seccompProfile"]
    assert restricted(broken) == ["data: seccompProfile", "pytorch: allowPrivilegeEscalation != false", "pytorch: capabilities",
                                  "pytorch: seccompProfile"]


CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["single-gpu", "multi-node", "elastic"])
def test_checkov_finds_nothing_unwaived_in_the_pod_templates(folder, tmp_path):
    """checkov (`make test-slow` installs it) on every pod template, each wrapped as the Job that
    checkov knows (it skips PyTorchJobs), with the PyTorchJob's waivers: every check passes or is
    waived in the manifest with its reason."""
    assert CHECKOV.exists(), "checkov is missing: make test-slow installs it (.venv-checkov)"
    jobs = []
    for doc in manifests(folder):
        if doc["kind"] == "PyTorchJob":
            for replica, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                meta = {"name": f"{doc['metadata']['name']}-{replica.lower()}", "annotations": doc["metadata"].get("annotations", {})}
                jobs.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {"template": spec["template"]}})
    waivers = {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in jobs[0]["metadata"]["annotations"].items() if k.startswith("checkov.io/skip")}
    assert all(len(reason) > 20 for reason in waivers.values()), waivers  # each with its reason
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump_all(jobs))
    p = subprocess.run([str(CHECKOV), "-f", str(tmp_path / "jobs.yaml"), "--framework", "kubernetes", "--skip-download", "-o", "json"],
                       capture_output=True, text=True, env={**env(), "BC_SKIP_MAPPING": "TRUE"})
    assert p.stdout.lstrip().startswith("{"), p.stderr[-3000:]
    report = json.loads(p.stdout)
    results = report["results"]
    failed = [(c["check_id"], c["resource"]) for c in results["failed_checks"]]
    skipped = {c["check_id"] for c in results["skipped_checks"]}
    assert not failed, failed
    assert skipped == set(waivers), (skipped, waivers)  # no stale waiver either
    assert len(results["passed_checks"]) >= 40 * len(jobs)  # it did look (about 84 checks a template)


def test_render_sets_the_storage_class_of_every_pvc():
    sys.path.insert(0, str(ROOT / "k8s"))
    from render import render

    docs = render(manifests("storage"), None, None, None, storage_class="efs-sc")
    assert [d["spec"]["storageClassName"] for d in docs] == ["efs-sc", "efs-sc"]
    assert all(d["spec"]["accessModes"] == ["ReadWriteMany"] for d in docs)


def test_pytorchjob_has_what_a_cluster_needs():
    job = next(d for d in manifests("multi-node") if d["kind"] == "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    for replica in specs.values():
        assert replica["restartPolicy"] == "OnFailure"
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
    assert not any(a.startswith("--rdzv-endpoint") or a.startswith("--nnodes") for a in args)  # the operator's, not ours
    paths = {"/checkpoints": tmp_path / "checkpoints", "/data": tmp_path / "data"}
    cmd = local_command(c, variables, paths, ["train.batch_size=512", "data.name=synthetic"])
    p = run(cmd, env=env(**variables), check=False, timeout=60)  # PET_NPROC_PER_NODE=8, as the job asks
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "(--nnodes 3:4)" in lines[0] and "24, 32 processes" in lines[0], p.stderr
    from trainer.config import check_world_range, load_config

    check_world_range(load_config(ROOT / "configs" / "default.yaml", ["train.batch_size=480"]), variables["PET_NNODES"], 8)
    sys.path.insert(0, str(ROOT / "k8s"))
    from render import render

    spec = render([job], "reg/img:2", nodes=6, gpus=4)[0]["spec"]  # NODES is the most pods; the least stays
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 6 and spec["elasticPolicy"] == {**spec["elasticPolicy"], "minReplicas": 3, "maxReplicas": 6}
    assert render([copy.deepcopy(job)], None, nodes=2, gpus=None)[0]["spec"]["elasticPolicy"]["minReplicas"] == 2


def test_render_sets_image_nodes_and_gpus():
    sys.path.insert(0, str(ROOT / "k8s"))
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
        assert set(specs) == {"Worker"} and policy.get("rdzvBackend", "c10d") == "c10d"
        assert policy["minReplicas"] <= specs["Worker"]["replicas"] <= policy["maxReplicas"]
    else:
        assert "Master" in specs and specs["Master"].get("replicas", 1) == 1
    for replica in specs.values():
        containers = replica["template"]["spec"]["containers"]
        assert any(c["name"] == "pytorch" and c.get("image") for c in containers)


def operator_env(job: dict, role: str, index: int) -> dict[str, str]:
    specs = job["spec"]["pytorchReplicaSpecs"]
    if "elasticPolicy" in job["spec"]:  # the training operator's elastic variables (pkg/controller.v1/pytorch/elastic.go)
        policy, name = job["spec"]["elasticPolicy"], job["metadata"]["name"]
        worker = specs["Worker"]["template"]["spec"]["containers"][0]
        port = policy.get("rdzvPort") or next((p["containerPort"] for p in worker.get("ports", []) if p["name"] == "pytorchjob-port"), 23456)
        return {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": job["spec"].get("nprocPerNode", "1"), "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
                "PET_RDZV_ENDPOINT": f"{policy.get('rdzvHost', f'{name}-worker-0')}:{port}",
                "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}", "PET_MAX_RESTARTS": str(policy.get("maxRestarts", 3))}
    pods = sum(r.get("replicas", 1) for r in specs.values())
    nproc = job["spec"].get("nprocPerNode", "1")
    master = specs["Master"]["template"]["spec"]["containers"][0]
    port = next((p["containerPort"] for p in master.get("ports", []) if p["name"] == "pytorchjob-port"), 23456)
    rank = 0 if role == "Master" else index + 1
    addr = f"{job['metadata']['name']}-master-0"
    world = pods * int(nproc) if nproc.isdigit() else pods
    return {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(pods), "MASTER_ADDR": addr, "PET_MASTER_ADDR": addr,
            "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank), "PET_NODE_RANK": str(rank)}


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
    exe = {"torchrun": [sys.executable, "-m", "torch.distributed.run"], "trainer": [sys.executable, "-m", "trainer"]}[out[0]]
    return [*exe, *out[1:], *extra]


@pytest.mark.slow
def test_operator_simulation_runs_the_pytorchjob_and_resumes(tmp_path):
    job = next(d for d in manifests("multi-node") if d["kind"] == "PyTorchJob")
    admit(job)
    job["spec"]["nprocPerNode"] = "1"  # one CPU process per pod on this 2-core machine
    port = free_port()
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = port
    paths = {"/checkpoints": tmp_path / "checkpoints", "/data": tmp_path / "data"}
    for p in paths.values():
        p.mkdir()
    replicas = [(role, i) for role, spec in job["spec"]["pytorchReplicaSpecs"].items() for i in range(spec.get("replicas", 1))]

    def run_pods(epochs: int) -> list[str]:
        procs = []
        for role, i in replicas:
            pod = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
            variables = operator_env(job, role, i)
            variables["MASTER_ADDR"] = variables["PET_MASTER_ADDR"] = "127.0.0.1"  # the master's service name
            pod_env = env(**variables)
            for init in pod.get("initContainers", []):
                run(local_command(init, variables, paths, TINY_JOB), env=pod_env)
            c = next(c for c in pod["containers"] if c["name"] == "pytorch")
            pod_env.update({e["name"]: e["value"] for e in c.get("env", [])})
            cmd = local_command(c, variables, paths, [*TINY_JOB, f"train.epochs={epochs}"])
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=pod_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * len(procs), outs[0][-3000:]
        return outs

    outs = run_pods(1)
    ckpt = paths["/checkpoints"] / job["metadata"]["name"]
    assert "strategy ddp x2" in outs[0] and (ckpt / "step-16" / "state.pt").is_file()
    outs = run_pods(2)  # a restarted job: same volumes, more epochs
    assert "resuming from" in outs[0] and (ckpt / "step-32" / "state.pt").is_file()


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
    p = torchx("run", "--workspace", "", "-s", "local_cwd", "trainer/components.py:train_ddp", "--j", "1x2", "--gpu", "0", "--config", "configs/smoke.yaml",
               "--checkpoint_mount", "", "--checkpoint_dir", str(tmp_path / "ck"), "--data_dir", str(tmp_path / "data"), "--", "train.epochs=1",
               "train.plot=false", env=env(TORCHX_LOG_DIR=str(tmp_path / "logs"), PATH=path), timeout=600)
    out = p.stdout + p.stderr
    assert "Job finished: SUCCEEDED" in out and "strategy ddp x2" in out, out[-3000:]
    assert (tmp_path / "ck" / "step-32" / "state.pt").is_file()
    assert "CUDA_VISIBLE_DEVICES" not in out  # a CPU job (--gpu 0) asks for no GPU: no TorchX warning block


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    # train_single asks for a GPU by default: the fix is the component's flag
    (["trainer/components.py:train_single", "--checkpoint_mount", ""], "none is visible; pass --gpu 0 to the component"),
    # the local scheduler mounts nothing: checkpoints would land on a folder of the node
    (["trainer/components.py:train_ddp", "--gpu", "0"], "nothing is mounted there: this scheduler mounts nothing"),
])
def test_torchx_local_bad_input_is_one_line_with_the_components_fix_and_no_traceback(tmp_path, args, words):
    p = torchx("run", "--workspace", "", "-s", "local_cwd", *args, "--config", "configs/smoke.yaml", "--checkpoint_dir", str(tmp_path / "ck" / "run"),
               "--data_dir", str(tmp_path / "data"), env=env(TORCHX_LOG_DIR=str(tmp_path / "logs")), timeout=300, check=False)
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if "error: " in line and "structured_error_msg" not in line]
    assert p.returncode != 0 and "Job finished: FAILED" in out, out[-3000:]
    assert errors and words in errors[0], out[-3000:]
    assert "Traceback" not in out and "py_callstack" not in out and "SignalException" not in out, out[-3000:]
    assert not list((tmp_path / "ck").rglob("step-*"))


def test_torchx_kubernetes_dryrun_is_a_valid_volcano_job():
    p = torchx("run", "--workspace", "", "--dryrun", "-s", "kubernetes", "trainer/components.py:train_ddp", "--image", "reg/cluster-trainer:1",
               "--j", "2x8", "--gpu", "8", "--checkpoint_mount", "cifar-checkpoints", "--data_mount", "cifar-data", "--", "train.epochs=3")
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
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in task["template"]["spec"]["volumes"]}
        assert claims[mounts["/checkpoints"]["name"]] == "cifar-checkpoints"
        assert "-m trainer train" in c["command"][-1] and "--max-restarts 3" in c["command"][-1]


def readme_torchx_commands() -> list[tuple[dict, list[str]]]:
    """The README's `torchx run` commands: (their environment assignments, their arguments)."""
    block = (ROOT / "README.md").read_text().split("### Kubernetes and Slurm: TorchX", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = []
    for cmd in block.replace("\\\n", " ").splitlines():
        words = shlex.split(cmd.split("#", 1)[0])
        if "torchx" in words:
            at = words.index("torchx")
            commands.append((dict(w.split("=", 1) for w in words[:at]), words[at + 1:]))
    return commands


def test_the_readmes_torchx_commands_dry_run_as_written():
    commands = readme_torchx_commands()
    assert {args[args.index("-s") + 1] for _, args in commands} == {"kubernetes", "slurm", "local_cwd"}
    for assigned, args in commands:
        p = torchx(args[0], "--dryrun", *args[1:], env=env(**assigned))
        request = scheduler_request(p.stdout)
        assert "TRAINER_SLURM_SUPERVISE" in request, request
        if "slurm" in args:  # the CPUs srun must pass on, and the time limit the job saves before
            assert assigned == {"SRUN_CPUS_PER_TASK": "8"} and "--cpus-per-task=8" in request and "--time=04:00:00" in request, request


def test_torchx_slurm_dryrun_asks_for_the_right_resources():
    p = torchx("run", "--workspace", "", "--dryrun", "-s", "slurm", "trainer/components.py:train_ddp", "--j", "2x4", "--gpu", "4", "--cpu", "16",
               "--checkpoint_dir", "/shared/ckpt/cifar")
    script = scheduler_request(p.stdout)
    jobs = [line for line in script.splitlines() if line.startswith("#SBATCH --job-name")]
    assert len(jobs) == 2  # one het group per node
    for line in jobs:
        assert "--gpus-per-task=4" in line and "--cpus-per-task=16" in line and "--ntasks-per-node=1" in line
        assert "--partition" not in line  # the cluster's default partition, unless -cfg names one
    assert "--nproc-per-node 4" in script and "--nnodes 2" in script and "checkpoint.dir=/shared/ckpt/cifar" in script
    assert "/root/" not in script and sys.executable not in script  # no path of the submitting machine in the job


@pytest.mark.parametrize("folder, args, words", [
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
])
def test_render_refuses_what_no_cluster_can_run_in_one_line(folder, args, words):
    stdin = yaml.safe_dump_all(manifests(folder))
    p = subprocess.run([sys.executable, str(ROOT / "k8s" / "render.py"), *args], input=stdin, capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.startswith("error: ") and words in p.stderr and p.stderr.count("\n") == 1, p.stderr


@pytest.mark.parametrize("image", ["registry.example.com:5000/team/ct:0.1.0", "localhost:5000/ct:0.1.0",
                                   "ghcr.io/team/ct@sha256:" + "0123456789abcdef" * 4, "ghcr.io/team/ct:0.1.0@sha256:" + "f" * 64])
def test_render_takes_registries_with_a_port_and_digests(image):
    from render import render

    docs = render(manifests("multi-node"), image, nodes=2, gpus=1, namespace="team-a")
    pods = [r["template"]["spec"] for d in docs if d["kind"] == "PyTorchJob" for r in d["spec"]["pytorchReplicaSpecs"].values()]
    assert pods and all(c["image"] == image for pod in pods for c in pod["containers"] + pod["initContainers"])
    assert all(d["metadata"]["namespace"] == "team-a" for d in docs)


@pytest.fixture(scope="module")
def tools_venv(tmp_path_factory):
    """`make tools`: the cluster targets' own venv, built as a user's would be."""
    venv = tmp_path_factory.mktemp("tools") / "venv"
    p = subprocess.run(["make", "tools", f"TOOLS_VENV={venv}", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, env=env())
    assert p.returncode == 0, p.stdout + p.stderr
    return venv


@pytest.mark.slow
def test_the_cluster_targets_need_only_a_small_venv_without_torch(tools_venv):
    py = str(tools_venv / "bin" / "python")
    assert subprocess.run([py, "-c", "import torch"], capture_output=True).returncode != 0
    assert subprocess.run([py, "-c", "import yaml, torchx, kubernetes"], capture_output=True).returncode == 0
    size = sum(f.stat().st_size for f in tools_venv.rglob("*") if f.is_file())
    assert size < 300 * 2**20, f"tools venv is {size / 2**20:.0f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["K8S=single-gpu", "GPUS=4", "NODES=3"], "is one pod with one GPU"),
    (["K8S=single-gpu", "NODES=2"], "is one pod with one GPU"),
    (["GPUS="], "GPUS='' is not a whole number"),
    (["NODES=two"], "NODES='two' is not a whole number"),
])
def test_make_k8s_apply_refuses_a_bad_size_in_one_line(tools_venv, args, words):
    p = subprocess.run(["make", "-s", "k8s-apply", f"TOOLS_VENV={tools_venv}", "IMAGE=registry.example.com:5000/team/ct:0.1.0", *args],
                       cwd=ROOT, capture_output=True, text=True, env=env())
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode != 0 and len(errors) == 1 and words in errors[0], p.stderr
    assert "usage:" not in p.stderr and "connection refused" not in p.stderr.lower(), p.stderr


@pytest.mark.slow
def test_make_k8s_apply_takes_single_gpu_without_a_size(tools_venv, tmp_path):
    """K8S=single-gpu with neither NODES nor GPUS (or both 1) renders and reaches kubectl apply
    (a stand-in kubectl here: no cluster), which gets the image."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "kubectl").write_text(f"#!/bin/sh\nif [ \"$1\" = kustomize ]; then exec {shutil.which('kubectl') or 'false'} \"$@\"; fi\ncat > {tmp_path}/applied.yaml\n")
    (fake / "kubectl").chmod(0o755)
    for extra in ([], ["GPUS=1", "NODES=1"]):
        p = subprocess.run(["make", "-s", "k8s-apply", f"TOOLS_VENV={tools_venv}", "K8S=single-gpu", "IMAGE=localhost:5000/ct:0.1.0", *extra],
                           cwd=ROOT, capture_output=True, text=True, env={**env(), "PATH": f"{fake}:{os.environ['PATH']}"})
        assert p.returncode == 0, p.stderr
        assert "localhost:5000/ct:0.1.0" in (tmp_path / "applied.yaml").read_text()


@pytest.mark.slow
def test_make_k8s_apply_stops_before_kubectl_apply_on_a_local_image_name(tools_venv):
    p = subprocess.run(["make", "k8s-apply", f"TOOLS_VENV={tools_venv}"], cwd=ROOT, capture_output=True, text=True, env=env())
    assert p.returncode != 0 and "error: --image=cluster-trainer:0.1.0 is a local name" in p.stderr, p.stderr
    assert "connection refused" not in p.stderr.lower() and "no objects passed" not in p.stderr, p.stderr


@pytest.mark.parametrize("component", ["train_ddp", "train_single"])
def test_torchx_checkpoints_go_to_the_storage_pvc_unless_told_otherwise(component):
    def claims(*extra: str) -> list:
        p = torchx("run", "--workspace", "", "--dryrun", "-s", "kubernetes", f"trainer/components.py:{component}", "--image", "reg/cluster-trainer:1", *extra)
        pod = yaml.safe_load(scheduler_request(p.stdout))["spec"]["tasks"][0]["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        return [(v["persistentVolumeClaim"]["claimName"], mounts[v["name"]]) for v in pod["volumes"] if "persistentVolumeClaim" in v]

    pvc = next(d for d in manifests("storage") if "checkpoints" in d["metadata"]["name"])["metadata"]["name"]
    assert claims() == [(pvc, "/checkpoints")]  # the PVC k8s/storage makes: checkpoints outlive the pods
    assert claims("--checkpoint_mount", "") == []


def test_torchx_ddp_asks_one_gpu_per_process_unless_told_otherwise():
    def limits(*extra: str) -> list:
        p = torchx("run", "--workspace", "", "--dryrun", "-s", "kubernetes", "trainer/components.py:train_ddp", "--image", "reg/cluster-trainer:1",
                   "--j", "2x4", *extra)
        job = yaml.safe_load(scheduler_request(p.stdout))
        return [t["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for t in job["spec"]["tasks"]]

    assert [int(x) for x in limits()] == [4, 4]  # --j 2x4 without --gpu: GPU pods, not silent CPU pods
    assert all(x in (None, 0, "0") for x in limits("--gpu", "0"))


def test_torchx_elastic_range_reaches_torchrun_and_the_scheduler():
    """--j MIN:MAXxN: the Volcano job asks for MAX pods and starts with MIN (the tasks' minAvailable
    add up to it), and every pod's command hands torchrun the range, which `trainer torchrun`
    checks against the batch. (TorchX 0.7 also asks Volcano to restart the whole job when a pod
    fails: on Kubernetes through TorchX a lost pod restarts the job, which may then start with MIN.)"""
    p = torchx("run", "--workspace", "", "--dryrun", "-s", "kubernetes", "trainer/components.py:train_ddp", "--image", "reg/cluster-trainer:1",
               "--j", "2:3x8", "--", "train.batch_size=480")
    job = yaml.safe_load(scheduler_request(p.stdout))
    assert len(job["spec"]["tasks"]) == 3 and sum(t["minAvailable"] for t in job["spec"]["tasks"]) == 2, job["spec"]["tasks"]
    command = " ".join(job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["command"])
    assert "--nnodes 2:3" in command and "--nproc-per-node 8" in command and "train.batch_size=480" in command, command
