"""The operator's one typed settings object: every knob with its unit, its bound and why the default."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from kvfleet import contracts
from kvfleet.spec import EngineKind
from kvfleet.weight_cache.errors import ArtifactError
from kvfleet.weight_cache.signing import MAX_KEY_FILE_BYTES, ArtifactTrust

from .policy import UNRESTRICTED, SpecPolicy

FIELD_MANAGER = "kvfleet-operator"
# Prefix of kopf's bookkeeping names (the finalizer older operator versions added, now removed on sight).
KOPF_PREFIX = contracts.API_GROUP
FINALIZER = f"{KOPF_PREFIX}/operator"

# Images built from engine_image/, whose entrypoint is the launcher. A spec's
# engine.image overrides them and must be such an image too (it runs `kvfleet engine launch`).
DEFAULT_IMAGES: dict[EngineKind, str] = {
    "vllm": "ghcr.io/kvfleet/engine-vllm:0.1.0",
    "sglang": "ghcr.io/kvfleet/engine-sglang:0.1.0",
    "reference": "ghcr.io/kvfleet/engine-cpu:0.1.0",
}


class OperatorSettings(BaseModel):
    """Settings of ``kvfleet operator run``; the renderers read the pod-shaping ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- where the operator looks
    namespaces: tuple[Annotated[str, StringConstraints(min_length=1, max_length=63)], ...] = Field(
        default=(), max_length=64, description="Namespaces to watch; empty means cluster-wide."
    )
    # --- the shared router (installed by the chart) that status.endpoint points at
    router_endpoint: Annotated[str, StringConstraints(pattern=r"^https?://[^\s]+$", max_length=512)] = Field(
        # The chart's router Service for a release named "kvfleet" in kvfleet-system, port 80.
        default="http://kvfleet-router.kvfleet-system.svc/v1",
        description="OpenAI base URL of the shared router; written to status.endpoint.",
    )
    health_port: int | None = Field(
        default=None, ge=1, le=65535, description="Serve kopf's liveness probe on :PORT/healthz (None: off)."
    )
    # --- images
    images: dict[EngineKind, Annotated[str, StringConstraints(min_length=1, max_length=512)]] = Field(
        default_factory=lambda: dict(DEFAULT_IMAGES), description="Default engine image per engine kind."
    )
    image_pull_policy: str = Field(default="IfNotPresent", pattern=r"^(Always|IfNotPresent|Never)$")
    # --- ports (docs/contracts.md)
    engine_port: int = Field(default=contracts.ENGINE_HTTP_PORT, ge=1, le=65535)
    launcher_port: int = Field(default=contracts.LAUNCHER_PORT, ge=1, le=65535)
    kv_events_port: int = Field(
        default=contracts.KV_EVENTS_PORT,
        ge=1,
        le=65534,
        description="The engine's KV-cache events (ZeroMQ PUB), port kv-events; their replay socket is the next port.",
    )
    # --- pod lifecycle
    run_as_user: int = Field(default=1000, ge=1, le=2**31 - 1, description="Non-root UID of the engine images.")
    startup_budget_factor: float = Field(
        default=3.0,
        ge=1.0,
        le=20.0,
        description="Startup probe budget = factor x the cold-start estimate: a cold node pulls weights "
        "slower than the estimate's warm average.",
    )
    startup_budget_min_s: int = Field(default=300, ge=10, le=86_400, description="Floor of the startup budget.")
    startup_budget_max_s: int = Field(
        default=7200, ge=10, le=86_400, description="Ceiling: a pod that has not started in 2 h is broken."
    )
    default_cold_start_s: float = Field(
        default=300.0, ge=1, le=7200, description="Cold-start estimate when the spec has no autoscaling section."
    )
    probe_period_s: int = Field(default=10, ge=1, le=300)
    liveness_failure_threshold: int = Field(
        default=6, ge=1, le=100, description="Liveness tolerates a busy engine for this many periods."
    )
    prestop_delay_s: int = Field(
        default=10,
        ge=0,
        le=120,
        description="Sleep before SIGTERM so the router sees the endpoint leave before the engine stops admitting.",
    )
    drain_timeout_s: int = Field(
        default=600,
        ge=1,
        le=3600,
        description="Longest in-flight request the engine finishes after SIGTERM, where the spec sets no "
        "engine.maxRequestSeconds.",
    )
    # --- reconcile loop
    resync_interval_s: float = Field(
        default=30.0,
        ge=0.2,
        le=3600,
        description="How often each deployment is looked at again (operator/periodic.py): restores drifted "
        "children and refreshes status.",
    )
    rollout_check_interval_s: float = Field(
        default=5.0,
        ge=0.2,
        le=3600,
        description="While a deployment is not Ready or still progressing, how often its pods are read, so a "
        "crash loop, an image that cannot be pulled or an unschedulable pod reaches status within seconds.",
    )
    cache_children: bool = Field(
        default=True,
        description="Read children and engine pods from watches (one list-then-watch per kind) instead of a GET "
        "per reconcile: a converged deployment's resync then costs no API request (operator/child_cache.py).",
    )
    watch_rollouts: bool = Field(
        default=True,
        description="Reconcile a deployment as soon as its engine Deployment's status changes (the children's "
        "watch sees it; needs cache_children), not only at the rollout check's pace (operator/rollout_nudge.py).",
    )
    rollout_nudge_coalesce_s: float = Field(
        default=0.5,
        ge=0,
        le=60,
        description="A deployment whose engine Deployment changed is reconciled this long after, so one rollout "
        "step's several status writes cost one reconcile.",
    )
    rollout_nudge_workers: int = Field(
        default=8, ge=1, le=256, description="Reconciles run at once on engine Deployment changes."
    )
    max_concurrent_reconciles: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Reconciles that run at once, every trigger together (the watch's event handler, the "
        "periodic looks, the rollout nudges); the others wait their turn, status work first. Unbounded, a "
        "start-up or a "
        "change to 1,000 deployments begins 1,000 reconciles that advance breadth-first (no deployment "
        "finished until all are nearly done) and queue thousands of requests in the API server, where they "
        "time out and kopf retries them. 16 keeps a 2-core API server busy (each reconcile has one request "
        "in flight at a time) and finishes deployments one after another.",
    )
    api_timeout_s: float = Field(default=30.0, gt=0, le=600, description="Timeout of one API request.")
    retry_delay_s: float = Field(
        default=10.0, ge=0.2, le=600, description="Delay before a failed reconcile is tried again."
    )
    coldstart_timeout_s: float = Field(default=2.0, gt=0, le=60, description="Timeout of one launcher /coldstart GET.")
    coldstart_pods_per_tick: int = Field(
        default=8, ge=0, le=1000, description="Launcher endpoints queried per deployment per resync (0 disables)."
    )
    progress_timeout_s: float = Field(
        default=1.0,
        gt=0,
        le=30,
        description="Timeout of one launcher /progress GET (pods are asked at once, so this bounds the delay "
        "it adds to a reconcile).",
    )
    progress_pods_per_tick: int = Field(
        default=8,
        ge=0,
        le=64,
        description="Launchers of not-ready pods asked how far their weight pull is, per deployment per rollout "
        "check (0 disables the pull progress in the Progressing condition).",
    )
    # --- what a spec may ask for (the chart renders the platform team's policy into a file)
    policy: SpecPolicy = Field(
        default=UNRESTRICTED,
        description="Node-cache host paths, image registries, PriorityClasses and "
        "tolerations a spec may use; a spec outside it gets Degraded=True, reason PolicyViolation.",
    )
    # --- engine artifacts: which signatures engine pods accept (the chart's artifacts.publicKeys)
    artifact_public_keys: Annotated[str, StringConstraints(max_length=MAX_KEY_FILE_BYTES)] | None = Field(
        default=None,
        description="PEM Ed25519 public keys whose artifact signatures engine pods accept, written into each "
        "deployment's ConfigMap; None: engine pods load no artifact. Never a private key: engine pods never sign.",
    )
    # --- HA: kopf peering; the highest priority runs, the others stand by.
    peering_name: Annotated[str, StringConstraints(max_length=253)] | None = Field(
        default=None, description="ClusterKopfPeering object name; None runs standalone (one replica only)."
    )
    priority: int = Field(default=0, ge=0, le=2**31 - 1, description="kopf peering priority (unique per replica).")
    peering_lifetime_s: int = Field(default=60, ge=5, le=3600, description="How long a silent peer is trusted.")

    @field_validator("artifact_public_keys")
    @classmethod
    def _public_keys_only(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if "PRIVATE KEY" in value:
            raise ValueError("holds a private key; engine pods get public keys only")
        try:
            ArtifactTrust.from_pem(value, "artifact_public_keys")
        except ArtifactError as e:
            raise ValueError(str(e)) from None
        return value

    @model_validator(mode="after")
    def _bounds(self) -> OperatorSettings:
        if self.startup_budget_min_s > self.startup_budget_max_s:
            raise ValueError("startup_budget_min_s must be <= startup_budget_max_s")
        ports = [
            self.engine_port,
            self.launcher_port,
            self.kv_events_port,
            contracts.kv_events_replay_port(self.kv_events_port),
        ]
        if len(set(ports)) != len(ports):
            raise ValueError(
                "engine_port, launcher_port, kv_events_port and kv_events_port + 1 (the events' replay) must differ"
            )
        return self

    def image_for(self, kind: EngineKind) -> str:
        return self.images.get(kind, DEFAULT_IMAGES[kind])
