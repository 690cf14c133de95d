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

from kvfleet.spec import (
    GROUP,
    KIND,
    PLURAL,
    QUANTITY_PATTERN,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferenceDeploymentSpec,
)
from kvfleet.status import InferenceDeploymentStatus

CRD_PATH = Path(__file__).resolve().parent.parent / "crds" / f"{PLURAL}.{GROUP}.yaml"

# The only nodes that keep unknown fields, and why. A test fails on any other.
PRESERVE_UNKNOWN_FIELDS = {
    "spec.scheduling.affinity": (
        "Kubernetes' Affinity type is large and versioned with the cluster; it is copied verbatim into "
        "the engine pod spec, where the API server validates it against its own schema."
    ),
}

# CEL rules, keyed by the dotted schema path of the object they sit on. Each mirrors a validator
# in kvfleet.spec (named in the comment) so the API server rejects the same specs.
CEL_RULES: dict[str, list[dict[str, str]]] = {
    "spec": [
        {  # InferenceDeploymentSpec._cross_checks: replicas xor autoscaling
            "rule": "!(has(self.replicas) && has(self.autoscaling) && "
            "(!has(self.autoscaling.enabled) || self.autoscaling.enabled))",
            "message": "spec.replicas is set while spec.autoscaling.enabled is true; remove one "
            "(kubectl scale works only with autoscaling off)",
        },
        {  # InferenceDeploymentSpec._cross_checks: tensor parallel size divides gpus
            "rule": "!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus == 0 || "
            "!has(self.engine) || !has(self.engine.tensorParallelSize) || "
            "self.resources.gpus % self.engine.tensorParallelSize == 0",
            "message": "spec.engine.tensorParallelSize must divide spec.resources.gpus",
        },
    ],
    "spec.model": [
        {  # ModelSource._pickle_needs_consent
            "rule": "!has(self.format) || self.format != 'pickle' || (has(self.allowPickle) && self.allowPickle)",
            "message": "spec.model.format 'pickle' needs spec.model.allowPickle: true (unpickling can run code)",
        }
    ],
    "spec.autoscaling": [
        {  # AutoscalingSpec._consistent
            "rule": "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "message": "spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas",
        },
        {
            "rule": "!has(self.scaleToZeroAfterSeconds) || (has(self.minReplicas) && self.minReplicas == 0)",
            "message": "spec.autoscaling.scaleToZeroAfterSeconds needs spec.autoscaling.minReplicas: 0",
        },
        {
            "rule": "!has(self.panicWindowSeconds) || !has(self.windowSeconds) || "
            "self.panicWindowSeconds < self.windowSeconds",
            "message": "spec.autoscaling.panicWindowSeconds must be < spec.autoscaling.windowSeconds",
        },
    ],
    "spec.cache": [
        {  # CacheSpec._artifacts_need_bucket
            "rule": "!has(self.artifacts) || !has(self.artifacts.enabled) || !self.artifacts.enabled || "
            "has(self.bucket)",
            "message": "spec.cache.artifacts.enabled needs spec.cache.bucket",
        }
    ],
    "spec.cache.nodeCache": [
        {  # NodeCacheSpec._host_path_set
            "rule": "!has(self.type) || self.type != 'hostPath' || has(self.hostPath)",
            "message": "spec.cache.nodeCache.type hostPath needs spec.cache.nodeCache.hostPath",
        }
    ],
    "spec.engine.env[]": [
        {  # EnvVar._one_source
            "rule": "!(has(self.value) && has(self.valueFrom))",
            "message": "set either value or valueFrom, not both",
        }
    ],
    "spec.engine.env[].valueFrom": [
        {  # EnvVarSource._exactly_one
            "rule": "has(self.secretKeyRef) != has(self.configMapKeyRef)",
            "message": "set exactly one of secretKeyRef or configMapKeyRef",
        }
    ],
}

# String fields whose value is joined under a bucket or directory: no '..' (mirrors _check_prefix).
NO_DOTDOT_PATHS = ("spec.cache.prefix", "spec.cache.artifacts.prefix")
MODEL_URI_CRD_PATTERN = r"^(s3|hf|pvc|file)://.+$"

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri", "priority": 0},
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine.kind"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
    {"name": "Status", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP_KEYS = {"title", "discriminator", "propertyNames"}


def _convert(node: Any, defs: dict[str, Any], path: str) -> Any:
    """Rewrite one pydantic JSON-schema node (and its children) into structural OpenAPI v3.0."""
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**copy.deepcopy(target), **node}
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
    if path in CEL_RULES:
        out["x-kubernetes-validations"] = CEL_RULES[path]
    if path in NO_DOTDOT_PATHS:
        out["x-kubernetes-validations"] = [{"rule": "!self.contains('..')", "message": f"{path} must not contain '..'"}]
    if path == "spec.model.uri":
        out["pattern"] = MODEL_URI_CRD_PATTERN
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
            "metadata": {"type": "object"},
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
# Generated by `kvfleet crd generate` from kvfleet/spec.py and kvfleet/status.py. Do not edit:
# change the models and regenerate (a test fails when this file is stale).
#
# x-kubernetes-preserve-unknown-fields appears only at:
{preserve}
"""


def render_crd() -> str:
    preserve = "\n".join(f"#   {path}: {why}" for path, why in PRESERVE_UNKNOWN_FIELDS.items())
    body = yaml.safe_dump(build_crd(), sort_keys=False, width=100, allow_unicode=True)
    return HEADER.format(preserve=preserve) + body


def check_crd(path: Path = CRD_PATH) -> bool:
    """True when the file on disk is exactly what the models generate."""
    return path.exists() and path.read_text(encoding="utf-8") == render_crd()


def write_crd(path: Path = CRD_PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_crd(), encoding="utf-8")
