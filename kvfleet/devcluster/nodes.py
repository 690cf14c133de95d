"""Fake GPU nodes for kwok: what a GPU node of a real cluster advertises, and nothing it runs."""

from __future__ import annotations

from typing import Any

# kwok manages only the nodes carrying this annotation (so it never touches a real node).
NODE_SELECTOR_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
MAX_GPU_NODES = 500  # bench/scale.py runs 200; each fake node costs kwok a lease renewal every ~40 s
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set by NVIDIA's GPU feature discovery on real nodes


def gpu_nodes(count: int, *, gpus: int, product: str, cpu: str = "64", memory: str = "512Gi") -> list[dict[str, Any]]:
    """``count`` Node objects with ``gpus`` allocatable GPUs of ``product`` each."""
    if not 0 < count <= MAX_GPU_NODES:
        raise ValueError(f"gpu node count must be 1..{MAX_GPU_NODES}, got {count}")
    capacity = {"cpu": cpu, "memory": memory, "pods": "110", GPU_RESOURCE: str(gpus)}
    return [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": f"kwok-gpu-{i}",
                "annotations": {NODE_SELECTOR_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": f"kwok-gpu-{i}",
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    # Spread over three zones, as a real GPU node pool is (topology spread needs it).
                    "topology.kubernetes.io/zone": f"zone-{'abc'[i % 3]}",
                    "type": "kwok",
                    GPU_PRODUCT_LABEL: product,
                    "nvidia.com/gpu.count": str(gpus),
                },
            },
            "spec": {},
            "status": {"capacity": capacity, "allocatable": capacity},
        }
        for i in range(count)
    ]
