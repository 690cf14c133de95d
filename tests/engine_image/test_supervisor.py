"""The supervisor with real child processes: signals reach the child, exit codes survive."""

from __future__ import annotations

import asyncio
import io
import signal
import sys

import pytest

from kvfleet.engine_image.supervisor import EngineProcess, StopSettings, engine_environment, exit_status

# A child that says it is ready on stderr, then sleeps; on SIGTERM it "drains" and exits 0.
DRAINS = """
import signal, sys, time
def stop(signum, frame):
    sys.stderr.write(f"draining after {signal.Signals(signum).name}\\n"); sys.stderr.flush(); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
sys.stderr.write("ready\\n"); sys.stderr.flush()
time.sleep(60)
"""
IGNORES_TERM = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stderr.write("ready\\n"); sys.stderr.flush()
time.sleep(60)
"""
FAILS = """
import sys
sys.stderr.write("loading weights\\n" + "x" * 20000 + "\\nTraceback: boom\\nValueError: bad model\\n")
sys.exit(7)
"""


async def start(code: str, sink: io.BytesIO | None = None) -> EngineProcess:
    return await EngineProcess.start(
        [sys.executable, "-c", code], engine_environment({}, {}), stderr_sink=sink or io.BytesIO()
    )


async def until_ready(engine: EngineProcess) -> None:
    for _ in range(200):
        if "ready" in engine.tail():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"child never got ready: {engine.tail()!r}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_forwarded_signal_reaches_child_and_its_exit_code_is_kept(signum: int) -> None:
    engine = await start(DRAINS)
    try:
        await until_ready(engine)
        engine.send_signal(signum)
        assert await asyncio.wait_for(engine.wait(), 10) == 0
        assert f"draining after {signal.Signals(signum).name}" in engine.tail()
    finally:
        await engine.aclose()


async def test_exit_code_and_last_words_of_a_failing_child() -> None:
    sink = io.BytesIO()
    engine = await start(FAILS, sink)
    try:
        assert await asyncio.wait_for(engine.wait(), 10) == 7
        tail = engine.tail()
        assert tail.endswith("Traceback: boom | ValueError: bad model")
        assert len(tail) < 1000
        # The tee passes everything through to the sink, not just the tail.
        assert b"loading weights" in sink.getvalue()
    finally:
        await engine.aclose()


async def test_stop_escalates_to_sigkill_after_grace() -> None:
    engine = await start(IGNORES_TERM)
    try:
        await until_ready(engine)
        code = await asyncio.wait_for(engine.stop(StopSettings(grace_s=0.5)), 10)
        assert code == 128 + signal.SIGKILL
    finally:
        await engine.aclose()


async def test_aclose_leaves_no_process_behind() -> None:
    engine = await start(IGNORES_TERM)
    await until_ready(engine)
    await engine.aclose()
    assert engine.returncode == -signal.SIGKILL
    engine.send_signal(signal.SIGTERM)  # a no-op once exited, no ProcessLookupError


def test_exit_status_follows_the_shell_convention() -> None:
    assert exit_status(0) == 0
    assert exit_status(3) == 3
    assert exit_status(-signal.SIGTERM) == 143
    assert exit_status(-signal.SIGKILL) == 137


def test_engine_environment_overlays_additions() -> None:
    env = engine_environment({"PATH": "/bin", "A": "1"}, {"A": "2", "TORCHINDUCTOR_CACHE_DIR": "/x"})
    assert env == {"PATH": "/bin", "A": "2", "TORCHINDUCTOR_CACHE_DIR": "/x", "PYTHONUNBUFFERED": "1"}


def test_stop_settings_bounds() -> None:
    with pytest.raises(ValueError):
        StopSettings(grace_s=0)
