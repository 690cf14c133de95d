"""The launcher: weights and artifacts in, engine started, cold start measured, engine supervised.

``Launcher.run`` walks the phases in order (pull, artifacts, engine_start, first_ready), records
each one, then supervises the engine until it exits and returns the exit code the process should
end with. Everything it talks to is injected (:class:`LaunchDeps`), so tests run it against
the real S3 server (SeaweedFS) and a real reference engine without patching anything.

The rooms it walks through live beside it: the artifact steps (``artifact_steps``: restore, trust,
the fetch-or-rebuild decision, the push), the engine process (``supervisor``), readiness
(``readiness``), and its HTTP surface, ``/metrics``, ``/coldstart``, ``/progress`` and
``/tokenizer/{name}`` (``metrics_server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import aiohttp
from aiohttp import web

from kvfleet.spec import InferenceDeploymentSpec
from kvfleet.weight_cache.fingerprint import Accelerator
from kvfleet.weight_cache.progress import PullTracker

from .artifact_decision import measured_rate, record_node_rate
from .artifact_steps import ArtifactSteps
from .artifacts import probe_accelerator
from .engine_args import EngineCommand, RenderError, RenderInputs, render_engine_command
from .errors import EngineExitedError, LaunchError, SpecError
from .events import log, log_event
from .launch_spec import LaunchSpec
from .metrics_server import ColdStartMetrics, make_app, start_metrics_server
from .model_pin import pin_refusal, read_pin
from .overlap import OverlapDecision, decide_overlap, during_pull
from .phases import Clock, PhaseRecord, PhaseRecorder
from .readiness import serve_first_token, wait_healthy
from .settings import LauncherSettings
from .sources import ArtifactStore, PulledWeights, StreamingWeightPuller, WeightPuller
from .supervisor import EngineProcess, engine_environment

T = TypeVar("T")

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
        self._stream_dir: Path | None = None  # holds the engine's link to the pull's stream folder
        self._pull_done = False
        self._stop_signal: int | None = None
        self._task: asyncio.Task[Any] | None = None
        # Blocking work (pull, fetch, push) runs here rather than in asyncio's default executor,
        # which asyncio.run joins on exit: a stop during a long pull must not wait for it.
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfleet-launcher")
        self._artifacts = ArtifactSteps(
            launch,
            settings,
            store=deps.artifacts,
            accelerator=deps.accelerator,
            clock=deps.clock,
            recorder=self.recorder,
            metrics=self.metrics,
            in_thread=self._in_thread,
        )

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # -- reporting --------------------------------------------------------------------------

    def _on_record(self, record: PhaseRecord) -> None:
        log.info(record.log_line())
        self.metrics.record(record)

    def report(self) -> dict[str, Any]:
        """The ``/coldstart`` document."""
        doc = self.recorder.report()
        artifacts = self._artifacts.state
        doc.update(
            {
                "name": self.launch.name,
                "namespace": self.launch.namespace,
                "servedName": self.launch.served_name,
                "pod": self.deps.environ.get("KVFLEET_POD_NAME"),
                "modelDigest": self._weights.digest if self._weights else None,
                "artifactsFingerprint": artifacts.fingerprint.key if artifacts.fingerprint else None,
                "artifactsPushed": artifacts.pushed,
            }
        )
        return doc

    def progress(self) -> dict[str, Any]:
        """The ``/progress`` document: the running phase and the weight pull's figures (a few
        hundred bytes, whatever the model: the operator reads it with a small bound)."""
        phase = self.recorder.current or ("serve" if self.recorder.complete else None)
        report = self.pull_progress.report()
        return {"phase": phase, "pull": report.to_doc() if report is not None else None}

    def _model_dir(self) -> Path | None:
        """The folder the engine serves, once the weights are in place (``/tokenizer/{name}``)."""
        return self._weights.path if self._weights is not None else None

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
            log_event("pull_progress", progress=report.summary(), percent=report.percent, **report.to_doc())

    # -- signals ----------------------------------------------------------------------------

    def handle_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT: forward to a running engine; before it starts, abandon the launch."""
        self._stop_signal = signum
        if self._engine is not None:
            log_event("signal_forwarded", signal=signal.Signals(signum).name, pid=self._engine.pid)
            self._engine.send_signal(signum)
            if self.recorder.current == "pull" and self._task is not None:
                self._task.cancel()  # the engine started during the pull: abandon the pull too
        elif self._task is not None:
            self._task.cancel()

    @property
    def interrupted_before_engine(self) -> bool:
        """A stop came before the engine existed, or (overlap) while the pull still ran beside it:
        a pull thread may still be copying bytes, and the process should not wait for it."""
        return self._stop_signal is not None and (self._engine is None or not self._pull_done)

    # -- phases -----------------------------------------------------------------------------

    def _render(
        self, model_path: Path, artifacts_dir: Path | None, *, arrival_timeout_s: float | None = None
    ) -> EngineCommand:
        inputs = RenderInputs(
            model_path=model_path,
            served_name=self.launch.served_name,
            port=self.settings.engine_port,
            host=self.settings.engine_host,
            artifacts_dir=artifacts_dir,
            reference=self.settings.reference,
            kvfleet_command=(sys.executable, "-m", "kvfleet.cli"),
            python=sys.executable,
            drain_timeout_s=self.settings.stop.grace_s,
            kv_events_port=self.settings.kv_events_port,
            weights_arrival_timeout_s=arrival_timeout_s,
            vllm_load_format=self.settings.vllm_load_format,
        )
        try:
            return self.deps.render(self.launch.spec, inputs)
        except RenderError as e:
            raise SpecError(str(e)) from e

    async def _pull(self, stream_link: Path | None = None, stop: threading.Event | None = None) -> PulledWeights:
        with self.recorder.phase("pull") as detail:
            # Read at each start: a pin written after this pod was created holds from its next start.
            pinned = await self._in_thread(read_pin, self.settings.pin_path)
            launch = dataclasses.replace(self.launch, pinned_digest=pinned)
            ticker = asyncio.create_task(self._log_pull_progress(), name="pull-progress")
            try:
                if stream_link is not None:
                    streaming = cast(StreamingWeightPuller, self.deps.weights)
                    weights = await self._in_thread(
                        streaming.pull_streaming, launch, self.pull_progress, stream_link, stop
                    )
                else:
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
            self._pull_done = True
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

    async def _start_engine(self, command: EngineCommand) -> EngineProcess:
        for note in command.notes:
            log_event("engine_note", note=note)
        log_event("engine_command", argv=list(command.argv))
        env = engine_environment(self.deps.environ, command.env)
        try:
            return await EngineProcess.start(command.argv, env, stderr_sink=self.deps.engine_stderr)
        except OSError as e:
            raise LaunchError("engine_start", f"cannot start {command.argv[0]}: {e.strerror or e}") from e

    def overlap(self) -> OverlapDecision:
        """Whether this launch starts the engine while the weights are pulled (overlap.py)."""
        return decide_overlap(
            self.launch.spec,
            enabled=self.settings.overlap_pull and hasattr(self.deps.weights, "pull_streaming"),
            artifacts_store=self.deps.artifacts is not None,
        )

    async def _pull_then_start(self) -> tuple[EngineProcess, float]:
        """The pull, then the engine on the complete model folder; returns it and when it started."""
        weights = await self._pull()
        artifacts_dir = await self._artifacts.restore(weights, lambda: self._render(_DRY_RUN_MODEL, None).argv)
        command = self._render(weights.path, artifacts_dir)
        started = self.deps.clock()
        self._engine = engine = await self._start_engine(command)
        return engine, started

    async def _start_during_pull(self) -> tuple[EngineProcess, float, float]:
        """The engine at once on a folder the pull fills with verified files, then the pull; returns
        the engine, when it started and how long before the pull ended. A failed pull stops it."""
        self._stream_dir = Path(tempfile.mkdtemp(prefix="kvfleet-model-"))
        link = self._stream_dir / "model"
        command = self._render(link, None, arrival_timeout_s=self.settings.weights_arrival_timeout_s)
        started = self.deps.clock()
        self._engine = engine = await self._start_engine(command)
        weights = await self._pull_watching(engine, link)  # a failure stops the engine in _cleanup
        ahead = self.deps.clock() - started
        await self._artifacts.restore(weights, lambda: command.argv)  # off when overlapping: recorded so
        return engine, started, ahead

    async def _pull_watching(self, engine: EngineProcess, link: Path) -> PulledWeights:
        """The pull into ``link`` with the engine watched beside it: an engine that exits first
        stops the pull (bounded by ``pull_stop_timeout_s``) and fails the launch in engine_start
        with its exit code and last output, as a failed start without overlap does."""
        stop = threading.Event()
        pull = asyncio.create_task(self._pull(stream_link=link, stop=stop), name="pull")
        exited = asyncio.create_task(engine.wait(), name="engine-watch")
        try:
            await asyncio.wait({pull, exited}, return_when=asyncio.FIRST_COMPLETED)
            decision = during_pull(pull_ended=pull.done(), engine_returncode=exited.result() if exited.done() else None)
            if decision.action == "stop_pull":
                log_event("pull_stopped", reason=decision.reason)
                stop.set()
                await asyncio.wait({pull}, timeout=self.settings.pull_stop_timeout_s)
                raise EngineExitedError("engine_start", exited.result(), engine.tail())
            return pull.result()
        finally:
            # A stop signal cancels this task: the pull's thread is told too, not left copying.
            stop.set()
            for task in (pull, exited):
                task.cancel()
            await asyncio.wait({pull, exited})
            if not pull.cancelled():
                pull.exception()  # a stopped pull's own error is read here: the engine's is reported

    async def _run_phases(self, session: aiohttp.ClientSession) -> int:
        overlap = self.overlap()
        log_event("overlap", on=overlap.on, reason=overlap.reason)
        if overlap.on:
            engine, started, ahead = await self._start_during_pull()
        else:
            engine, started = await self._pull_then_start()
        # With overlap this phase is the engine's time past the pull's end, so the phases still add
        # up to launch-to-first-token; startedBeforePullEndS says how much of its start ran hidden.
        with self.recorder.phase("engine_start") as detail:
            detail.update(pid=engine.pid, overlap=overlap.on)
            if overlap.on:
                detail.update(startedBeforePullEndS=round(ahead, 4))
            await wait_healthy(engine, self.settings.engine_url, self.settings.readiness, session)
            detail.update(self._artifacts.compile_detail(self.deps.clock() - started))
        with self.recorder.phase("first_ready"):
            await serve_first_token(
                engine, self.settings.engine_url, self.launch.served_name, self.settings.readiness, session
            )
        total = self.recorder.total_seconds()
        self.metrics.set_total(total)
        log_event("coldstart", totalSeconds=round(total, 4), servedName=self.launch.served_name)
        self._artifacts.start_push(engine)
        code = await engine.wait()
        log_event("engine_exited", code=code, signal=self._stop_signal)
        return code

    async def _run(self) -> int:
        # Fail on a spec the engine cannot honour before spending minutes on a pull.
        self._render(_DRY_RUN_MODEL, None)
        try:
            runner = await start_metrics_server(
                make_app(self.metrics, self.report, self.progress, self._model_dir),
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
        await self._artifacts.wait_for_push()
        if self._engine is not None:
            if self._engine.returncode is None:
                await self._engine.stop(self.settings.stop)
            await self._engine.aclose()
        await self._artifacts.remove_directory()
        if self._stream_dir is not None:
            # Only the symlink the engine was started with: the files stay in the node cache.
            shutil.rmtree(self._stream_dir, ignore_errors=True)
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
            log_event("launch_abandoned", signal=signal.Signals(self._stop_signal).name)
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
