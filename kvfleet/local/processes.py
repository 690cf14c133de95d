"""Child processes that cannot outlive local mode: own process group, killed with their parent.

Every engine (and Prometheus) runs in its own session, so a signal to its group reaches anything
it spawns and a Ctrl-C on the terminal reaches only ``kvfleet local up``, which then drains
them in order. ``PR_SET_PDEATHSIG`` makes the kernel SIGKILL the child if the parent dies
without cleaning up (kill -9 of ``kvfleet local up``), so no engine is ever orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp

_PR_SET_PDEATHSIG = 1


class ProcessStartError(RuntimeError):
    """A child process could not be started or never became ready; the message says why."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may already be gone (race between fork and prctl): then exit at once.
    if os.getppid() == 1:
        os._exit(1)


@dataclass
class ChildProcess:
    """A started child: its process and where its output goes."""

    process: asyncio.subprocess.Process
    log_path: Path
    _log: IO[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def signal_group(self, sig: signal.Signals) -> bool:
        """Send ``sig`` to the child's whole process group; False if it is already gone."""
        if self.process.returncode is not None:
            return False
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            return False
        return True

    async def wait(self, timeout_s: float) -> int | None:
        """The exit code, or None if it is still running after ``timeout_s``."""
        try:
            return await asyncio.wait_for(self.process.wait(), timeout_s)
        except TimeoutError:
            return None

    async def stop(self, grace_s: float) -> int:
        """SIGTERM the group, wait ``grace_s``, then SIGKILL it; always reaps the child."""
        try:
            self.signal_group(signal.SIGTERM)
            code = await self.wait(grace_s)
            if code is None:
                self.kill()
                code = await self.process.wait()
            return code
        finally:
            self.close_log()

    def kill(self) -> None:
        """SIGKILL the whole group now (the second Ctrl-C, or a grace period that ran out)."""
        self.signal_group(signal.SIGKILL)

    def close_log(self) -> None:
        with contextlib.suppress(OSError):
            self._log.close()

    def log_tail(self, max_lines: int = 5, max_bytes: int = 4000) -> str:
        """The last lines of the child's output, for error messages (bounded: they go into events)."""
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - max_bytes))
                lines = handle.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(line[:300] for line in lines[-max_lines:])


async def spawn(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> ChildProcess:
    """Start ``argv`` in its own session, tied to this process's life, output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except OSError as e:
        log.close()
        raise ProcessStartError(f"cannot start {argv[0]}: {e}") from e
    return ChildProcess(process=process, log_path=log_path, _log=log)


async def wait_healthy(
    child: ChildProcess,
    url: str,
    session: aiohttp.ClientSession,
    timeout_s: float,
    poll_interval_s: float,
    request_timeout_s: float,
) -> None:
    """Poll ``url`` until it answers 200; raise ProcessStartError if the child exits or time runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = "no answer yet"
    while True:
        if child.returncode is not None:
            raise ProcessStartError(
                f"exited with code {child.returncode} before it was ready; last output:\n{child.log_tail()}"
            )
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=request_timeout_s)) as response:
                if response.status == 200:
                    return
                last = f"{url} answered {response.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            last = f"{url}: {type(e).__name__}"
        if loop.time() >= deadline:
            raise ProcessStartError(f"not ready after {timeout_s:g} s ({last})")
        await asyncio.sleep(poll_interval_s)
