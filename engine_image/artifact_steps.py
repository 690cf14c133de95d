"""The launch's engine-artifact steps: restore the artifact for this launch's fingerprint (the
node's signed copy first, then the bucket when the trusted offer is there and fetching it beats
rebuilding), count and log every artifact refused with its reason, work out the build time an
artifact would replace, and push one after first_ready when this launcher holds a signing key.

Apart from the launcher's phases and supervision because artifacts only make a start faster: every
failure here costs a rebuild, never the launch, and that rule reads in one place."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvfleet.weight_cache.artifacts import ArtifactOffer, ArtifactPullResult
from kvfleet.weight_cache.fingerprint import Accelerator, Fingerprint

from .artifact_decision import choose_rate, decide, measured_rate, read_node_rate, record_node_rate
from .artifacts import artifact_fingerprint
from .engine_args import REFERENCE_ARTIFACTS_SUBDIR, REFERENCE_COMPILE_REPORT, artifacts_ready_marker
from .errors import LaunchError
from .events import log_event
from .launch_spec import LaunchSpec
from .metrics_server import ColdStartMetrics
from .phases import Clock, PhaseRecorder
from .settings import LauncherSettings
from .sources import ArtifactStore, PulledWeights
from .supervisor import EngineProcess

T = TypeVar("T")

ARTIFACT_POLL_S = 0.2


class InThread(Protocol):
    """Runs blocking work (a fetch, a push, a directory walk) off the event loop."""

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


@dataclass
class ArtifactsState:
    fingerprint: Fingerprint | None = None
    directory: Path | None = None
    hit: bool = False
    pushed: bool = False
    # The start-up work the engine did that the artifact would replace (seconds), for the push.
    build_seconds: float | None = None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class ArtifactSteps:
    """The artifact steps of one launch; ``state`` is what the launcher reports and cleans up."""

    def __init__(
        self,
        launch: LaunchSpec,
        settings: LauncherSettings,
        *,
        store: ArtifactStore | None,
        accelerator: Callable[[bool], Accelerator],
        clock: Clock,
        recorder: PhaseRecorder,
        metrics: ColdStartMetrics,
        in_thread: InThread,
    ) -> None:
        self.launch = launch
        self.settings = settings
        self.store = store
        self.accelerator = accelerator
        self.clock = clock
        self.recorder = recorder
        self.metrics = metrics
        self._in_thread = in_thread
        self.state = ArtifactsState()
        self.push_task: asyncio.Task[None] | None = None

    async def restore(self, weights: PulledWeights, dry_run_argv: Callable[[], Sequence[str]]) -> Path | None:
        """The ``artifacts`` phase: the directory the engine reads its artifacts from (restored, or
        empty for the engine to build into), or None when artifacts are off."""
        with self.recorder.phase("artifacts") as detail:
            store = self.store
            if not self.launch.spec.cache.artifacts.enabled or store is None:
                detail.update(enabled=False)
                return None
            spec = self.launch.spec
            accelerator = await self._in_thread(self.accelerator, spec.resources.gpus >= 1)
            # Compile-relevant flags come from the command the engine will run (paths do not matter).
            fp = artifact_fingerprint(spec, weights.digest, accelerator, dry_run_argv())
            # A fresh directory of this launch's own: artifacts are unpacked here only after their
            # signature and bytes were checked, and the engine's writes here are never trusted later.
            directory = await self._in_thread(self._fresh_work_dir, fp)
            state = self.state
            state.fingerprint, state.directory = fp, directory
            try:
                local = await self._in_thread(store.restore_local, fp, directory)
            except LaunchError as e:
                log_event("artifacts_unavailable", fingerprint=fp.key, reason=e.reason)
                local = ArtifactPullResult(hit=False, reason=e.reason, key=fp.key, warning=True)
            if local.hit:
                state.hit, source = True, "node-cache"
                detail.update(reason=local.reason)
            else:
                if local.refusal is not None:
                    self._refused(fp, "node", local.refusal, local.reason)
                    detail.update(nodeRefused=local.refusal, nodeReason=local.reason)
                state.hit, source = await self._from_bucket(store, fp, directory, weights, detail)
            detail.update(enabled=True, fingerprint=fp.key, hit=state.hit, source=source)
        self.metrics.set_cache_hit("artifacts", state.hit)
        return directory

    def _fresh_work_dir(self, fp: Fingerprint) -> Path:
        root = self.settings.artifacts_work_dir
        root.mkdir(parents=True, exist_ok=True)
        if self.settings.artifacts_work_root is not None:
            # The pod's own emptyDir: only an earlier run of this container wrote here (a crash
            # loop would otherwise pile up one unpacked artifact per restart). Outside a pod the
            # default root may be shared by concurrent launchers, so nothing is removed there.
            for leftover in root.iterdir():
                shutil.rmtree(leftover, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f"{fp.key[:16]}-", dir=root))

    def _refused(self, fp: Fingerprint, where: str, refusal: str, reason: str) -> None:
        """An artifact that is there but never loaded: logged with why, and counted."""
        self.metrics.artifacts_refused.labels(reason=refusal, where=where).inc()
        log_event("artifacts_refused", fingerprint=fp.key, where=where, refused=refusal, reason=reason)

    def _bucket_miss(
        self, fp: Fingerprint, detail: dict[str, Any], refusal: str | None, reason: str
    ) -> tuple[bool, str]:
        """No artifact from the bucket: a plain miss, or a refusal (counted, with its reason)."""
        detail.update(reason=reason)
        if refusal is None:
            return False, "miss"
        self._refused(fp, "bucket", refusal, reason)
        detail.update(refused=refusal)
        return False, "refused"

    async def _from_bucket(
        self, store: ArtifactStore, fp: Fingerprint, directory: Path, weights: PulledWeights, detail: dict[str, Any]
    ) -> tuple[bool, str]:
        """Fetch the artifact when the bucket has a trusted one and fetching it beats rebuilding; (hit, source)."""
        offer = await self._in_thread(store.describe, fp)
        if not offer.found:
            return self._bucket_miss(fp, detail, offer.refusal, offer.reason)
        root = self.settings.artifacts_dir
        pull = self.recorder.records.get("pull")
        pulled = weights.bytes_fetched
        candidates = [
            measured_rate(pulled, pull.seconds, "this launch's weight pull") if pull else None,
            await self._in_thread(read_node_rate, root),
        ]
        rate = choose_rate(candidates, self.settings.artifact_decision)
        decision = decide(offer.size_bytes, offer.build_seconds, rate, self.settings.artifact_decision)
        detail.update(
            reason=decision.reason,
            sizeBytes=offer.size_bytes,
            buildSeconds=offer.build_seconds,
            expectedFetchSeconds=round(decision.expected_fetch_s, 4),
        )
        log_event("artifacts_decision", fingerprint=fp.key, use=decision.use, reason=decision.reason)
        if not decision.use:
            return False, "skipped"
        started = self.clock()
        result = await self._fetch_artifacts(store, fp, directory, offer)
        seconds = self.clock() - started
        detail.update(fetchSeconds=round(seconds, 4))
        if not result.hit:
            return self._bucket_miss(fp, detail, result.refusal, result.reason)
        sample = measured_rate(offer.size_bytes, seconds, "node record")
        if sample is not None:
            await self._in_thread(record_node_rate, root, sample)
        return True, "bucket"

    async def _fetch_artifacts(
        self, store: ArtifactStore, fp: Fingerprint, directory: Path, offer: ArtifactOffer
    ) -> ArtifactPullResult:
        # Artifacts only make a start faster: a bucket that fails here costs a rebuild, not the launch.
        try:
            result = await self._in_thread(store.fetch, fp, directory, offer)
        except LaunchError as e:
            log_event("artifacts_unavailable", fingerprint=fp.key, reason=e.reason)
            result = ArtifactPullResult(hit=False, reason=e.reason, key=fp.key, warning=True)
        if not result.hit:
            # The engine builds into the directory instead: it must start empty.
            await self._in_thread(shutil.rmtree, directory, True)
            await self._in_thread(functools.partial(directory.mkdir, parents=True, exist_ok=True))
        return result

    async def _push(self, engine: EngineProcess) -> None:
        state, store = self.state, self.store
        assert state.fingerprint is not None and state.directory is not None and store is not None
        start = self.clock()
        marker = artifacts_ready_marker(self.launch.spec.engine.kind)
        try:
            async with asyncio.timeout(self.settings.artifact_push_timeout_s):
                if marker is not None:
                    await self._wait_for_file(state.directory / marker, engine)
                    if _read_json(state.directory / marker).get("empty"):
                        log_event(
                            "artifacts_push_skipped", fingerprint=state.fingerprint.key, reason="the engine built none"
                        )
                        return
                await self._in_thread(store.push, state.fingerprint, state.directory, state.build_seconds)
        except (TimeoutError, LaunchError) as e:
            limit_s = self.settings.artifact_push_timeout_s
            reason = e.reason if isinstance(e, LaunchError) else f"timed out after {limit_s:g} s"
            log_event("artifacts_push_failed", fingerprint=state.fingerprint.key, reason=reason)
            return
        state.pushed = True
        self.metrics.artifacts_pushed.set(1)
        log_event("artifacts_pushed", fingerprint=state.fingerprint.key, seconds=round(self.clock() - start, 4))

    async def _wait_for_file(self, path: Path, engine: EngineProcess) -> None:
        # The engine finishes writing its artifacts after it is ready; poll (bounded by the caller).
        while not await self._in_thread(path.exists):
            if engine.returncode is not None:
                raise LaunchError("serve", f"engine exited before it wrote {path.name}")
            await asyncio.sleep(ARTIFACT_POLL_S)

    def compile_detail(self, engine_start_s: float) -> dict[str, Any]:
        """What the engine's compile did this start (reference engine: its own report), and the
        build time an artifact pushed after this start replaces."""
        state = self.state
        if state.directory is None:
            return {}
        report = _read_json(state.directory / REFERENCE_ARTIFACTS_SUBDIR / REFERENCE_COMPILE_REPORT)
        if self.launch.spec.engine.kind == "reference":
            if not report:
                return {"compile": False}
            if not report.get("cacheHit"):
                state.build_seconds = float(report.get("compileSeconds", 0.0))
            return {
                "compileSeconds": report.get("compileSeconds"),
                "compileCacheHit": report.get("cacheHit"),
                "compileReason": report.get("reason"),
            }
        # vLLM and SGLang compile inside their start; without their own report, the whole start
        # is the (upper-bound) build time the artifact replaces.
        state.build_seconds = engine_start_s
        return {}

    def start_push(self, engine: EngineProcess) -> None:
        """After first_ready, so building and uploading the tar never delays readiness: push what
        the engine built, when nothing was restored and this launcher may sign."""
        state, store = self.state, self.store
        if state.directory is None or state.hit or store is None:
            return
        if store.can_push:
            self.push_task = asyncio.create_task(self._push(engine), name="artifacts-push")
        else:
            log_event(
                "artifacts_push_skipped",
                fingerprint=state.fingerprint.key if state.fingerprint else None,
                reason="this launcher holds no artifact signing key (engine pods never do); "
                "a trusted builder signs and pushes artifacts",
            )

    async def wait_for_push(self) -> None:
        if self.push_task is not None:
            # A push that started is let finish (bounded by its own timeout): the artifacts are good.
            await asyncio.wait({self.push_task})

    async def remove_directory(self) -> None:
        if self.state.directory is not None:
            # This launch's unpacked copy: the signed node copy serves the next launch.
            await self._in_thread(shutil.rmtree, self.state.directory, True)
