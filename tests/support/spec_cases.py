"""Valid and invalid InferenceDeployment documents shared by the API tests."""

from __future__ import annotations

import copy
from typing import Any


def base() -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {
            "model": {"uri": "s3://model-cache/models/llama"},
            "engine": {"kind": "vllm", "tensorParallelSize": 1},
            "resources": {"gpus": 1},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 4},
            "cache": {"bucket": "model-cache"},
        },
    }


def put(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set a dotted path (creating dicts on the way); value DELETE removes the key."""
    doc = copy.deepcopy(doc)
    node = doc
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return doc


DELETE = object()

# (id, edits [(path, value)], the field path the error must name, a word the message must contain)
CASES: list[tuple[str, list[tuple[str, Any]], str, str]] = [
    (
        "min-gt-max",
        [("spec.autoscaling.minReplicas", 5), ("spec.autoscaling.maxReplicas", 2)],
        "spec.autoscaling.minReplicas",
        "maxReplicas",
    ),
    (
        "max-request-over-the-drain-bound",
        [("spec.engine.maxRequestSeconds", 7200)],
        "spec.engine.maxRequestSeconds",
        "3600",
    ),
    (
        "tp-not-dividing-gpus",
        [("spec.engine.tensorParallelSize", 3), ("spec.resources.gpus", 4)],
        "spec.engine.tensorParallelSize",
        "divide",
    ),
    (
        "scale-to-zero-needs-min-0",
        [("spec.autoscaling.minReplicas", 1), ("spec.autoscaling.scaleToZeroAfterSeconds", 60)],
        "spec.autoscaling.scaleToZeroAfterSeconds",
        "minReplicas",
    ),
    ("replicas-with-autoscaling", [("spec.replicas", 3)], "spec.replicas", "autoscaling"),
    ("max-model-len-zero", [("spec.engine.maxModelLen", 0)], "spec.engine.maxModelLen", "greater"),
    ("max-model-len-negative", [("spec.engine.maxModelLen", -5)], "spec.engine.maxModelLen", "greater"),
    ("unknown-uri-scheme", [("spec.model.uri", "gs://bucket/model")], "spec.model.uri", "scheme"),
    ("no-uri-scheme", [("spec.model.uri", "/models/llama")], "spec.model.uri", "scheme"),
    ("bad-bucket-in-uri", [("spec.model.uri", "s3://Bad_Bucket/x")], "spec.model.uri", "bucket"),
    ("bad-cache-bucket", [("spec.cache.bucket", "UPPER_case")], "spec.cache.bucket", "bucket"),
    ("dotdot-in-cache-prefix", [("spec.cache.prefix", "models/../secrets/")], "spec.cache.prefix", ".."),
    (
        "dotdot-in-artifacts-prefix",
        [("spec.cache.artifacts", {"enabled": True, "prefix": "../x"})],
        "spec.cache.artifacts.prefix",
        "..",
    ),
    ("dotdot-in-uri", [("spec.model.uri", "file:///models/../etc")], "spec.model.uri", ".."),
    ("unknown-top-level-field", [("spec.replcas", 2)], "spec.replcas", "unknown field"),
    ("unknown-nested-field", [("spec.engine.tensorParalelSize", 2)], "spec.engine.tensorParalelSize", "unknown field"),
    ("bad-engine-kind", [("spec.engine.kind", "tgi")], "spec.engine.kind", "vllm"),
    ("bad-strategy", [("spec.routing", {"strategy": "random"})], "spec.routing.strategy", "prefix"),
    ("pickle-without-consent", [("spec.model.format", "pickle")], "spec.model.format", "allowPickle"),
    (
        "gpu-memory-utilization-over-1",
        [("spec.engine.gpuMemoryUtilization", 1.5)],
        "spec.engine.gpuMemoryUtilization",
        "1",
    ),
    ("negative-gpus", [("spec.resources.gpus", -1)], "spec.resources.gpus", "greater"),
    (
        "sglang-without-gpus",
        [("spec.engine.kind", "sglang"), ("spec.resources.gpus", 0)],
        "spec.resources.gpus",
        "gpus",
    ),
    ("max-replicas-zero", [("spec.autoscaling.maxReplicas", 0)], "spec.autoscaling.maxReplicas", "greater"),
    ("max-replicas-unbounded", [("spec.autoscaling.maxReplicas", 10**9)], "spec.autoscaling.maxReplicas", "less"),
    (
        "load-bound-below-1",
        [("spec.routing", {"loadImbalanceBound": 0.5})],
        "spec.routing.loadImbalanceBound",
        "greater",
    ),
    (
        "queue-wait-shorter-than-cold-start",
        [("spec.routing", {"maxQueueWaitSeconds": 5}), ("spec.autoscaling.coldStartSeconds", 60)],
        "spec.routing.maxQueueWaitSeconds",
        "coldStartSeconds",
    ),
    (
        "panic-window-not-shorter",
        [("spec.autoscaling.panicWindowSeconds", 60), ("spec.autoscaling.windowSeconds", 60)],
        "spec.autoscaling.panicWindowSeconds",
        "windowSeconds",
    ),
    ("bad-quantity", [("spec.resources.memory", "lots")], "spec.resources.memory", "pattern"),
    ("managed-flag-in-extra-args", [("spec.engine.extraArgs", ["--port=9000"])], "spec.engine.extraArgs", "--port"),
    (
        "env-value-and-value-from",
        [("spec.engine.env", [{"name": "X", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])],
        "spec.engine.env[0].valueFrom",
        "not both",
    ),
    (
        "env-ref-neither",
        [("spec.engine.env", [{"name": "X", "valueFrom": {}}])],
        "spec.engine.env[0].valueFrom.secretKeyRef",
        "exactly one",
    ),
    (
        "host-path-missing",
        [("spec.cache.nodeCache", {"type": "hostPath"})],
        "spec.cache.nodeCache.hostPath",
        "hostPath",
    ),
    (
        "host-path-relative",
        [("spec.cache.nodeCache", {"type": "hostPath", "hostPath": "var/cache"})],
        "spec.cache.nodeCache.hostPath",
        "pattern",
    ),
    ("artifacts-without-bucket", [("spec.cache", {"artifacts": {"enabled": True}})], "spec.cache.bucket", "bucket"),
    ("name-not-dns-label", [("metadata.name", "Llama_8B")], "metadata.name", "DNS-1035"),
    ("name-too-long", [("metadata.name", "a" * 60)], "metadata.name", "at most"),
    (
        "bad-toleration-operator",
        [("spec.scheduling", {"tolerations": [{"operator": "In"}]})],
        "spec.scheduling.tolerations[0].operator",
        "Exists",
    ),
    (
        "target-concurrency-zero",
        [("spec.autoscaling.targetConcurrencyPerReplica", 0)],
        "spec.autoscaling.targetConcurrencyPerReplica",
        "greater",
    ),
    (
        "kv-target-over-1",
        [("spec.autoscaling.targetKVCacheUtilization", 1.2)],
        "spec.autoscaling.targetKVCacheUtilization",
        "less",
    ),
    (
        "tp-without-gpus",
        [("spec.engine", {"kind": "reference", "tensorParallelSize": 2}), ("spec.resources.gpus", 0)],
        "spec.engine.tensorParallelSize",
        "GPUs",
    ),
    (
        "vllm-unknown-quantization",
        [("spec.engine", {"kind": "vllm", "quantization": "bitsandbytes"})],
        "spec.engine.quantization",
        "not a vLLM method",
    ),
    ("wrong-type", [("spec.autoscaling.minReplicas", "two")], "spec.autoscaling.minReplicas", "integer"),
    ("missing-model", [("spec.model", DELETE)], "spec.model", "required"),
]
