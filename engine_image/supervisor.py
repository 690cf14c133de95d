"""Run the engine as a child process: forward signals to it and keep its exit code.

The launcher cannot simply ``exec`` the engine: it must keep serving its metrics endpoint and push
artifacts after the engine is ready. So it supervises instead, and behaves like the engine to the
outside: SIGTERM and SIGINT go to the engine (which drains and exits), and the launcher exits with
the engine's code (``128 + N`` when a signal N killed it, the shell and Kubernetes convention).

The engine runs in its own session so a terminal's Ctrl-C reaches it once, through the launcher,
not twice (a second SIGINT means "exit now" to the engine). Its stderr passes through a small tee
that keeps the last few KiB, so a launch that fails can say what the engine said last.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

# How much of the engine's stderr to keep for the failure line, and how much of it to show.
TAIL_BYTES = 8192
TAIL_LINES = 3
TAIL_LINE_CHARS = 240
READ_CHUNK_BYTES = 65536


@dataclass(frozen=True)
class StopSettings:
    """How long the engine may drain after SIGTERM before it is killed."""

    grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.grace_s <= 3600:
            raise ValueError("grace_s must be in (0, 3600]")


def _clip(line: str) -> str:
    # The end of a long line (an exception's message) says more than its start.
    return line if len(line) <= TAIL_LINE_CHARS else "..." + line[-TAIL_LINE_CHARS:]


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + N`` when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


class EngineProcess:
    """A started engine. Create with :meth:`start`; always ``await stop()`` or ``wait()``."""

    def __init__(self, process: asyncio.subprocess.Process, sink: BinaryIO | None) -> None:
        self._process = process
        self._tail = bytearray()
        self._sink = sink
        self._tee = asyncio.create_task(self._copy_stderr(), name="engine-stderr-tee")

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        stderr_sink: BinaryIO | None = None,
    ) -> EngineProcess:
        """Start ``argv`` with ``env`` (the full environment); raises OSError if it cannot start."""
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        return cls(process, stderr_sink if stderr_sink is not None else sys.stderr.buffer)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    async def _copy_stderr(self) -> None:
        stream = self._process.stderr
        assert stream is not None
        while chunk := await stream.read(READ_CHUNK_BYTES):
            if self._sink is not None:
                with contextlib.suppress(OSError, ValueError):  # a closed log sink must not kill the engine
                    self._sink.write(chunk)
                    self._sink.flush()
            self._tail += chunk
            del self._tail[:-TAIL_BYTES]

    def tail(self) -> str:
        """The last few non-empty lines the engine wrote to stderr."""
        lines = [line for line in self._tail.decode("utf-8", "replace").splitlines() if line.strip()]
        return " | ".join(_clip(line.strip()) for line in lines[-TAIL_LINES:])

    def send_signal(self, signum: int) -> None:
        """Forward ``signum``; a no-op once the engine has exited."""
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.send_signal(signum)

    async def wait(self) -> int:
        """Wait for the engine to exit; returns its exit status (``128 + N`` for signal N)."""
        returncode = await self._process.wait()
        # Let the tee drain so tail() sees the last words of the engine.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._tee), timeout=5.0)
        return exit_status(returncode)

    async def stop(self, settings: StopSettings) -> int:
        """SIGTERM, wait up to ``grace_s`` for the drain, then SIGKILL; returns the exit status."""
        self.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(asyncio.shield(self.wait()), timeout=settings.grace_s)
        except TimeoutError:
            self.send_signal(signal.SIGKILL)
            return await self.wait()

    async def aclose(self) -> None:
        """Make sure nothing outlives the launcher: kill the engine if it still runs."""
        if self._process.returncode is None:
            self.send_signal(signal.SIGKILL)
            await self._process.wait()
        if not self._tee.done():
            self._tee.cancel()
            # asyncio.wait does not raise the tee's CancelledError, yet still lets our own through.
            await asyncio.wait([self._tee])


def engine_environment(base: Mapping[str, str], additions: Mapping[str, str]) -> dict[str, str]:
    """The engine's environment: the launcher's own, then the rendered additions on top."""
    env = dict(base)
    env.update(additions)
    # Engine logs should reach the pod log as they happen, not when a buffer fills.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def current_environment() -> dict[str, str]:
    return dict(os.environ)
