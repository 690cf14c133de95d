"""The InferenceDeployment spec: pydantic v2 models that are the single source of the CRD.

Field names are snake_case in Python and camelCase on the wire (the alias). Every model forbids
unknown fields so a typo in a manifest is an error naming the field, not a silently ignored key.
Every number has a bound: a spec is public API, and an unbounded value is a way to knock the
cluster over (a maxReplicas of 10^9, a queue that eats the router's memory).

Cross-field rules raise ``cross_field_error`` so the reported path ends at the offending field
(see ``kvfleet.validation``); the same rules are mirrored as CEL ``x-kubernetes-validations``
in the CRD where the API server can check them.

One module per area of the spec, so each reads on its own: ``identity`` (group, version, kind),
``base`` (the shared model base and patterns), ``model``, ``engine`` (engine and resources),
``autoscaling``, ``routing``, ``cache``, ``scheduling``, and ``deployment`` (the whole spec and
the rules that span areas). The names other code uses are importable from ``kvfleet.spec``.
"""

from __future__ import annotations

from kvfleet.spec.autoscaling import AutoscalingSpec
from kvfleet.spec.base import BUCKET_PATTERN, QUANTITY_PATTERN, ApiModel, Quantity, cross_field_error
from kvfleet.spec.cache import ArtifactsSpec, CacheSpec, NodeCacheSpec
from kvfleet.spec.deployment import InferenceDeploymentSpec
from kvfleet.spec.engine import (
    ENV_NAME_PATTERN,
    MANAGED_ENGINE_FLAGS,
    VLLM_UNKNOWN_QUANTIZATION,
    Dtype,
    EngineKind,
    EngineSpec,
    EnvVar,
    EnvVarSource,
    KVCacheDtype,
    Quantization,
    ResourcesSpec,
    SecretKeySelector,
)
from kvfleet.spec.identity import (
    API_VERSION,
    GROUP,
    KIND,
    MAX_NAME_CHARS,
    NAME_PATTERN,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from kvfleet.spec.model import ModelSource
from kvfleet.spec.routing import KVEventsSpec, RoutingSpec, RoutingStrategy
from kvfleet.spec.scheduling import LABEL_KEY_PATTERN, SchedulingSpec, Toleration, TopologySpreadSpec

__all__ = [
    "API_VERSION",
    "BUCKET_PATTERN",
    "ENV_NAME_PATTERN",
    "GROUP",
    "KIND",
    "LABEL_KEY_PATTERN",
    "MANAGED_ENGINE_FLAGS",
    "MAX_NAME_CHARS",
    "NAME_PATTERN",
    "PLURAL",
    "QUANTITY_PATTERN",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "VLLM_UNKNOWN_QUANTIZATION",
    "ApiModel",
    "ArtifactsSpec",
    "AutoscalingSpec",
    "CacheSpec",
    "Dtype",
    "EngineKind",
    "EngineSpec",
    "EnvVar",
    "EnvVarSource",
    "InferenceDeploymentSpec",
    "KVCacheDtype",
    "KVEventsSpec",
    "ModelSource",
    "NodeCacheSpec",
    "Quantity",
    "Quantization",
    "ResourcesSpec",
    "RoutingSpec",
    "RoutingStrategy",
    "SchedulingSpec",
    "SecretKeySelector",
    "Toleration",
    "TopologySpreadSpec",
    "cross_field_error",
]
