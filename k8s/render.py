"""Set image, nodes and GPUs in a built kustomization (used by `make k8s-apply`):
    kubectl kustomize k8s/multi-node | python k8s/render.py --image IMG --nodes 4 --gpus 8 | kubectl apply -f -
"""

from __future__ import annotations

import argparse
import sys

import yaml


class RenderError(ValueError):
    """Inputs that would render a job no cluster can run (every schema still accepts it)."""


def check(docs: list[dict], image: str | None, nodes: int | None, gpus: int | None) -> None:
    if nodes is not None and nodes < 1:
        raise RenderError(f"--nodes={nodes} must be at least 1 (NODES=...)")
    if gpus is not None and gpus < 1:
        raise RenderError(f"--gpus={gpus} must be at least 1 (GPUS=...): these manifests are GPU jobs")
    if image is not None and "/" not in image.split(":")[0]:
        raise RenderError(f"--image={image} is a local name that a cluster cannot pull; push the image to a registry and pass IMAGE=REGISTRY/NAME:TAG")
    for doc in docs:
        if doc.get("kind") == "PyTorchJob" and "Worker" not in doc["spec"]["pytorchReplicaSpecs"] and ((nodes or 1) > 1 or (gpus or 1) > 1):
            raise RenderError(f"{doc['metadata']['name']} is one pod with one GPU, not NODES={nodes} GPUS={gpus}; use K8S=multi-node for more")


def render(docs: list[dict], image: str | None, nodes: int | None, gpus: int | None) -> list[dict]:
    check(docs, image, nodes, gpus)
    for doc in docs:
        if doc.get("kind") != "PyTorchJob":
            continue
        spec = doc["spec"]
        replicas = spec["pytorchReplicaSpecs"]
        if gpus is not None:
            spec["nprocPerNode"] = str(gpus)
        if nodes is not None and "Worker" in replicas:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--image")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus", type=int)
    a = p.parse_args()
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    try:
        out = render(docs, a.image, a.nodes, a.gpus)
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    yaml.safe_dump_all(out, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
