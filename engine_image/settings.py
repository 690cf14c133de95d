"""The launcher's settings: one frozen object, read from flags and the pod's environment.

Paths and ports default to what the operator renders into the pod (docs/contracts.md): the spec
at /etc/kvfleet/spec.json, the node cache volume at ``$KVFLEET_NODE_CACHE`` (/var/cache/kvfleet),
the engine on 8000 and the launcher's endpoint on 9400.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet import contracts
from kvfleet.weight_cache.settings import ProgressSettings

from .artifact_decision import DecisionSettings
from .engine_args import ReferenceEngineSizing, VllmLoadFormat
from .model_pin import DEFAULT_PIN_PATH
from .readiness import ReadinessSettings
from .supervisor import StopSettings

DEFAULT_SPEC_PATH = Path(contracts.SPEC_MOUNT_DIR) / contracts.SPEC_FILE
DEFAULT_NODE_CACHE = Path(contracts.NODE_CACHE_MOUNT)
# Where the operator mounts a pvc:// model's claim: <root>/<claim>/<path inside the claim>.
PVC_MOUNT_ROOT = Path("/mnt/kvfleet/pvc")
# The public keys whose artifact signatures this pod accepts: the operator writes the platform's
# keys into the deployment's ConfigMap beside spec.json. No file: no artifact is ever loaded.
DEFAULT_ARTIFACT_KEYS = Path(contracts.SPEC_MOUNT_DIR) / contracts.ARTIFACT_KEYS_FILE


def _port(value: int, name: str) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"{name} must be a TCP port (1-65535), got {value}")
    return value


@dataclass(frozen=True)
class LauncherSettings:
    """Everything the launcher needs besides the spec."""

    spec_path: Path = DEFAULT_SPEC_PATH
    # The pinned model digest (the operator's pin ConfigMap); absent: nothing pinned.
    pin_path: Path = DEFAULT_PIN_PATH
    # The node cache volume: weights under models/<digest>/, artifacts unpacked under artifacts/.
    node_cache_dir: Path = DEFAULT_NODE_CACHE
    pvc_mount_root: Path = PVC_MOUNT_ROOT
    engine_host: str = "0.0.0.0"
    engine_port: int = contracts.ENGINE_HTTP_PORT
    metrics_host: str = "0.0.0.0"
    metrics_port: int = contracts.LAUNCHER_PORT
    # The engine's KV-cache events (ZeroMQ PUB) when the spec publishes them: the pod's kv-events port.
    kv_events_port: int = contracts.KV_EVENTS_PORT
    # Pushing artifacts after a miss runs in the background; it gets this long before it is dropped.
    artifact_push_timeout_s: float = 600.0
    artifact_keys_path: Path = DEFAULT_ARTIFACT_KEYS
    # Only a trusted builder the platform runs sets this ($KVFLEET_ARTIFACT_SIGNING_KEY); the
    # operator never renders it into engine pods, which therefore never push artifacts.
    artifact_signing_key_path: Path | None = None
    # Where artifacts are unpacked for this launch: a directory no other pod writes (the pod's own
    # emptyDir, $KVFLEET_ARTIFACTS_WORK), so nothing changes them between the check and the load.
    # None: <node cache>/artifacts-work (outside a pod).
    artifacts_work_root: Path | None = None
    readiness: ReadinessSettings = field(default_factory=ReadinessSettings)
    stop: StopSettings = field(default_factory=StopSettings)
    reference: ReferenceEngineSizing = field(default_factory=ReferenceEngineSizing)
    # When an artifact in the bucket is worth fetching (artifact_decision.py).
    artifact_decision: DecisionSettings = field(default_factory=DecisionSettings)
    # At most one pull-progress line per this many seconds in the log (the first comes as the pull
    # starts): a 140 GB pull at 1 GB/s writes 15 lines, at 100 MB/s about 140.
    progress_log_interval_s: float = 10.0
    # The pull's rate window and sampling (what the log, /progress and the operator's message say).
    pull_progress: ProgressSettings = field(default_factory=ProgressSettings)
    # Start the reference engine while the weights are pulled (overlap.py); it loads each verified
    # shard as it lands. On: measured faster in docs/benchmarks/cold_start.md.
    overlap_pull: bool = True
    # How long the engine waits for the next file of a pull in progress before it fails naming the
    # file: the node cache's lock timeout, since another pod's pull of the same model may hold it.
    weights_arrival_timeout_s: float = 3600.0
    # How long a pull stopped because its engine exited may take to end (one chunk read per
    # worker, normally well under a second): past it the launch fails anyway and the pull's
    # thread is abandoned to the process's exit.
    pull_stop_timeout_s: float = 30.0
    # vLLM's --load-format on the node cache's complete files (engine_args.VllmLoadFormat); None
    # leaves vLLM's default. Measured on vLLM CPU only (docs/benchmarks/cold_start_vllm_load_format.md),
    # where a small model's load is a sliver of vLLM's start: off until a GPU node measures it.
    vllm_load_format: VllmLoadFormat | None = None

    def __post_init__(self) -> None:
        _port(self.engine_port, "engine_port")
        _port(self.metrics_port, "metrics_port")
        _port(self.kv_events_port, "kv_events_port")
        replay = contracts.kv_events_replay_port(self.kv_events_port)
        _port(replay, "kv_events_port + 1 (the events' replay)")
        if len({self.engine_port, self.metrics_port, self.kv_events_port, replay}) != 4:
            raise ValueError(
                "engine_port, metrics_port, kv_events_port and kv_events_port + 1 (the events' replay) must differ"
            )
        if not 0 < self.artifact_push_timeout_s <= 7200:
            raise ValueError("artifact_push_timeout_s must be in (0, 7200]")
        if not 0.1 <= self.progress_log_interval_s <= 3600:
            raise ValueError("progress_log_interval_s must be in [0.1, 3600]")
        if not 0 < self.weights_arrival_timeout_s <= 86_400:
            raise ValueError("weights_arrival_timeout_s must be in (0, 86400]")
        if not 0 < self.pull_stop_timeout_s <= 600:
            raise ValueError("pull_stop_timeout_s must be in (0, 600]")

    @property
    def engine_url(self) -> str:
        """Where the launcher itself reaches the engine (always loopback, whatever it binds)."""
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def artifacts_dir(self) -> Path:
        """Signed node copies of artifacts (shared by the node's pods, checked on every use)."""
        return self.node_cache_dir / "artifacts"

    @property
    def artifacts_work_dir(self) -> Path:
        return self.artifacts_work_root or self.node_cache_dir / "artifacts-work"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: object) -> LauncherSettings:
        """Defaults, then ``KVFLEET_NODE_CACHE`` from the pod, then explicit flags."""
        values: dict[str, object] = {}
        if environ.get("KVFLEET_NODE_CACHE"):
            values["node_cache_dir"] = Path(environ["KVFLEET_NODE_CACHE"])
        if environ.get("KVFLEET_DRAIN_TIMEOUT_S"):
            # The pod's drain budget (the operator renders it with terminationGracePeriodSeconds): a
            # shorter wait here would SIGKILL streams the pod still had time to finish.
            try:
                grace_s = float(environ["KVFLEET_DRAIN_TIMEOUT_S"])
            except ValueError:
                raise ValueError(
                    f"KVFLEET_DRAIN_TIMEOUT_S must be a number of seconds, got {environ['KVFLEET_DRAIN_TIMEOUT_S']!r}"
                ) from None
            values["stop"] = StopSettings(grace_s=grace_s)
        for env, name in (
            ("KVFLEET_ARTIFACT_KEYS", "artifact_keys_path"),
            ("KVFLEET_ARTIFACT_SIGNING_KEY", "artifact_signing_key_path"),
            ("KVFLEET_ARTIFACTS_WORK", "artifacts_work_root"),
        ):
            if environ.get(env):
                values[name] = Path(environ[env])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
