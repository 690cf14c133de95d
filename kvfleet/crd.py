"""Generate the InferenceDeployment CRD from the pydantic models (the models are the source).

pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3.0 schema. The
conversion inlines ``$ref``s, folds ``Optional`` (``anyOf [X, null]``) into X, turns numeric
``exclusiveMinimum: x`` into the v3.0 boolean form, drops ``title`` and ``null`` defaults, and never
leaves ``additionalProperties`` beside ``properties``. CEL rules mirror the cross-field validators
in ``kvfleet.spec`` so ``kubectl apply`` rejects what the operator would reject, before it is stored.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kvfleet.contracts import MODEL_URI_PATTERN
from kvfleet.spec import (
    GROUP,
    KIND,
    MANAGED_ENGINE_FLAGS,
    MAX_NAME_CHARS,
    NAME_PATTERN,
    PLURAL,
    QUANTITY_PATTERN,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    VLLM_UNKNOWN_QUANTIZATION,
    AutoscalingSpec,
    EngineSpec,
    InferenceDeploymentSpec,
    RoutingSpec,
)
from kvfleet.status import InferenceDeploymentStatus

# The file name under crds/ (and charts/kvfleet/crds/); where that folder is, the caller says.
CRD_FILE_NAME = f"{PLURAL}.{GROUP}.yaml"

# The only nodes that keep unknown fields, and why. A test fails on any other.
PRESERVE_UNKNOWN_FIELDS = {
    "spec.scheduling.affinity": (
        "Kubernetes' Affinity type is large and versioned with the cluster; it is copied verbatim into "
        "the engine pod spec, where the API server validates it against its own schema."
    ),
}

# Model defaults the cross-field rules need when a field is omitted (the API server defaults a field
# only when its parent object is present).
_ENGINE_KIND = EngineSpec.model_fields["kind"].default
_MIN_REPLICAS = AutoscalingSpec.model_fields["min_replicas"].default
_COLD_START_S = float(AutoscalingSpec.model_fields["cold_start_seconds"].default)
_QUEUE_WAIT_S = float(RoutingSpec.model_fields["max_queue_wait_seconds"].default)
_MANAGED_FLAGS = ", ".join(f"'{flag}'" for flag in sorted(MANAGED_ENGINE_FLAGS))
_VLLM_UNKNOWN_QUANTIZATION = ", ".join(f"'{q}'" for q in sorted(VLLM_UNKNOWN_QUANTIZATION))

# CEL rules, keyed by the dotted schema path of the object they sit on. Each mirrors a validator
# in kvfleet.spec (named in the comment) so the API server rejects the same specs, and its
# fieldPath makes the API server name the same field `kvfleet validate` names.
CEL_RULES: dict[str, list[dict[str, str]]] = {
    "spec": [
        {  # InferenceDeploymentSpec._cross_checks: replicas xor autoscaling
            "rule": "!(has(self.replicas) && has(self.autoscaling) && "
            "(!has(self.autoscaling.enabled) || self.autoscaling.enabled))",
            "message": "spec.replicas is set while spec.autoscaling.enabled is true; remove one "
            "(kubectl scale works only with autoscaling off)",
            "fieldPath": ".replicas",
        },
        {  # InferenceDeploymentSpec._cross_checks: tensor parallel size divides gpus
            "rule": "!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus == 0 || "
            "!has(self.engine) || !has(self.engine.tensorParallelSize) || "
            "self.resources.gpus % self.engine.tensorParallelSize == 0",
            "message": "spec.engine.tensorParallelSize must divide spec.resources.gpus",
            "fieldPath": ".engine.tensorParallelSize",
        },
        {  # InferenceDeploymentSpec._cross_checks: SGLang needs GPUs (vLLM and reference also run on CPU)
            "rule": f"(has(self.engine) && has(self.engine.kind) ? self.engine.kind : '{_ENGINE_KIND}') != "
            "'sglang' || !has(self.resources) || !has(self.resources.gpus) || self.resources.gpus >= 1",
            "message": "spec.resources.gpus must be >= 1 for engine.kind sglang (GPUs needed)",
            "fieldPath": ".resources.gpus",
        },
        {  # InferenceDeploymentSpec._cross_checks: tensor parallelism needs GPUs
            "rule": "!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus != 0 || "
            "!has(self.engine) || !has(self.engine.tensorParallelSize) || self.engine.tensorParallelSize == 1",
            "message": "spec.engine.tensorParallelSize > 1 needs GPUs (spec.resources.gpus is 0)",
            "fieldPath": ".engine.tensorParallelSize",
        },
        {  # InferenceDeploymentSpec._cross_checks: a wake from zero must not time out in the queue
            "rule": "!has(self.autoscaling) || (has(self.autoscaling.enabled) && !self.autoscaling.enabled) || "
            f"(has(self.autoscaling.minReplicas) ? self.autoscaling.minReplicas : {_MIN_REPLICAS}) != 0 || "
            "(has(self.routing) && has(self.routing.maxQueueWaitSeconds) ? "
            f"double(self.routing.maxQueueWaitSeconds) : {_QUEUE_WAIT_S}) >= "
            "(has(self.autoscaling.coldStartSeconds) ? "
            f"double(self.autoscaling.coldStartSeconds) : {_COLD_START_S})",
            "message": "spec.routing.maxQueueWaitSeconds is shorter than spec.autoscaling.coldStartSeconds: "
            "requests that wake the deployment from zero would always time out",
            "fieldPath": ".routing.maxQueueWaitSeconds",
        },
        {  # InferenceDeploymentSpec._cross_checks: a pvc:// model is already in the cluster
            "rule": "!self.model.uri.startsWith('pvc://') || !has(self.cache) || !has(self.cache.bucket)",
            "message": "spec.cache.bucket is for s3:// and hf:// models; a pvc:// model is already in the cluster",
            "fieldPath": ".cache.bucket",
        },
    ],
    "spec.model.uri": [
        {  # ModelSource._known_scheme: the bucket of an s3:// URI
            "rule": "!self.startsWith('s3://') || self.matches('^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$')",
            "message": "spec.model.uri: the bucket is not a valid S3 bucket name",
        },
        {  # ModelSource._known_scheme: no '..' path segment
            "rule": "!self.matches('^[a-z0-9]+://(.*/)?[.][.](/.*)?$')",
            "message": "spec.model.uri must not contain '..' path segments",
        },
    ],
    "spec.engine": [
        {  # EngineSpec._quantization_the_engine_knows
            "rule": f"(has(self.kind) ? self.kind : '{_ENGINE_KIND}') != 'vllm' || !has(self.quantization) || "
            f"!([{_VLLM_UNKNOWN_QUANTIZATION}].exists(q, q == self.quantization))",
            "message": "spec.engine.quantization is not a vLLM method (vLLM refuses it at start)",
            "fieldPath": ".quantization",
        }
    ],
    "spec.engine.extraArgs": [
        {  # EngineSpec._no_managed_flags
            "rule": f"self.all(a, ![{_MANAGED_FLAGS}].exists(f, a == f || a.startsWith(f + '=')))",
            "message": "spec.engine.extraArgs sets a flag kvfleet manages from the spec (--port, --model, "
            "--served-model-name, ...); use the matching engine field instead",
        }
    ],
    "spec.model": [
        {  # ModelSource._pickle_needs_consent
            "rule": "!has(self.format) || self.format != 'pickle' || (has(self.allowPickle) && self.allowPickle)",
            "message": "spec.model.format 'pickle' needs spec.model.allowPickle: true (unpickling can run code)",
            "fieldPath": ".format",
        }
    ],
    "spec.autoscaling": [
        {  # AutoscalingSpec._consistent
            "rule": "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "message": "spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas",
            "fieldPath": ".minReplicas",
        },
        {
            "rule": "!has(self.scaleToZeroAfterSeconds) || (has(self.minReplicas) && self.minReplicas == 0)",
            "message": "spec.autoscaling.scaleToZeroAfterSeconds needs spec.autoscaling.minReplicas: 0",
            "fieldPath": ".scaleToZeroAfterSeconds",
        },
        {
            "rule": "!has(self.panicWindowSeconds) || !has(self.windowSeconds) || "
            "self.panicWindowSeconds < self.windowSeconds",
            "message": "spec.autoscaling.panicWindowSeconds must be < spec.autoscaling.windowSeconds",
            "fieldPath": ".panicWindowSeconds",
        },
    ],
    "spec.cache": [
        {  # CacheSpec._artifacts_need_bucket
            "rule": "!has(self.artifacts) || !has(self.artifacts.enabled) || !self.artifacts.enabled || "
            "has(self.bucket)",
            "message": "spec.cache.artifacts.enabled needs spec.cache.bucket",
            "fieldPath": ".bucket",
        }
    ],
    "spec.cache.nodeCache": [
        {  # NodeCacheSpec._host_path_set
            "rule": "!has(self.type) || self.type != 'hostPath' || has(self.hostPath)",
            "message": "spec.cache.nodeCache.type hostPath needs spec.cache.nodeCache.hostPath",
            "fieldPath": ".hostPath",
        }
    ],
    "spec.engine.env[]": [
        {  # EnvVar._one_source
            "rule": "!(has(self.value) && has(self.valueFrom))",
            "message": "set either value or valueFrom, not both",
            "fieldPath": ".valueFrom",
        }
    ],
    "spec.engine.env[].valueFrom": [
        {  # EnvVarSource._exactly_one
            "rule": "has(self.secretKeyRef) != has(self.configMapKeyRef)",
            "message": "set exactly one of secretKeyRef or configMapKeyRef",
            "fieldPath": ".secretKeyRef",
        }
    ],
}

# String fields whose value is joined under a bucket or directory: no '..' (mirrors _check_prefix).
NO_DOTDOT_PATHS = ("spec.cache.prefix", "spec.cache.artifacts.prefix")

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri", "priority": 0},
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine.kind"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
    {"name": "Status", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP_KEYS = {"title", "discriminator", "propertyNames"}
MAX_MAP_KEYS = 64  # a bound the API server's CEL cost estimate needs for rules over map keys


def _convert(node: Any, defs: dict[str, Any], path: str) -> Any:
    """Rewrite one pydantic JSON-schema node (and its children) into structural OpenAPI v3.0."""
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**copy.deepcopy(target), **node}
    key_rules: list[dict[str, str]] = []
    if "patternProperties" in node:
        # The API server refuses patternProperties in a structural schema: the value schema becomes
        # additionalProperties and the key pattern a CEL rule, over a bounded number of keys.
        ((pattern, value_schema),) = node.pop("patternProperties").items()
        node["additionalProperties"] = value_schema
        node.setdefault("maxProperties", MAX_MAP_KEYS)
        key_rules.append(
            {"rule": f"self.all(k, k.matches('{pattern}'))", "message": f"{path} keys must match {pattern}"}
        )
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b != {"type": "null"}]
        if len(branches) == 1:
            outer = {k: v for k, v in node.items()}
            node = {**_convert(branches[0], defs, path), **outer}
        else:
            node["anyOf"] = branches
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS or (key == "default" and value is None):
            continue
        if key == "properties":
            out[key] = {name: _convert(child, defs, f"{path}.{name}") for name, child in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, f"{path}[]")
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = _convert(value, defs, f"{path}.*")
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if "properties" in out:
        out.pop("additionalProperties", None)
        out.setdefault("type", "object")
    if path in PRESERVE_UNKNOWN_FIELDS:
        out = {
            "type": "object",
            "description": out.get("description", ""),
            "x-kubernetes-preserve-unknown-fields": True,
        }
    elif out.get("type") == "object" and out.get("additionalProperties") is True:
        raise ValueError(f"{path}: free-form object; add it to PRESERVE_UNKNOWN_FIELDS with a reason")
    if out.get("pattern") == QUANTITY_PATTERN:
        # Kubernetes quantities may be written as numbers (cpu: 4) or strings (cpu: 500m).
        out.pop("type", None)
        out["x-kubernetes-int-or-string"] = True
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if path in CEL_RULES or key_rules:
        out["x-kubernetes-validations"] = [*CEL_RULES.get(path, []), *key_rules]
    if path in NO_DOTDOT_PATHS:
        out["x-kubernetes-validations"] = [{"rule": "!self.contains('..')", "message": f"{path} must not contain '..'"}]
    if path == "spec.model.uri":
        out["pattern"] = MODEL_URI_PATTERN
    return out


def _schema_of(model: type[Any], path: str) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _convert(raw, defs, path)


def openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of the v1alpha1 version."""
    return {
        "type": "object",
        "description": "InferenceDeployment serves one model on GPU pods behind kvfleet's router, "
        "with autoscaling (to zero and back), a weight cache and prefix-aware routing.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object (kvfleet.io/v1alpha1)."},
            "kind": {"type": "string", "description": "Kind of this object (InferenceDeployment)."},
            # The API server checks names only as DNS subdomains (253 characters); the children's
            # names append up to 11 characters and must stay DNS-1035 labels. A structural schema may
            # restrict metadata.name (and nothing else of metadata).
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": MAX_NAME_CHARS, "pattern": NAME_PATTERN}},
            },
            "spec": _schema_of(InferenceDeploymentSpec, "spec"),
            "status": _schema_of(InferenceDeploymentStatus, "status"),
        },
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/part-of": "kvfleet"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["kvfleet"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = """\
# Generated by `kvfleet crd generate` from kvfleet/spec/ and kvfleet/status.py. Do not edit:
# change the models and regenerate (a test fails when this file is stale).
#
# x-kubernetes-preserve-unknown-fields appears only at:
{preserve}
"""


def render_crd() -> str:
    preserve = "\n".join(f"#   {path}: {why}" for path, why in PRESERVE_UNKNOWN_FIELDS.items())
    body = yaml.safe_dump(build_crd(), sort_keys=False, width=100, allow_unicode=True)
    return HEADER.format(preserve=preserve) + body


def check_crd(path: Path) -> bool:
    """True when the file on disk is exactly what the models generate."""
    return path.exists() and path.read_text(encoding="utf-8") == render_crd()


def write_crd(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_crd(), encoding="utf-8")
