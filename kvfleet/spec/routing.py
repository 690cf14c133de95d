"""``spec.routing``: how the router picks a replica (strategy, prefix block size, load bound),
how many requests it holds while no replica is ready and for how long, and whether engines publish
the KV-cache events the routers score by."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvfleet.spec.base import ApiModel

RoutingStrategy = Literal["prefix", "least-load", "round-robin"]


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
