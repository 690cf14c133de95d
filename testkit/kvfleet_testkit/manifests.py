"""Manifests the benchmarks and tests share, so a benchmark measures what a test asserts: the
InferenceDeployment of the scale runs (bench/scale.py, tests/k8s/test_scale_real.py) and the
launcher's vLLM CPU spec (tests/vllm, bench/cold_start.py)."""

from __future__ import annotations

from typing import Any

UNVETTED_IMAGE = "registry.example/unvetted/engine:1"
"""An image no platform policy that lists its registries allows (the scale runs' policy lists
ghcr.io/kvfleet only): admitted by the API server, refused by the operator with
Degraded=PolicyViolation and an Event."""

SCALE_POLICY: dict[str, Any] = {
    "nodeCacheHostPaths": [],
    "imageRegistries": ["ghcr.io/kvfleet"],
    "priorityClasses": ["*"],
    "tolerationKeys": ["*"],
}
"""The platform policy (``kvfleet operator run --policy-file``) the scale runs give the operator."""


def inference_deployment(
    name: str,
    namespace: str,
    *,
    replicas: int = 1,
    gpus: int = 1,
    gpu_product: str | None = None,
    invalid: bool = False,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """A vLLM InferenceDeployment of ``replicas`` pods with ``gpus`` GPUs each (of ``gpu_product``
    when given); ``invalid``: its image is outside ``SCALE_POLICY``."""
    engine: dict[str, Any] = {"kind": "vllm"}
    if invalid:
        engine["image"] = UNVETTED_IMAGE
    if max_model_len is not None:
        engine["maxModelLen"] = max_model_len
    resources: dict[str, Any] = {"gpus": gpus}
    if gpu_product is not None:
        resources["gpuProduct"] = gpu_product
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": f"s3://model-cache/models/{name}"},
            "engine": engine,
            "resources": resources,
            "replicas": replicas,
            "cache": {"bucket": "model-cache"},
        },
    }


def vllm_cpu_launcher_spec(name: str, served_name: str, uri: str, bucket: str) -> dict[str, Any]:
    """The launcher's spec for vLLM's CPU build on a tiny model in the S3 bucket ``bucket``: eager,
    float32, small blocks and batch, 2 GiB of KV; one builder for tests/vllm and bench/cold_start.py
    so the benchmark times the engine the tests check."""
    return {
        "name": name,
        "namespace": "default",
        "servedName": served_name,
        "spec": {
            "model": {"uri": uri},
            "engine": {
                "kind": "vllm",
                "maxModelLen": 512,
                "dtype": "float32",
                "extraArgs": ["--enforce-eager", "--block-size", "32", "--max-num-seqs", "4"],
            },
            "resources": {"gpus": 0, "memory": "2Gi"},
            "cache": {"bucket": bucket},
        },
    }
