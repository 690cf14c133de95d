"""``spec.engine`` and ``spec.resources``: what the engine container runs (engine kind, image,
parallelism, dtypes, flags, environment) and what one replica gets (GPUs, CPU, memory, shared memory).

Flags kvfleet renders itself are refused in ``extraArgs`` here, so a spec cannot fight the operator
over them; environment values from Secrets come only by reference."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from kvfleet.spec.base import ApiModel, Quantity, cross_field_error, quantity_as_string

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
# Quantization names vLLM (0.32, the version the engine images and the tests run) does not know:
# its config check refuses them before any weight loads ("Unknown quantization method"), on CPU and
# GPU alike (its list is not per platform). SGLang still takes them.
VLLM_UNKNOWN_QUANTIZATION = frozenset({"bitsandbytes", "marlin"})


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

    @model_validator(mode="after")
    def _quantization_the_engine_knows(self) -> EngineSpec:
        if self.kind == "vllm" and self.quantization in VLLM_UNKNOWN_QUANTIZATION:
            raise cross_field_error(
                "quantization",
                f"quantization {self.quantization} is not a vLLM method (vLLM refuses it at start); "
                "vLLM reads bitsandbytes and Marlin checkpoints from their own quantization_config: leave it unset",
            )
        return self

    @property
    def data_parallel_size(self) -> int:
        """vLLM's ``--data-parallel-size``/``-dp`` given in extraArgs (1 when absent or not a number)."""
        args = self.extra_args
        for i, arg in enumerate(args):
            flag, eq, value = arg.partition("=")
            if flag not in ("--data-parallel-size", "-dp"):
                continue
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            return int(value) if value.isdigit() else 1
        return 1


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
        return quantity_as_string(value)
