"""The whole ``spec``: ``InferenceDeploymentSpec`` assembles the areas (model, engine, resources,
replicas, autoscaling, routing, cache, scheduling) and checks the rules that span them (fixed
replicas vs autoscaling, GPUs vs tensor parallelism, a queue wait long enough for a cold start,
a bucket only for models that come from one)."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvfleet.spec.autoscaling import AutoscalingSpec
from kvfleet.spec.base import ApiModel, cross_field_error
from kvfleet.spec.cache import CacheSpec
from kvfleet.spec.engine import EngineSpec, ResourcesSpec
from kvfleet.spec.model import ModelSource
from kvfleet.spec.routing import RoutingSpec
from kvfleet.spec.scheduling import SchedulingSpec


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
        # vLLM has a CPU build (gpus: 0 runs it, the test suite does); SGLang serves on GPUs only.
        if self.engine.kind == "sglang" and gpus == 0:
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
        (vllm, reference), a prefix cache to report on, and one data-parallel rank per pod (vLLM
        publishes rank r's events on the port + r, and its replay on the replay port + r: rank 1 would
        take rank 0's replay port, and a router reads one events port per pod)."""
        return (
            self.routing.kv_events.enabled
            and self.engine.kind in ("vllm", "reference")
            and self.engine.enable_prefix_caching
            and self.engine.data_parallel_size == 1
        )

    def fixed_replicas(self) -> int:
        """The replica count when autoscaling is off (spec.replicas, default 1)."""
        return 1 if self.replicas is None else self.replicas
