"""Set image, nodes and GPUs in a built kustomization (`make k8s-apply`), or the storage class of
the PVCs (`make k8s-storage`), and the namespace of either:
    kubectl kustomize k8s/multi-node | python k8s/render.py --image IMG --nodes 4 --gpus 8 | kubectl apply -f -
    kubectl kustomize k8s/storage | python k8s/render.py --storage-class efs-sc --namespace team-a | kubectl apply -f -
"""

from __future__ import annotations

import argparse
import re
import sys

import yaml


class RenderError(ValueError):
    """Inputs that would render a job no cluster can run (every schema still accepts it)."""


RWX_HINT = "a ReadWriteMany class (kubectl get storageclass; e.g. efs-sc on EKS, standard-rwx on GKE, azurefile-csi on AKS, an NFS class)"
NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# An image reference as the OCI distribution spec and Docker's reference grammar have it:
# [registry[:port]/]path[:tag][@algorithm:digest]
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
REFERENCE = re.compile(rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
                       r"(?::(?P<tag>\w[\w.-]{0,127}))?(?:@(?P<digest>[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,}))?$")


def check_image(image: str) -> None:
    """A reference a cluster can pull: a registry (with or without a port) or a path of more than
    one component, a tag or a digest or both."""
    m = REFERENCE.match(image)
    if not m or len(image) > 255:
        raise RenderError(f"--image={image} is not an image reference; use IMAGE=REGISTRY[:PORT]/NAME:TAG or IMAGE=REGISTRY/NAME@sha256:DIGEST")
    if m["domain"] is None and "/" not in m["path"]:
        raise RenderError(f"--image={image} is a local name that a cluster cannot pull; push the image to a registry (make image push REGISTRY=...) and pass IMAGE=REGISTRY/NAME:TAG")
    if not (m["tag"] or m["digest"]):
        raise RenderError(f"--image={image} has neither tag nor digest; pass IMAGE=...:TAG or IMAGE=...@sha256:DIGEST (a digest pins the exact image)")


def check(docs: list[dict], image: str | None, nodes: int | None, gpus: int | None, storage_class: str | None = None,
          namespace: str | None = None) -> None:
    if namespace is not None and not (LABEL.match(namespace) and len(namespace) <= 63):
        raise RenderError(f"--namespace={namespace!r} is not a namespace name (lower-case letters, digits and '-', at most 63); pass e.g. NAMESPACE=team-a")
    if nodes is not None and nodes < 1:
        raise RenderError(f"--nodes={nodes} must be at least 1 (NODES=...)")
    if gpus is not None and gpus < 1:
        raise RenderError(f"--gpus={gpus} must be at least 1 (GPUS=...): these manifests are GPU jobs")
    if image is not None:
        check_image(image)
    pvcs = [d for d in docs if d.get("kind") == "PersistentVolumeClaim"]
    if pvcs and storage_class is None:
        raise RenderError(f"the PVCs need a storage class: pass STORAGE_CLASS=... (--storage-class), {RWX_HINT}; the default classes of EKS, GKE and AKS are ReadWriteOnce and leave them Pending")
    if storage_class is not None and not NAME.match(storage_class):
        raise RenderError(f"--storage-class={storage_class!r} is not a storage class name; use {RWX_HINT}")
    for doc in docs:
        if doc.get("kind") == "PyTorchJob" and "Worker" not in doc["spec"]["pytorchReplicaSpecs"] and ((nodes or 1) > 1 or (gpus or 1) > 1):
            raise RenderError(f"{doc['metadata']['name']} is one pod with one GPU, not NODES={nodes} GPUS={gpus}; use K8S=multi-node for more")


def render(docs: list[dict], image: str | None, nodes: int | None, gpus: int | None, storage_class: str | None = None,
           namespace: str | None = None) -> list[dict]:
    check(docs, image, nodes, gpus, storage_class, namespace)
    for doc in docs:
        if namespace:
            doc["metadata"]["namespace"] = namespace
        if doc.get("kind") == "PersistentVolumeClaim":
            doc["spec"]["storageClassName"] = storage_class
        if doc.get("kind") != "PyTorchJob":
            continue
        spec = doc["spec"]
        replicas = spec["pytorchReplicaSpecs"]
        if gpus is not None:
            spec["nprocPerNode"] = str(gpus)
        if nodes is not None and "elasticPolicy" in spec:  # Workers only: NODES is the most, the least stays (or shrinks to it)
            replicas["Worker"]["replicas"] = spec["elasticPolicy"]["maxReplicas"] = nodes
            spec["elasticPolicy"]["minReplicas"] = min(spec["elasticPolicy"]["minReplicas"], nodes)
        elif nodes is not None and "Worker" in replicas:
            replicas["Worker"]["replicas"] = nodes - 1
        for replica in replicas.values():
            pod = replica["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                if image:
                    c["image"] = image
                if gpus is not None and c["name"] == "pytorch":
                    for part in ("limits", "requests"):
                        c["resources"][part].update({"nvidia.com/gpu": gpus, "cpu": str(2 * gpus), "memory": f"{8 * gpus}Gi"})
    return docs


def count(flag: str, value: str | None) -> int | None:
    """A whole number from make's NODES=/GPUS= (the error names the make variable)."""
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]+", value.strip()):
        raise RenderError(f"{flag.upper()}={value!r} is not a whole number; pass e.g. {flag.upper()}={'2' if flag == 'nodes' else '8'}")
    return int(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--image")
    p.add_argument("--nodes")
    p.add_argument("--gpus")
    p.add_argument("--storage-class")
    p.add_argument("--namespace")
    a = p.parse_args()
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    try:
        out = render(docs, a.image, count("nodes", a.nodes), count("gpus", a.gpus), a.storage_class, a.namespace)
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    yaml.safe_dump_all(out, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
