"""The engine thread and its bridge to asyncio.

``EngineCore.step`` runs on one dedicated thread (torch releases the GIL inside kernels, so the
event loop stays responsive). Handlers talk to it through a bounded thread-safe command queue;
outputs come back to each request's asyncio queue through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.errors import EngineDeadError, EngineError, OverloadedError
from kvfleet.engine.request import EngineRequest, RequestOutput
from kvfleet.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class RequestStream:
    """Outputs of one request, in order. Call :meth:`abort` if you stop reading before the end."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.created_s = int(time.time())  # the response's "created", the same in every chunk
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def _put(self, output: RequestOutput) -> None:
        self._queue.put_nowait(output)

    async def next(self) -> RequestOutput:
        output = await self._queue.get()
        if output.finished:
            self.finished = True
            self._engine._done(self.request_id)
        return output

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine._abort(self.request_id)


class AsyncEngine:
    def __init__(self, core: EngineCore, *, max_waiting_requests: int, retry_after_s: int = 1) -> None:
        self.core = core
        # Running is at most max_num_seqs, so this bound keeps the waiting queue within its own.
        self.max_in_flight = core.settings.max_num_seqs + max_waiting_requests
        self.retry_after_s = retry_after_s
        self._commands: queue.Queue[_Command] = queue.Queue(maxsize=4 * self.max_in_flight + 16)
        self._in_flight: set[str] = set()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine-step", daemon=True)
        self._sinks: dict[str, Sink] = {}
        self.dead: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.core.close()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns():x}"

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request (lengths already checked by the caller with ``core.check_lengths``)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.dead}")
        if len(self._in_flight) >= self.max_in_flight:
            raise OverloadedError(
                f"the waiting queue is full ({len(self._in_flight)} requests in flight, bound {self.max_in_flight})",
                retry_after_s=self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id)
        request = EngineRequest(request_id, prompt_token_ids, params, time.monotonic())

        def sink(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(stream._put, output)

        try:
            self._commands.put_nowait(_Add(request, sink))
        except queue.Full as e:  # the engine thread is behind on commands: same answer as a full queue
            raise OverloadedError("the engine is behind on its command queue", retry_after_s=self.retry_after_s) from e
        self._in_flight.add(request_id)
        return stream

    def _done(self, request_id: str) -> None:
        self._in_flight.discard(request_id)

    def _abort(self, request_id: str) -> None:
        self._in_flight.discard(request_id)
        try:
            self._commands.put_nowait(_Abort(request_id))
        except queue.Full:  # cannot happen while the bound holds; the request then finishes normally
            log.warning("command queue full; %s runs to completion instead of aborting", request_id)

    # -- engine thread ---------------------------------------------------------------------
    def _apply(self, command: _Command) -> bool:
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Add):
            try:
                self.core.add_request(command.request)
            except EngineError as e:  # the server checks lengths first; this is the backstop
                log.warning("refused %s: %s", command.request.request_id, e)
                command.sink(RequestOutput(command.request.request_id, "", (), True, "error", 0, 0, 0))
                return True
            self._sinks[command.request.request_id] = command.sink
        else:
            self._sinks.pop(command.request_id, None)
            self.core.abort(command.request_id)
        return True

    def _run(self) -> None:
        poll_s = self.core.settings.idle_poll_s
        try:
            while True:
                try:
                    command = self._commands.get(timeout=poll_s) if not self.core.has_work() else None
                    while True:
                        if command is not None and not self._apply(command):
                            return
                        command = self._commands.get_nowait()
                except queue.Empty:
                    pass
                if not self.core.has_work():
                    continue
                for output in self.core.step():
                    sink = self._sinks.get(output.request_id)
                    if sink is not None:
                        sink(output)
                        if output.finished:
                            del self._sinks[output.request_id]
        except BaseException as e:
            log.exception("engine step loop died")
            self.dead = e
            for request_id, sink in list(self._sinks.items()):
                sink(RequestOutput(request_id, "", (), True, "error", 0, 0, 0))
            self._sinks.clear()
