"""The launcher: weights and artifacts in, engine started, cold start measured, engine supervised.

``Launcher.run`` walks the phases in order (pull, artifacts, engine_start, first_ready), records
each one, then supervises the engine until it exits and returns the exit code the process should
end with. Everything it talks to is injected (:class:`LaunchDeps`), so tests run it against
moto's S3 server and a real reference engine without patching anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import aiohttp
from aiohttp import web

from kvfleet.spec import InferenceDeploymentSpec
from kvfleet.weight_cache.artifacts import ArtifactOffer, ArtifactPullResult
from kvfleet.weight_cache.fingerprint import Accelerator, Fingerprint
from kvfleet.weight_cache.progress import PullTracker

from .artifact_decision import choose_rate, decide, measured_rate, read_node_rate, record_node_rate
from .artifacts import artifact_fingerprint, probe_accelerator
from .engine_args import (
    REFERENCE_ARTIFACTS_SUBDIR,
    REFERENCE_COMPILE_REPORT,
    EngineCommand,
    RenderError,
    RenderInputs,
    artifacts_ready_marker,
    render_engine_command,
)
from .errors import EngineExitedError, LaunchError, SpecError
from .launch_spec import LaunchSpec
from .metrics_server import ColdStartMetrics, make_app, start_metrics_server
from .model_pin import pin_refusal, read_pin
from .phases import Clock, PhaseRecord, PhaseRecorder
from .readiness import serve_first_token, wait_healthy
from .settings import LauncherSettings
from .sources import ArtifactStore, PulledWeights, WeightPuller
from .supervisor import EngineProcess, engine_environment

log = logging.getLogger("kvfleet.engine_image.launcher")
T = TypeVar("T")

ARTIFACT_POLL_S = 0.2
# The model path the early dry-run render uses: only its validity checks matter there.
_DRY_RUN_MODEL = Path("/model")


@dataclass(frozen=True)
class LaunchDeps:
    """The launcher's collaborators: the weight cache, the artifact store, the machine probe, a clock."""

    weights: WeightPuller
    artifacts: ArtifactStore | None = None
    accelerator: Callable[[bool], Accelerator] = probe_accelerator
    clock: Clock = time.monotonic
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    # Where the engine's stderr is copied to (the launcher's own stderr by default).
    engine_stderr: BinaryIO | None = None
    render: Callable[[InferenceDeploymentSpec, RenderInputs], EngineCommand] = render_engine_command


@dataclass
class _ArtifactsState:
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


def _log_event(event: str, **fields: Any) -> None:
    log.info(json.dumps({"event": event, **fields}, default=str))


def progress_log_due(last_logged_s: float | None, now_s: float, interval_s: float) -> bool:
    """At most one progress line per ``interval_s``; the first one as soon as there is one."""
    return last_logged_s is None or now_s - last_logged_s >= interval_s


class Launcher:
    """One launch of one engine. Not reusable: create a new one per launch."""

    def __init__(self, launch: LaunchSpec, settings: LauncherSettings, deps: LaunchDeps) -> None:
        self.launch = launch
        self.settings = settings
        self.deps = deps
        self.metrics = ColdStartMetrics()
        self.recorder = PhaseRecorder(deps.clock, on_record=self._on_record)
        self.pull_progress = PullTracker(settings.pull_progress, clock=deps.clock)
        self.metrics.track_pull(self.pull_progress.report)
        self._engine: EngineProcess | None = None
        self._weights: PulledWeights | None = None
        self._artifacts = _ArtifactsState()
        self._stop_signal: int | None = None
        self._task: asyncio.Task[Any] | None = None
        self._push_task: asyncio.Task[None] | None = None
        # Blocking work (pull, fetch, push) runs here rather than in asyncio's default executor,
        # which asyncio.run joins on exit: a stop during a long pull must not wait for it.
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfleet-launcher")

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # -- reporting --------------------------------------------------------------------------

    def _on_record(self, record: PhaseRecord) -> None:
        log.info(record.log_line())
        self.metrics.record(record)

    def report(self) -> dict[str, Any]:
        """The ``/coldstart`` document."""
        doc = self.recorder.report()
        doc.update(
            {
                "name": self.launch.name,
                "namespace": self.launch.namespace,
                "servedName": self.launch.served_name,
                "pod": self.deps.environ.get("KVFLEET_POD_NAME"),
                "modelDigest": self._weights.digest if self._weights else None,
                "artifactsFingerprint": self._artifacts.fingerprint.key if self._artifacts.fingerprint else None,
                "artifactsPushed": self._artifacts.pushed,
            }
        )
        return doc

    def progress(self) -> dict[str, Any]:
        """The ``/progress`` document: the running phase and the weight pull's figures (a few
        hundred bytes, whatever the model: the operator reads it with a small bound)."""
        phase = self.recorder.current or ("serve" if self.recorder.complete else None)
        report = self.pull_progress.report()
        return {"phase": phase, "pull": report.to_doc() if report is not None else None}

    async def _log_pull_progress(self) -> None:
        """Log the pull's progress while it runs (cancelled when it ends). Wakes every sample
        interval so the first line comes right after the pull starts; logs at the bounded rate."""
        last_logged: float | None = None
        while True:
            await asyncio.sleep(self.settings.pull_progress.sample_interval_s)
            now = self.deps.clock()
            if not progress_log_due(last_logged, now, self.settings.progress_log_interval_s):
                continue
            report = self.pull_progress.report()
            if report is None:
                continue  # a node-cache hit or a lock wait: nothing is moving
            last_logged = now
            _log_event("pull_progress", progress=report.summary(), percent=report.percent, **report.to_doc())

    # -- signals ----------------------------------------------------------------------------

    def handle_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT: forward to a running engine; before it starts, abandon the launch."""
        self._stop_signal = signum
        if self._engine is not None:
            _log_event("signal_forwarded", signal=signal.Signals(signum).name, pid=self._engine.pid)
            self._engine.send_signal(signum)
        elif self._task is not None:
            self._task.cancel()

    @property
    def interrupted_before_engine(self) -> bool:
        return self._stop_signal is not None and self._engine is None

    # -- phases -----------------------------------------------------------------------------

    def _render(self, model_path: Path, artifacts_dir: Path | None) -> EngineCommand:
        inputs = RenderInputs(
            model_path=model_path,
            served_name=self.launch.served_name,
            port=self.settings.engine_port,
            host=self.settings.engine_host,
            artifacts_dir=artifacts_dir,
            reference=self.settings.reference,
            kvfleet_command=(sys.executable, "-m", "kvfleet.cli"),
            drain_timeout_s=self.settings.stop.grace_s,
            kv_events_port=self.settings.kv_events_port,
        )
        try:
            return self.deps.render(self.launch.spec, inputs)
        except RenderError as e:
            raise SpecError(str(e)) from e

    async def _pull(self) -> PulledWeights:
        with self.recorder.phase("pull") as detail:
            # Read at each start: a pin written after this pod was created holds from its next start.
            pinned = await self._in_thread(read_pin, self.settings.pin_path)
            launch = dataclasses.replace(self.launch, pinned_digest=pinned)
            ticker = asyncio.create_task(self._log_pull_progress(), name="pull-progress")
            try:
                weights = await self._in_thread(self.deps.weights.pull, launch, self.pull_progress)
            finally:
                ticker.cancel()
                await asyncio.wait({ticker})  # never raises: a stop of this task still propagates
            if pinned is not None and weights.digest != pinned:
                # Every source is held to the pin, whatever it checked itself (a local model included).
                if weights.release is not None:
                    weights.release()
                raise LaunchError("pull", pin_refusal(weights.digest, pinned, self.launch.spec.model.uri))
            self._weights = weights
            detail.update(source=weights.source, digest=weights.digest, bytesFetched=weights.bytes_fetched)
            detail.update(pinned=pinned is not None, **weights.check)
        self.metrics.set_cache_hit("node", weights.node_cache_hit)
        self.metrics.node_cache_refused.set(weights.refused_files)
        pull = self.recorder.records.get("pull")
        rate = measured_rate(weights.bytes_fetched, pull.seconds, "node record") if pull else None
        if rate is not None:
            # What this node gets from the bucket: the next launch's artifact decision reads it.
            with contextlib.suppress(OSError):
                await self._in_thread(record_node_rate, self.settings.artifacts_dir, rate)
        return weights

    async def _restore_artifacts(self, weights: PulledWeights) -> Path | None:
        with self.recorder.phase("artifacts") as detail:
            store = self.deps.artifacts
            if not self.launch.spec.cache.artifacts.enabled or store is None:
                detail.update(enabled=False)
                return None
            spec = self.launch.spec
            accelerator = await self._in_thread(self.deps.accelerator, spec.resources.gpus >= 1)
            # Compile-relevant flags come from the command the engine will run (paths do not matter).
            fp = artifact_fingerprint(spec, weights.digest, accelerator, self._render(_DRY_RUN_MODEL, None).argv)
            # A fresh directory of this launch's own: artifacts are unpacked here only after their
            # signature and bytes were checked, and the engine's writes here are never trusted later.
            directory = await self._in_thread(self._fresh_work_dir, fp)
            state = self._artifacts
            state.fingerprint, state.directory = fp, directory
            try:
                local = await self._in_thread(store.restore_local, fp, directory)
            except LaunchError as e:
                _log_event("artifacts_unavailable", fingerprint=fp.key, reason=e.reason)
                local = ArtifactPullResult(hit=False, reason=e.reason, key=fp.key, warning=True)
            if local.hit:
                state.hit, source = True, "node-cache"
                detail.update(reason=local.reason)
            else:
                if local.refusal is not None:
                    self._refused(fp, "node", local.refusal, local.reason)
                    detail.update(nodeRefused=local.refusal, nodeReason=local.reason)
                state.hit, source = await self._from_bucket(store, fp, directory, detail)
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
        _log_event("artifacts_refused", fingerprint=fp.key, where=where, refused=refusal, reason=reason)

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
        self, store: ArtifactStore, fp: Fingerprint, directory: Path, detail: dict[str, Any]
    ) -> tuple[bool, str]:
        """Fetch the artifact when the bucket has a trusted one and fetching it beats rebuilding; (hit, source)."""
        offer = await self._in_thread(store.describe, fp)
        if not offer.found:
            return self._bucket_miss(fp, detail, offer.refusal, offer.reason)
        root = self.settings.artifacts_dir
        pull = self.recorder.records.get("pull")
        pulled = self._weights.bytes_fetched if self._weights else 0
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
        _log_event("artifacts_decision", fingerprint=fp.key, use=decision.use, reason=decision.reason)
        if not decision.use:
            return False, "skipped"
        started = self.deps.clock()
        result = await self._fetch_artifacts(store, fp, directory, offer)
        seconds = self.deps.clock() - started
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
            _log_event("artifacts_unavailable", fingerprint=fp.key, reason=e.reason)
            result = ArtifactPullResult(hit=False, reason=e.reason, key=fp.key, warning=True)
        if not result.hit:
            # The engine builds into the directory instead: it must start empty.
            await self._in_thread(shutil.rmtree, directory, True)
            await self._in_thread(functools.partial(directory.mkdir, parents=True, exist_ok=True))
        return result

    async def _start_engine(self, command: EngineCommand) -> EngineProcess:
        for note in command.notes:
            _log_event("engine_note", note=note)
        _log_event("engine_command", argv=list(command.argv))
        env = engine_environment(self.deps.environ, command.env)
        try:
            return await EngineProcess.start(command.argv, env, stderr_sink=self.deps.engine_stderr)
        except OSError as e:
            raise LaunchError("engine_start", f"cannot start {command.argv[0]}: {e.strerror or e}") from e

    async def _push_artifacts(self) -> None:
        state, store = self._artifacts, self.deps.artifacts
        assert state.fingerprint is not None and state.directory is not None and store is not None
        start = self.deps.clock()
        marker = artifacts_ready_marker(self.launch.spec.engine.kind)
        try:
            async with asyncio.timeout(self.settings.artifact_push_timeout_s):
                if marker is not None:
                    await self._wait_for_file(state.directory / marker)
                    if _read_json(state.directory / marker).get("empty"):
                        _log_event(
                            "artifacts_push_skipped", fingerprint=state.fingerprint.key, reason="the engine built none"
                        )
                        return
                await self._in_thread(store.push, state.fingerprint, state.directory, state.build_seconds)
        except (TimeoutError, LaunchError) as e:
            limit_s = self.settings.artifact_push_timeout_s
            reason = e.reason if isinstance(e, LaunchError) else f"timed out after {limit_s:g} s"
            _log_event("artifacts_push_failed", fingerprint=state.fingerprint.key, reason=reason)
            return
        state.pushed = True
        self.metrics.artifacts_pushed.set(1)
        _log_event("artifacts_pushed", fingerprint=state.fingerprint.key, seconds=round(self.deps.clock() - start, 4))

    async def _wait_for_file(self, path: Path) -> None:
        # The engine finishes writing its artifacts after it is ready; poll (bounded by the caller).
        while not await self._in_thread(path.exists):
            if self._engine is not None and self._engine.returncode is not None:
                raise LaunchError("serve", f"engine exited before it wrote {path.name}")
            await asyncio.sleep(ARTIFACT_POLL_S)

    def _compile_detail(self, engine_start_s: float) -> dict[str, Any]:
        """What the engine's compile did this start (reference engine: its own report), and the
        build time an artifact pushed after this start replaces."""
        state = self._artifacts
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

    async def _run_phases(self, session: aiohttp.ClientSession) -> int:
        weights = await self._pull()
        artifacts_dir = await self._restore_artifacts(weights)
        command = self._render(weights.path, artifacts_dir)
        with self.recorder.phase("engine_start") as detail:
            started = self.deps.clock()
            self._engine = engine = await self._start_engine(command)
            detail.update(pid=engine.pid)
            await wait_healthy(engine, self.settings.engine_url, self.settings.readiness, session)
            detail.update(self._compile_detail(self.deps.clock() - started))
        with self.recorder.phase("first_ready"):
            await serve_first_token(
                engine, self.settings.engine_url, self.launch.served_name, self.settings.readiness, session
            )
        total = self.recorder.total_seconds()
        self.metrics.set_total(total)
        _log_event("coldstart", totalSeconds=round(total, 4), servedName=self.launch.served_name)
        state, store = self._artifacts, self.deps.artifacts
        if state.directory is not None and not state.hit and store is not None:
            if store.can_push:
                # After first_ready, so building and uploading the tar never delays readiness.
                self._push_task = asyncio.create_task(self._push_artifacts(), name="artifacts-push")
            else:
                _log_event(
                    "artifacts_push_skipped",
                    fingerprint=state.fingerprint.key if state.fingerprint else None,
                    reason="this launcher holds no artifact signing key (engine pods never do); "
                    "a trusted builder signs and pushes artifacts",
                )
        code = await engine.wait()
        _log_event("engine_exited", code=code, signal=self._stop_signal)
        return code

    async def _run(self) -> int:
        # Fail on a spec the engine cannot honour before spending minutes on a pull.
        self._render(_DRY_RUN_MODEL, None)
        try:
            runner = await start_metrics_server(
                make_app(self.metrics, self.report, self.progress),
                self.settings.metrics_host,
                self.settings.metrics_port,
            )
        except OSError as e:
            where = f"{self.settings.metrics_host}:{self.settings.metrics_port}"
            raise LaunchError("metrics", f"cannot listen on {where}: {e.strerror or e}") from e
        try:
            async with aiohttp.ClientSession() as session:
                try:
                    return await self._run_phases(session)
                except EngineExitedError as e:
                    if self._stop_signal is not None:
                        # We forwarded a stop while the engine was starting: its exit is the answer.
                        return e.returncode
                    raise
        finally:
            await self._cleanup(runner)

    async def _cleanup(self, runner: web.AppRunner) -> None:
        if self._push_task is not None:
            # A push that started is let finish (bounded by its own timeout): the artifacts are good.
            await asyncio.wait({self._push_task})
        if self._engine is not None:
            if self._engine.returncode is None:
                await self._engine.stop(self.settings.stop)
            await self._engine.aclose()
        if self._artifacts.directory is not None:
            # This launch's unpacked copy: the signed node copy serves the next launch.
            await self._in_thread(shutil.rmtree, self._artifacts.directory, True)
        if self._weights is not None and self._weights.release is not None:
            self._weights.release()
        await runner.cleanup()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self) -> int:
        """Run the launch to the engine's exit; returns the process exit code.

        Raises :class:`LaunchError` when a phase fails. A stop signal before the engine started
        ends the launch with ``128 + signal``.
        """
        self._task = asyncio.current_task()
        try:
            return await self._run()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stop_signal is None or task is None:
                raise
            # The cancellation was ours (a stop signal before the engine existed), not the caller's.
            task.uncancel()
            _log_event("launch_abandoned", signal=signal.Signals(self._stop_signal).name)
            return 128 + self._stop_signal


async def run_with_signals(launcher: Launcher) -> int:
    """Run ``launcher`` with SIGTERM and SIGINT handed to it (the container's PID 1 behaviour)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, launcher.handle_signal, signum)
    try:
        return await launcher.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signum)
