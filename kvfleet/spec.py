"""The InferenceDeployment spec: pydantic v2 models that are the single source of the CRD.

Field names are snake_case in Python and camelCase on the wire (the alias). Every model forbids
unknown fields so a typo in a manifest is an error naming the field, not a silently ignored key.
Every number has a bound: a spec is public API, and an unbounded value is a way to knock the
cluster over (a maxReplicas of 10^9, a queue that eats the router's memory).

Cross-field rules raise ``cross_field_error`` so the reported path ends at the offending field
(see ``kvfleet.validation``); the same rules are mirrored as CEL ``x-kubernetes-validations``
in the CRD where the API server can check them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from kvfleet.contracts import API_GROUP, MODEL_URI_PATTERN, MODEL_URI_SCHEMES

GROUP = API_GROUP
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["infd"]

# Child objects are named "<name>-engine", "<name>-engine-pdb", ...; the longest suffix the
# operator adds is 11 characters, and Service names must be DNS-1035 labels of <= 63.
MAX_NAME_CHARS = 52
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# S3 bucket naming rules (the subset every S3-compatible server accepts): 3-63 characters,
# lowercase letters, digits, dots and hyphens, starting and ending with a letter or digit.
BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
# Kubernetes resource quantity (https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/)
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$"
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

# Engine flags kvfleet renders itself; setting them again in extraArgs would silently fight the
# operator (two --port flags, a served name the router does not know).
MANAGED_ENGINE_FLAGS = frozenset(
    {
        "--port",
        "--host",
        "--model",
        "--served-model-name",
        "--tensor-parallel-size",
        "--tp",
        "--max-model-len",
        "--dtype",
        "--kv-cache-dtype",
        "--quantization",
        "--gpu-memory-utilization",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
    }
)

EngineKind = Literal["vllm", "sglang", "reference"]
Dtype = Literal["auto", "float16", "bfloat16", "float32"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
Quantization = Literal["awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors", "marlin"]
RoutingStrategy = Literal["prefix", "least-load", "round-robin"]

Quantity = Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=32)]
ShortStr = Annotated[str, StringConstraints(min_length=1, max_length=253)]


def cross_field_error(field: str, message: str) -> PydanticCustomError:
    """An error for a rule that spans fields; ``field`` is appended to the reported path."""
    return PydanticCustomError("cross_field", "{message}", {"field": field, "message": message})


def _quantity(value: Any) -> Any:
    # YAML turns `cpu: 4` into an int; Kubernetes accepts both, so normalise to the string form.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _check_prefix(value: str | None) -> str | None:
    if value is None:
        return value
    if ".." in value:
        raise ValueError("must not contain '..' (object keys are joined under the prefix)")
    if value.startswith("/"):
        raise ValueError("must be relative (no leading '/')")
    return value


class ApiModel(BaseModel):
    """Base for every spec model: camelCase aliases, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict as it appears in a manifest, without unset optionals."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ModelSource(ApiModel):
    """Where the model's weights come from and the name clients ask for."""

    uri: Annotated[str, StringConstraints(max_length=1024)] = Field(
        description=(
            "Location of the model in Hugging Face layout: s3://bucket/prefix, hf://org/name, "
            "pvc://claim/path or file:///absolute/path (file:// relative paths are for local mode)."
        ),
    )
    revision: Annotated[str, StringConstraints(max_length=128)] | None = Field(
        default=None, description="Revision (git commit, tag or branch) for hf:// models."
    )
    served_name: Annotated[str, StringConstraints(max_length=253, pattern=r"^[A-Za-z0-9._/:-]+$")] | None = Field(
        default=None,
        description="Model name clients send in the OpenAI `model` field; defaults to metadata.name.",
    )
    format: Literal["safetensors", "pickle"] = Field(
        default="safetensors",
        description="Weight format. 'pickle' (.bin/.pt) runs code on load and needs allowPickle: true.",
    )
    allow_pickle: bool = Field(
        default=False,
        description="Accept pickle-based checkpoints. Unpickling can execute arbitrary code; leave false.",
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if not re.match(MODEL_URI_PATTERN, value):
            scheme = value.split("://", 1)[0] if "://" in value else "(none)"
            raise ValueError(
                f"unknown URI scheme {scheme!r}; use one of " + ", ".join(f"{s}://" for s in MODEL_URI_SCHEMES)
            )
        if value.startswith("s3://"):
            bucket = value[len("s3://") :].split("/", 1)[0]
            if not re.match(BUCKET_PATTERN, bucket):
                raise ValueError(f"bucket name {bucket!r} is not a valid S3 bucket name")
        if ".." in value.split("://", 1)[1].split("/"):
            raise ValueError("must not contain '..' path segments")
        return value

    @model_validator(mode="after")
    def _pickle_needs_consent(self) -> ModelSource:
        if self.format == "pickle" and not self.allow_pickle:
            raise cross_field_error(
                "format",
                "format 'pickle' loads weights by unpickling, which can run arbitrary code; "
                "convert the model to safetensors or set model.allowPickle: true",
            )
        return self


class SecretKeySelector(ApiModel):
    name: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        description="Name of the Secret or ConfigMap in the deployment's namespace."
    )
    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(description="Key within it.")


class EnvVarSource(ApiModel):
    secret_key_ref: SecretKeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: SecretKeySelector | None = Field(default=None, description="A key of a ConfigMap.")

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise cross_field_error("secretKeyRef", "set exactly one of secretKeyRef or configMapKeyRef")
        return self


class EnvVar(ApiModel):
    """An environment variable for the engine container; secrets only by reference."""

    name: Annotated[str, StringConstraints(pattern=ENV_NAME_PATTERN, max_length=128)] = Field(
        description="Variable name."
    )
    value: Annotated[str, StringConstraints(max_length=4096)] | None = Field(
        default=None, description="Literal value (never put secrets here; use valueFrom)."
    )
    value_from: EnvVarSource | None = Field(default=None, description="Value from a Secret or ConfigMap key.")

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise cross_field_error("valueFrom", "set either value or valueFrom, not both")
        return self


class EngineSpec(ApiModel):
    """The inference engine and its flags."""

    kind: EngineKind = Field(
        default="vllm", description="Engine: vllm (production), sglang, or reference (kvfleet's CPU engine)."
    )
    image: Annotated[str, StringConstraints(max_length=512)] | None = Field(
        default=None, description="Container image; defaults to the operator's image for this engine kind."
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="GPUs one replica shards the model over; must divide resources.gpus."
    )
    max_model_len: int | None = Field(
        default=None, ge=1, le=10_485_760, description="Maximum context length in tokens (prompt + output)."
    )
    dtype: Dtype = Field(default="auto", description="Weight and activation dtype.")
    kv_cache_dtype: KVCacheDtype = Field(default="auto", description="KV-cache dtype (fp8 halves KV memory).")
    quantization: Quantization | None = Field(default=None, description="Weight quantization method, if any.")
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks across requests sharing a prefix (the router relies on it)."
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Fraction of GPU memory the engine may take (weights + KV)."
    )
    extra_args: list[Annotated[str, StringConstraints(max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra engine command-line arguments, appended last. Flags kvfleet manages are refused.",
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra environment variables.")
    max_request_seconds: int | None = Field(
        default=None,
        ge=1,
        le=3600,
        description="Longest a request may run. A stopping engine finishes its in-flight requests for this "
        "long, so the pod's terminationGracePeriodSeconds is the preStop delay plus this; unset: the "
        "operator's default (600).",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, value: list[str]) -> list[str]:
        for arg in value:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_ENGINE_FLAGS:
                raise ValueError(f"{flag} is set by kvfleet from the spec; use the matching engine field instead")
        return value


class ResourcesSpec(ApiModel):
    """Per-replica resources."""

    gpus: int = Field(default=1, ge=0, le=64, description="GPUs per replica (nvidia.com/gpu); 0 runs on CPU.")
    gpu_product: Annotated[str, StringConstraints(max_length=63, pattern=r"^[A-Za-z0-9._-]+$")] | None = Field(
        default=None,
        description="GPU product label value (nvidia.com/gpu.product, e.g. NVIDIA-H100-80GB-HBM3); "
        "becomes a node selector.",
    )
    cpu: Quantity | None = Field(default=None, description="CPU request and limit (Kubernetes quantity).")
    memory: Quantity | None = Field(default=None, description="Memory request and limit (Kubernetes quantity).")
    shm_size: Quantity = Field(
        default="8Gi", description="Size of the /dev/shm memory volume (NCCL and tensor parallelism need it)."
    )

    @field_validator("cpu", "memory", "shm_size", mode="before")
    @classmethod
    def _norm(cls, value: Any) -> Any:
        return _quantity(value)


class AutoscalingSpec(ApiModel):
    """Traffic- and utilization-driven autoscaling; scale to zero needs minReplicas: 0."""

    enabled: bool = Field(default=True, description="Let kvfleet's autoscaler set the replica count.")
    min_replicas: int = Field(default=1, ge=0, le=1000, description="Lower bound; 0 allows scale to zero.")
    max_replicas: int = Field(default=4, ge=1, le=1000, description="Upper bound on replicas.")
    target_concurrency_per_replica: float = Field(
        default=16.0, gt=0, le=10_000, description="In-flight requests (running + waiting) one replica should hold."
    )
    target_kv_cache_utilization: float = Field(
        default=0.8,
        alias="targetKVCacheUtilization",
        gt=0,
        le=1.0,
        description="KV-cache usage fraction above which to add replicas.",
    )
    ttft_slo_seconds: float | None = Field(
        default=None,
        alias="ttftSLOSeconds",
        gt=0,
        le=600,
        description="Time-to-first-token p90 objective; breaching it adds replicas.",
    )
    scale_to_zero_after_seconds: float | None = Field(
        default=None,
        ge=0,
        le=604_800,
        description="Idle time before scaling to zero (needs minReplicas: 0; default 300 when it is 0).",
    )
    scale_down_delay_seconds: float = Field(
        default=120.0, ge=0, le=86_400, description="Demand must stay lower this long before replicas are removed."
    )
    window_seconds: float = Field(default=60.0, ge=1, le=3600, description="Stable window the load is averaged over.")
    panic_window_seconds: float = Field(
        default=6.0, ge=1, le=600, description="Short window that reacts to bursts (must be < windowSeconds)."
    )
    cold_start_seconds: float = Field(
        default=60.0,
        ge=0,
        le=7200,
        description="Estimated time from scale-up to a ready replica; the operator may learn a better one.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise cross_field_error(
                "minReplicas",
                f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})",
            )
        if self.scale_to_zero_after_seconds is not None and self.min_replicas != 0:
            raise cross_field_error(
                "scaleToZeroAfterSeconds",
                f"scale to zero needs minReplicas: 0 (it is {self.min_replicas})",
            )
        if self.panic_window_seconds >= self.window_seconds:
            raise cross_field_error(
                "panicWindowSeconds",
                f"panicWindowSeconds ({self.panic_window_seconds:g}) must be < windowSeconds ({self.window_seconds:g})",
            )
        return self

    @property
    def effective_scale_to_zero_after_s(self) -> float | None:
        """Idle seconds before zero, or None when the deployment never scales to zero."""
        if self.min_replicas != 0:
            return None
        return 300.0 if self.scale_to_zero_after_seconds is None else self.scale_to_zero_after_seconds


class KVEventsSpec(ApiModel):
    """The engine's KV-cache events (vLLM's --kv-events-config), read by every router (docs/router.md)."""

    enabled: bool = Field(
        default=True,
        description=(
            "Publish the engine's KV-cache events on the pod's kv-events port so routers score replicas by "
            "what their caches hold. Used by vllm and reference engines with prefix caching on; SGLang has no "
            "vLLM-format publisher and is routed by the router's learned index."
        ),
    )


class RoutingSpec(ApiModel):
    """How the router picks a replica and how long it holds requests."""

    strategy: RoutingStrategy = Field(
        default="prefix", description="prefix (cache-aware, load-bounded), least-load, or round-robin."
    )
    prefix_block_chars: int = Field(
        default=128, ge=4, le=65_536, description="Characters per hashed prompt block for prefix matching."
    )
    load_imbalance_bound: float = Field(
        default=1.25, ge=1.0, le=100.0, description="Never pick a replica above this multiple of the mean load."
    )
    max_queue: int = Field(
        default=256, ge=0, le=100_000, description="Requests held per model while no replica is ready (then 429)."
    )
    max_queue_wait_seconds: float = Field(
        default=300.0, gt=0, le=3600, description="Longest a held request waits for a replica (then 503)."
    )
    kv_events: KVEventsSpec = Field(default_factory=KVEventsSpec, description="KV-cache events for the routers.")


class NodeCacheSpec(ApiModel):
    """Node-level cache of pulled weights, shared by the replicas on one node."""

    type: Literal["hostPath", "emptyDir"] = Field(
        default="emptyDir", description="hostPath survives pod restarts on the node; emptyDir does not."
    )
    host_path: Annotated[str, StringConstraints(max_length=1024, pattern=r"^/.*$")] | None = Field(
        default=None, description="Absolute directory on the node (type hostPath)."
    )
    size_limit: Quantity | None = Field(default=None, description="Size bound; least recently used models go first.")
    verify_on_hit: Literal["sha256", "stat"] = Field(
        default="sha256",
        description="What a cached model must pass before it is loaded: sha256 hashes every file against the "
        "manifest (about 1 s per GB on one core); stat hashes only files changed since they were verified "
        "(milliseconds; enough within the namespace's own cache directory, see docs/weight_cache.md).",
    )

    @field_validator("size_limit", mode="before")
    @classmethod
    def _norm(cls, value: Any) -> Any:
        return _quantity(value)

    @field_validator("host_path")
    @classmethod
    def _no_dotdot(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("/"):
            raise ValueError("must not contain '..' path segments")
        return value

    @model_validator(mode="after")
    def _host_path_set(self) -> NodeCacheSpec:
        if self.type == "hostPath" and self.host_path is None:
            raise cross_field_error("hostPath", "type hostPath needs hostPath (an absolute directory on the node)")
        if self.type == "emptyDir" and self.host_path is not None:
            raise cross_field_error("hostPath", "hostPath is only used with type: hostPath")
        return self


class ArtifactsSpec(ApiModel):
    """Prebuilt engine artifacts (compile caches, CUDA graphs), fingerprinted, in the weight cache bucket."""

    enabled: bool = Field(default=False, description="Pull artifacts before start; push them after a miss.")
    prefix: Annotated[str, StringConstraints(max_length=512)] = Field(
        default="artifacts/", description="Key prefix for artifacts inside cache.bucket."
    )

    @field_validator("prefix")
    @classmethod
    def _prefix_safe(cls, value: str) -> str | None:
        return _check_prefix(value)


class CacheSpec(ApiModel):
    """Same-datacenter weight cache (S3-compatible), node cache and engine artifacts."""

    s3_endpoint: Annotated[str, StringConstraints(max_length=512, pattern=r"^https?://[^\s]+$")] | None = Field(
        default=None, description="S3-compatible endpoint URL; default is boto3's standard configuration."
    )
    bucket: Annotated[str, StringConstraints(pattern=BUCKET_PATTERN)] | None = Field(
        default=None, description="Bucket of the weight cache."
    )
    prefix: Annotated[str, StringConstraints(max_length=512)] = Field(
        default="models/", description="Key prefix under which models are cached."
    )
    region: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="S3 region, if the endpoint needs one."
    )
    credentials_secret: Annotated[str, StringConstraints(max_length=253, pattern=NAME_PATTERN)] | None = Field(
        default=None,
        description="Secret (same namespace) with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "
        "mounted, never copied into the spec.",
    )
    node_cache: NodeCacheSpec = Field(default_factory=NodeCacheSpec, description="Node-level cache.")
    artifacts: ArtifactsSpec = Field(default_factory=ArtifactsSpec, description="Engine artifacts.")

    @field_validator("bucket", mode="before")
    @classmethod
    def _bucket_message(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.match(BUCKET_PATTERN, value):
            raise ValueError(f"{value!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, '.' or '-')")
        return value

    @field_validator("prefix")
    @classmethod
    def _prefix_safe(cls, value: str) -> str | None:
        return _check_prefix(value)

    @model_validator(mode="after")
    def _artifacts_need_bucket(self) -> CacheSpec:
        if self.artifacts.enabled and self.bucket is None:
            raise cross_field_error("bucket", "artifacts.enabled needs cache.bucket to store artifacts in")
        return self


class Toleration(ApiModel):
    key: Annotated[str, StringConstraints(max_length=316)] | None = Field(default=None, description="Taint key.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: Annotated[str, StringConstraints(max_length=63)] | None = Field(default=None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty tolerates all."
    )
    toleration_seconds: int | None = Field(default=None, ge=0, description="For NoExecute: how long to stay.")


class TopologySpreadSpec(ApiModel):
    """Spread replicas over a topology domain (nodes by default)."""

    max_skew: int = Field(default=1, ge=1, le=100, description="Largest allowed difference between domains.")
    topology_key: Annotated[str, StringConstraints(max_length=316)] = Field(
        default="kubernetes.io/hostname", description="Node label that defines a domain."
    )
    when_unsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = Field(
        default="ScheduleAnyway", description="Whether the spread is a preference or a rule."
    )


class SchedulingSpec(ApiModel):
    """Where engine pods may run."""

    node_selector: dict[
        Annotated[str, StringConstraints(pattern=LABEL_KEY_PATTERN, max_length=316)],
        Annotated[str, StringConstraints(max_length=63)],
    ] = Field(default_factory=dict, max_length=64, description="Node labels the pods require (at most 64).")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Taints tolerated.")
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Kubernetes Affinity, passed to the pod spec verbatim (the API server validates it there).",
    )
    priority_class_name: Annotated[str, StringConstraints(max_length=253)] | None = Field(
        default=None, description="PriorityClass of the engine pods."
    )
    topology_spread: TopologySpreadSpec | None = Field(
        default_factory=TopologySpreadSpec, description="Spread of replicas across nodes or zones."
    )


class InferenceDeploymentSpec(ApiModel):
    """Desired state of one served model."""

    model: ModelSource = Field(description="The model to serve.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="The inference engine.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Per-replica resources.")
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="Fixed replica count; only when autoscaling is off (kubectl scale writes it).",
    )
    autoscaling: AutoscalingSpec | None = Field(default=None, description="Autoscaling; off when omitted.")
    routing: RoutingSpec = Field(default_factory=RoutingSpec, description="Request routing.")
    cache: CacheSpec = Field(default_factory=CacheSpec, description="Weight cache and engine artifacts.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Pod placement.")

    @model_validator(mode="after")
    def _cross_checks(self) -> InferenceDeploymentSpec:
        if self.replicas is not None and self.autoscaling_enabled:
            raise cross_field_error(
                "replicas",
                "replicas is set while autoscaling.enabled is true; remove one "
                "(kubectl scale works only with autoscaling off)",
            )
        tp, gpus = self.engine.tensor_parallel_size, self.resources.gpus
        if self.engine.kind != "reference" and gpus == 0:
            raise cross_field_error("resources.gpus", f"engine.kind {self.engine.kind} needs resources.gpus >= 1")
        if gpus and gpus % tp:
            raise cross_field_error(
                "engine.tensorParallelSize",
                f"engine.tensorParallelSize ({tp}) must divide resources.gpus ({gpus})",
            )
        if gpus == 0 and tp != 1:
            raise cross_field_error(
                "engine.tensorParallelSize", "tensorParallelSize > 1 needs GPUs (resources.gpus is 0)"
            )
        autoscaling = self.autoscaling
        if (
            autoscaling is not None
            and autoscaling.enabled
            and autoscaling.min_replicas == 0
            and self.routing.max_queue_wait_seconds < autoscaling.cold_start_seconds
        ):
            raise cross_field_error(
                "routing.maxQueueWaitSeconds",
                f"routing.maxQueueWaitSeconds ({self.routing.max_queue_wait_seconds:g}) is shorter than "
                f"autoscaling.coldStartSeconds ({autoscaling.cold_start_seconds:g}): requests that wake "
                "the deployment from zero would always time out",
            )
        if self.model.uri.startswith("pvc://") and self.cache.bucket is not None:
            raise cross_field_error(
                "cache.bucket", "cache.bucket is for s3:// and hf:// models; a pvc:// model is already in the cluster"
            )
        return self

    @property
    def autoscaling_enabled(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.enabled

    def served_name(self, metadata_name: str) -> str:
        return self.model.served_name or metadata_name

    @property
    def publishes_kv_events(self) -> bool:
        """Whether the engine publishes KV-cache events: asked for, an engine with vLLM's publisher
        (vllm, reference), and a prefix cache to report on."""
        return (
            self.routing.kv_events.enabled
            and self.engine.kind in ("vllm", "reference")
            and self.engine.enable_prefix_caching
        )

    def fixed_replicas(self) -> int:
        """The replica count when autoscaling is off (spec.replicas, default 1)."""
        return 1 if self.replicas is None else self.replicas
