"""Set image, nodes and GPUs in a built kustomization (`make k8s-apply`), or the storage class of
the PVCs (`make k8s-storage`), and the namespace of either:
    kubectl kustomize k8s/multi-node | python k8s/render.py --image IMG --nodes 4 --gpus 8 | kubectl apply -f -
    kubectl kustomize k8s/storage | python k8s/render.py --storage-class efs-sc --namespace team-a | kubectl apply -f -
    kubectl kustomize k8s/multi-node | python k8s/render.py --as-jobs > jobs.yaml && checkov -f jobs.yaml   # make
    k8s-checkov
A TrainJob holds everything of its job (image, arguments, size, shared memory); the
ClusterTrainingRuntime (k8s/trainjob-runtime) holds nothing of one job and takes only an image
(its default) and GANG.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml


class RenderError(ValueError):
    """Inputs that would render a job no cluster can run (every schema still accepts it)."""


RWX_HINT = (
    "a ReadWriteMany class (kubectl get storageclass; e.g. efs-sc on EKS, standard-rwx on GKE, azurefile-csi on AKS, "
    "an NFS class)"
)
NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# An image reference as the OCI distribution spec and Docker's reference grammar have it:
# [registry[:port]/]path[:tag][@algorithm:digest]
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
REFERENCE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>\w[\w.-]{0,127}))?(?:@(?P<digest>.*))?$"
)
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
"""The only digest the kubelet pulls by: sha256, 64 lower-case hex digits."""


def check_image(image: str) -> None:
    """A reference a cluster can pull: a registry (with or without a port) or a path of more than
    one component, a tag or a digest or both."""
    m = REFERENCE.match(image)
    if not m or len(image) > 255:
        raise RenderError(
            f"--image={image} is not an image reference; use IMAGE=REGISTRY[:PORT]/NAME:TAG or "
            f"IMAGE=REGISTRY/NAME@sha256:DIGEST"
        )
    if m["digest"] is not None and not DIGEST.match(m["digest"]):
        raise RenderError(
            f"--image={image}: the digest must be sha256: and 64 lower-case hex digits (the kubelet pulls no other); "
            "copy it from `make push` or `docker buildx imagetools inspect IMAGE`"
        )
    if m["domain"] is None and "/" not in m["path"]:
        raise RenderError(
            f"--image={image} is a local name that a cluster cannot pull; push the image to a registry (make image "
            f"push REGISTRY=...) and pass IMAGE=REGISTRY/NAME:TAG"
        )
    if not (m["tag"] or m["digest"]):
        raise RenderError(
            f"--image={image} has neither tag nor digest; pass IMAGE=...:TAG or IMAGE=...@sha256:DIGEST (a digest "
            f"pins the exact image)"
        )


def check_run(config: str | None, args: list[str], nnodes: str | None = None, nproc: int | None = None) -> None:
    """CONFIG must ship in the image (configs/), and it and ARGS must load as the trainer loads them;
    with the job's size (``nnodes``: N or MIN:MAX), its global batch must split over every world size."""
    root = Path(__file__).resolve().parent.parent
    if config is not None:
        shipped = sorted(p.name for p in (root / "configs").glob("*.yaml"))
        if Path(config).parent != Path("configs") or Path(config).name not in shipped:
            raise RenderError(
                f"CONFIG={config} is not in the image, which holds configs/ ({', '.join(shipped)}): add the file to "
                "configs/, rebuild and push the image, or pass ARGS=key=value ... on top of a shipped config"
            )
    sys.path.insert(0, str(root))
    from trainer.config import ConfigError, check_world_range
    from trainer.config_loader import load_config  # yaml only: no torch in the tools venv

    try:
        cfg = load_config(root / (config or "configs/default.yaml"), args)
    except ConfigError as e:
        raise RenderError(f"{e} (CONFIG / ARGS)") from None
    try:
        if nnodes is not None and nproc is not None:
            check_world_range(cfg, nnodes, nproc)
    except ConfigError as e:
        raise RenderError(f"{e} (the job's NODES x GPUS: ARGS=train.batch_size=..., or another size)") from None


def job_config(doc: dict) -> tuple[str, list[str]] | None:
    """(the config, the overrides) a job's trainer runs with, from its arguments; None for no job."""
    if doc.get("kind") == "TrainJob":
        line = doc["spec"]["trainer"]["args"]
    elif doc.get("kind") == "PyTorchJob":
        pod = next(iter(doc["spec"]["pytorchReplicaSpecs"].values()))["template"]["spec"]
        line = next(c.get("args", []) for c in pod["containers"] if c["name"] == "pytorch")
    else:
        return None
    tail = line[line.index("train") + 1 :] if "train" in line else []
    config = tail[tail.index("--config") + 1] if "--config" in tail else None
    return config, [
        a for a in tail if "=" in a and not a.startswith("--") and "$(" not in a
    ]  # $(VAR): the pod's, not here


def job_size(doc: dict) -> tuple[str, int] | None:
    """(nodes as torchrun takes them, N or MIN:MAX; processes per node) of a rendered job."""
    spec = doc.get("spec", {})
    if doc.get("kind") == "TrainJob":
        return str(spec["trainer"]["numNodes"]), int(spec["trainer"]["numProcPerNode"])
    if doc.get("kind") == "PyTorchJob":
        nproc = int(spec.get("nprocPerNode", 1))
        if "elasticPolicy" in spec:
            return f"{spec['elasticPolicy']['minReplicas']}:{spec['elasticPolicy']['maxReplicas']}", nproc
        return str(sum(r.get("replicas", 1) for r in spec["pytorchReplicaSpecs"].values())), nproc
    return None


def check_batches(docs: list[dict]) -> None:
    """Each rendered job's global batch against its world size(s): a job that would exit 2 on its
    GPUs is refused before it is applied, as make slurm-submit refuses it."""
    for doc in docs:
        run, size = job_config(doc), job_size(doc)
        if run is not None and size is not None:
            check_run(run[0], run[1], *size)


RUNTIMES = ("ClusterTrainingRuntime", "TrainingRuntime")
"""Kubeflow Trainer v2's runtimes; ours is the cluster-scoped one."""
CLUSTER_SCOPED = ("ClusterTrainingRuntime",)
SHM_PATCH = "cluster-trainer.io/k8s-apply"
"""The manager of a TrainJob's runtime patch that sizes its shared memory."""


def trainer_pods(doc: dict) -> list[dict]:
    """The pod specs of a job kind this renders (a PyTorchJob's replicas, a runtime's Jobs)."""
    if doc.get("kind") == "PyTorchJob":
        return [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    if doc.get("kind") in RUNTIMES:
        return [j["template"]["spec"]["template"]["spec"] for j in doc["spec"]["template"]["spec"]["replicatedJobs"]]
    return []


def as_the_trainer_makes_it(runtime: dict, trainjob: dict) -> list[dict]:
    """The runtime's replicated Jobs as Kubeflow Trainer v2 makes them for ``trainjob``
    (pkg/runtime/framework/plugins/jobset/builder.go, pkg/runtime/core/trainingruntime.go): in the
    container named node, the TrainJob's image, command and args replace the runtime's, its env is
    added and its resourcesPerNode set; then its runtimePatches merge by name (the volumes here)."""
    jobs = copy.deepcopy(runtime["spec"]["template"]["spec"]["replicatedJobs"])
    trainer = trainjob["spec"]["trainer"]
    for job in jobs:
        pod = job["template"]["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c["name"] == "node":
                c.update({k: copy.deepcopy(trainer[k]) for k in ("image", "command", "args") if k in trainer})
                c["env"] = [
                    e for e in c.get("env", []) if e["name"] not in {t["name"] for t in trainer.get("env", [])}
                ] + trainer.get("env", [])
                if "resourcesPerNode" in trainer:
                    c["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
        for patch in trainjob["spec"].get("runtimePatches", []):
            for rj in (
                patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", [])
            ):
                if rj["name"] == job["name"]:
                    for v in rj["template"]["spec"]["template"]["spec"].get("volumes", []):
                        mine = next((x for x in pod["volumes"] if x["name"] == v["name"]), None)
                        if mine is None:
                            pod["volumes"].append(copy.deepcopy(v))
                        else:
                            for key, value in v.items():  # a strategic merge: maps merge, the rest replaces
                                mine[key] = (
                                    {**mine[key], **value}
                                    if isinstance(value, dict) and isinstance(mine.get(key), dict)
                                    else value
                                )
    return jobs


def _shm(trainjob: dict, size: str) -> None:
    """The TrainJob's shared memory, in its runtime patch of the dshm volume."""
    for patch in trainjob["spec"].get("runtimePatches", []):
        if patch["manager"] == SHM_PATCH:
            for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
                for v in rj["template"]["spec"]["template"]["spec"].get("volumes", []):
                    if v["name"] == "dshm":
                        v["emptyDir"]["sizeLimit"] = size


def one_gpu(doc: dict) -> bool:
    """A job of one pod with one GPU (k8s/single-gpu, k8s/trainjob-single)."""
    if doc.get("kind") == "PyTorchJob":
        return "Worker" not in doc["spec"]["pytorchReplicaSpecs"]
    return (
        doc.get("kind") == "TrainJob"
        and doc["spec"]["trainer"].get("numNodes", 1) == 1
        and doc["spec"]["trainer"].get("numProcPerNode") == 1
    )


def check(
    docs: list[dict],
    image: str | None,
    nodes: int | None,
    gpus: int | None,
    storage_class: str | None = None,
    namespace: str | None = None,
) -> None:
    if namespace is not None and not (LABEL.match(namespace) and len(namespace) <= 63):
        raise RenderError(
            f"--namespace={namespace!r} is not a namespace name (lower-case letters, digits and '-', at most 63); "
            f"pass e.g. NAMESPACE=team-a"
        )
    if nodes is not None and nodes < 1:
        raise RenderError(f"--nodes={nodes} must be at least 1 (NODES=...)")
    if gpus is not None and gpus < 1:
        raise RenderError(f"--gpus={gpus} must be at least 1 (GPUS=...): these manifests are GPU jobs")
    if image is not None:
        check_image(image)
    pvcs = [d for d in docs if d.get("kind") == "PersistentVolumeClaim"]
    if pvcs and storage_class is None:
        raise RenderError(
            f"the PVCs need a storage class: pass STORAGE_CLASS=... (--storage-class), {RWX_HINT}; the default "
            f"classes of EKS, GKE and AKS are ReadWriteOnce and leave them Pending"
        )
    if storage_class is not None and not NAME.match(storage_class):
        raise RenderError(f"--storage-class={storage_class!r} is not a storage class name; use {RWX_HINT}")
    for doc in docs:
        if doc.get("kind") in RUNTIMES and (nodes is not None or gpus is not None):
            raise RenderError(
                f"{doc['kind']} {doc['metadata']['name']} is shared by every TrainJob and has no size: NODES and GPUS "
                f"are a "
                "TrainJob's (make k8s-apply K8S=trainjob NODES=... GPUS=...)"
            )
        if one_gpu(doc) and ((nodes or 1) > 1 or (gpus or 1) > 1):
            bigger = "trainjob" if doc["kind"] == "TrainJob" else "multi-node"
            asked = " ".join(f"{k}={v}" for k, v in (("NODES", nodes), ("GPUS", gpus)) if v is not None)
            raise RenderError(
                f"{doc['metadata']['name']} is one pod with one GPU, not {asked}; use K8S={bigger} for more"
            )


def _resources(gpus: int) -> dict:
    return {
        part: {"nvidia.com/gpu": gpus, "cpu": str(2 * gpus), "memory": f"{8 * gpus}Gi"}
        for part in ("limits", "requests")
    }


def _pytorchjob(spec: dict, nodes: int | None, gpus: int | None) -> None:
    replicas = spec["pytorchReplicaSpecs"]
    if gpus is not None:
        spec["nprocPerNode"] = str(gpus)
    if (
        nodes is not None and "elasticPolicy" in spec
    ):  # Workers only: NODES is the most, the least stays (or shrinks to it)
        replicas["Worker"]["replicas"] = spec["elasticPolicy"]["maxReplicas"] = nodes
        spec["elasticPolicy"]["minReplicas"] = min(spec["elasticPolicy"]["minReplicas"], nodes)
    elif nodes is not None and "Worker" in replicas:
        replicas["Worker"]["replicas"] = nodes - 1
    if nodes is not None and "schedulingPolicy" in spec.get(
        "runPolicy", {}
    ):  # the gang: every pod, or the elastic least
        spec["runPolicy"]["schedulingPolicy"]["minAvailable"] = (
            spec["elasticPolicy"]["minReplicas"] if "elasticPolicy" in spec else nodes
        )
    for replica in replicas.values():
        for c in replica["template"]["spec"]["containers"]:
            if gpus is not None and c["name"] == "pytorch":
                c["resources"] = _resources(gpus)


def job_name(name: str) -> str:
    """JOB= as a job's name: a DNS label (lower-case letters, digits and '-', at most 40 characters:
    the operators add suffixes to their pods' names)."""
    fixed = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40].strip("-")
    if not fixed or not fixed[0].isalpha():
        raise RenderError(
            f"JOB={name!r} cannot be a job's name; use lower-case letters, digits and '-', starting with a letter "
            f"(e.g. JOB=cifar-alice)"
        )
    return fixed


def rename(doc: dict, name: str) -> None:
    """A job named ``name``, and its run folder under /checkpoints with it (a TrainJob's follows
    its name already: $(TRAINJOB_NAME))."""
    old = doc["metadata"]["name"]
    doc["metadata"]["name"] = name
    for pod in trainer_pods(doc):
        for c in pod.get("initContainers", []) + pod["containers"]:
            for key in ("args", "command"):
                if c.get(key):
                    c[key] = [
                        a.replace(f"checkpoint.dir=/checkpoints/{old}", f"checkpoint.dir=/checkpoints/{name}")
                        for a in c[key]
                    ]


def render(
    docs: list[dict],
    image: str | None,
    nodes: int | None,
    gpus: int | None,
    storage_class: str | None = None,
    namespace: str | None = None,
    config: str | None = None,
    args: list[str] | None = None,
    gang: bool | None = None,
    name: str | None = None,
) -> list[dict]:
    """``gang``: None leaves gang scheduling as shipped (the PyTorchJobs ask for it, the runtime
    does not); True adds the runtime's coscheduling PodGroup; False leaves out both."""
    check(docs, image, nodes, gpus, storage_class, namespace)
    if config is not None or args:
        runtime = next((d for d in docs if d.get("kind") in RUNTIMES), None)
        if runtime is not None:
            raise RenderError(
                f"{runtime['kind']} {runtime['metadata']['name']} is shared by every TrainJob: CONFIG and ARGS are a "
                "TrainJob's (make k8s-apply K8S=trainjob CONFIG=... ARGS=...)"
            )
        check_run(config, args or [])
    kinds = {d.get("kind") for d in docs}
    if gang is not None and "TrainJob" in kinds and not kinds & set(RUNTIMES):
        raise RenderError(
            "a TrainJob's gang scheduling is its runtime's (podGroupPolicy), chosen when the runtime is installed: "
            "make k8s-apply K8S=trainjob-runtime IMAGE=... GANG=on (or off), then apply the TrainJob without GANG"
        )
    for doc in docs:
        if namespace and doc.get("kind") not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = namespace
        if (
            gang and doc.get("kind") in RUNTIMES
        ):  # a cluster that runs coscheduling: the Trainer makes a PodGroup per TrainJob
            doc["spec"].setdefault("podGroupPolicy", {"coscheduling": {"scheduleTimeoutSeconds": 300}})
        if gang is False:  # a cluster with no gang scheduler: no PodGroup, no minAvailable
            doc.get("spec", {}).pop("podGroupPolicy", None)
            doc.get("spec", {}).get("runPolicy", {}).pop("schedulingPolicy", None)
        if doc.get("kind") == "PersistentVolumeClaim":
            doc["spec"]["storageClassName"] = storage_class
        if name and doc.get("kind") in ("PyTorchJob", "TrainJob"):
            rename(doc, job_name(name))
        if doc.get("kind") == "PyTorchJob":
            _pytorchjob(doc["spec"], nodes, gpus)
        if doc.get("kind") == "TrainJob":  # everything of the job is its own: the runtime stays as installed
            trainer = doc["spec"]["trainer"]
            if nodes is not None:
                trainer["numNodes"] = nodes
            if gpus is not None:
                trainer["numProcPerNode"] = gpus
                trainer["resourcesPerNode"] = _resources(gpus)
                _shm(doc, f"{2 * gpus}Gi")
            if image:
                trainer["image"] = image
            if config is not None:
                trainer["args"][trainer["args"].index("--config") + 1] = config
            if args:
                trainer["args"] += args
        for pod in trainer_pods(doc):
            for c in pod.get("initContainers", []) + pod["containers"]:
                if image:
                    c["image"] = image
                line = c.get("args") if c["name"] in ("pytorch", "node") else c.get("command")
                if config is not None and line and "--config" in line:  # the trainer's and the data container's
                    line[line.index("--config") + 1] = config
                if args and c["name"] in ("pytorch", "node"):
                    c["args"] += args
                elif (
                    args and c["name"] == "data" and line
                ):  # the data it prepares is the one the trainer reads (data.name=shards ...)
                    c["command"] += args
            for v in pod.get("volumes", []):  # shared memory counts against the memory limit: a quarter of it
                if gpus is not None and v.get("emptyDir", {}).get("medium") == "Memory":
                    v["emptyDir"]["sizeLimit"] = f"{2 * gpus}Gi"
    if config is not None or args or nodes is not None or gpus is not None:
        check_batches(docs)
    return docs


def as_jobs(docs: list[dict]) -> list[dict]:
    """Every pod template as the batch/v1 Job that policy scanners know (checkov skips PyTorchJobs
    and runtimes: on our files as shipped it finds 0 resources), each with its job's waivers
    (checkov.io/skip annotations, with their reasons), and every other kind as it is (Services,
    Deployments): `make k8s-checkov`. A TrainJob's pods are its runtime's as the Trainer makes them for it (the runtime
    among ``docs``)."""
    jobs = []
    made = {d["spec"]["runtimeRef"]["name"]: d for d in docs if d.get("kind") == "TrainJob"}
    for doc in copy.deepcopy(docs):
        meta = doc["metadata"]
        waivers = {k: v for k, v in meta.get("annotations", {}).items() if k.startswith("checkov.io/")}
        if doc.get("kind") == "PyTorchJob":
            specs = {
                role.lower(): {"template": r["template"]} for role, r in doc["spec"]["pytorchReplicaSpecs"].items()
            }
        elif doc.get("kind") in RUNTIMES:
            trainjob = made.get(meta["name"])
            replicated = (
                as_the_trainer_makes_it(doc, trainjob)
                if trainjob
                else doc["spec"]["template"]["spec"]["replicatedJobs"]
            )
            specs = {j["name"]: j["template"]["spec"] for j in replicated}
        elif (
            doc.get("kind") != "TrainJob"
        ):  # the rest as they are (the etcd's Deployment and Service): checkov knows them
            jobs.append(doc)
            continue
        else:
            continue
        for name, spec in specs.items():
            template = spec["template"].setdefault("metadata", {})
            template["annotations"] = {
                **template.get("annotations", {}),
                **waivers,
            }  # the pods' own checks (graph checks) see them there
            jobs.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {"name": f"{meta['name']}-{name}", "annotations": waivers},
                    "spec": spec,
                }
            )
    return jobs


def check_existing(docs: list[dict], kubectl: str = "kubectl") -> None:
    """A TrainJob that already exists with other trainer settings (image, arguments, size):
    refused before anything is applied (its spec.trainer cannot change)."""
    for doc in docs:
        if doc.get("kind") != "TrainJob":
            continue
        name, ns = doc["metadata"]["name"], doc["metadata"].get("namespace")
        cmd = [kubectl, "get", "trainjob", name, "-o", "json", "--ignore-not-found", *(["-n", ns] if ns else [])]
        p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode != 0 or not p.stdout.strip():
            continue  # none (or no cluster: kubectl apply says so next)
        live, wanted = json.loads(p.stdout)["spec"].get("trainer", {}), doc["spec"]["trainer"]
        changed = sorted(k for k in wanted if live.get(k) != wanted[k])
        if changed:
            meta = json.loads(p.stdout)["metadata"]
            since = meta.get("creationTimestamp", "an earlier apply")
            where = f" in namespace {ns}" if ns else ""
            raise RenderError(
                f"a TrainJob named {name} exists{where} (created {since}) with other {', '.join(changed)}: a "
                f"TrainJob's "
                f"trainer settings cannot change. Give this run its own name (make k8s-apply JOB=...); or, if {name} "
                f"is "
                f"yours and done with, delete it (kubectl delete trainjob {name}{f' -n {ns}' if ns else ''}: its "
                f"checkpoints "
                "stay on their PVC and a job of that name resumes from them)"
            )


def count(flag: str, value: str | None) -> int | None:
    """A whole number from make's NODES=/GPUS= (the error names the make variable)."""
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]+", value.strip()):
        raise RenderError(
            f"{flag.upper()}={value!r} is not a whole number; pass e.g. "
            f"{flag.upper()}={'2' if flag == 'nodes' else '8'}"
        )
    return int(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--image")
    p.add_argument("--nodes")
    p.add_argument("--gpus")
    p.add_argument("--storage-class")
    p.add_argument("--namespace")
    p.add_argument("--config", help="a config of configs/ (it ships in the image)")
    p.add_argument("--args", help="overrides for the trainer, key=value ... (make's ARGS)")
    p.add_argument("--name", help="the job's name (make's JOB): its run folder under /checkpoints follows it")
    p.add_argument(
        "--gang",
        dest="gang",
        action="store_const",
        const=True,
        help="the runtime's coscheduling PodGroup: make's GANG=on",
    )
    p.add_argument(
        "--no-gang",
        dest="gang",
        action="store_const",
        const=False,
        help="leave out gang scheduling (podGroupPolicy, minAvailable): make's GANG=off",
    )
    p.add_argument(
        "--check-existing",
        action="store_true",
        help="refuse a rendered TrainJob that exists with other trainer settings",
    )
    p.add_argument(
        "--as-jobs", action="store_true", help="every pod template as a batch/v1 Job, with its waivers (for checkov)"
    )
    p.add_argument("--check-image", metavar="IMAGE", help="only check that a cluster can pull IMAGE")
    a = p.parse_args()
    if a.check_image is not None:
        try:
            check_image(a.check_image)
        except RenderError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        return
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    if a.as_jobs:
        yaml.safe_dump_all(as_jobs(docs), sys.stdout, sort_keys=False)
        return
    if a.check_existing:
        try:
            check_existing(docs)
        except RenderError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        return
    try:
        out = render(
            docs,
            a.image,
            count("nodes", a.nodes),
            count("gpus", a.gpus),
            a.storage_class,
            a.namespace,
            a.config,
            shlex.split(a.args) if a.args else None,
            gang=a.gang,
            name=a.name,
        )
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    yaml.safe_dump_all(out, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
