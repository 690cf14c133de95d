"""The launcher process: settings from flags and environment, the real dependencies, exit code."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from .errors import LaunchError
from .launch_spec import LaunchSpec, load_launch_spec
from .launcher import LaunchDeps, Launcher, run_with_signals
from .readiness import ReadinessSettings
from .settings import LauncherSettings
from .sources import LocalWeights, WeightPuller, local_model_path


def default_deps(launch: LaunchSpec, settings: LauncherSettings) -> LaunchDeps:
    """The production collaborators: local paths as they are, remote models via the weight cache."""
    from .cache_sources import CacheArtifacts, CacheWeights

    weights: WeightPuller
    if local_model_path(launch.spec.model.uri, settings.pvc_mount_root) is not None:
        weights = LocalWeights(settings.pvc_mount_root)
    else:
        weights = CacheWeights(settings.node_cache_dir)
    return LaunchDeps(weights=weights, artifacts=CacheArtifacts.for_spec(launch.spec, settings))


TERMINATION_LOG = Path(os.environ.get("KVFLEET_TERMINATION_LOG", "/dev/termination-log"))
TERMINATION_MESSAGE_BYTES = 4096  # the kubelet keeps at most 4096 bytes of it


def write_termination_message(message: str, path: Path | None = None) -> bool:
    """Leave why the launch failed where the kubelet reads it into the pod status (and from there
    the operator into the Degraded condition). Outside a pod the file may not exist: skip it."""
    target = path or TERMINATION_LOG
    try:
        with open(target, "w", encoding="utf-8") as out:
            out.write(message.encode("utf-8")[:TERMINATION_MESSAGE_BYTES].decode("utf-8", "ignore"))
    except OSError:
        return False
    return True


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("kvfleet")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def main(
    *,
    spec_path: Path,
    node_cache_dir: Path | None,
    engine_port: int,
    metrics_port: int,
    metrics_host: str,
    ready_timeout_s: float,
    overlap_pull: bool = True,
    vllm_load_format: str | None = None,
) -> int:
    """Run one launch; returns the exit code (the engine's, or 2/3 for the launcher's failures)."""
    _configure_logging()
    launcher: Launcher | None = None
    try:
        settings = LauncherSettings.from_env(
            spec_path=spec_path,
            node_cache_dir=node_cache_dir,
            engine_port=engine_port,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            readiness=ReadinessSettings(ready_timeout_s=ready_timeout_s),
            overlap_pull=overlap_pull,
            vllm_load_format=vllm_load_format,
        )
        launch = load_launch_spec(settings.spec_path)
        launcher = Launcher(launch, settings, default_deps(launch, settings))
        code = asyncio.run(run_with_signals(launcher))
    except LaunchError as e:
        print(e.one_line(), file=sys.stderr, flush=True)
        write_termination_message(e.one_line())
        return e.exit_code
    if launcher.interrupted_before_engine:
        # A pull thread may still be copying bytes; its temp files are cleaned by the next pull, and
        # waiting for it would hold the pod past its grace period. Leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
