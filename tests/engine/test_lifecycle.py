"""Process lifecycle against real engine processes: queue bound (429), SIGTERM drain, bad model folders."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.local.models import EngineLaunch

from .conftest import SERVED, run_engine

# Long enough (seconds on 2 cores) that a request is surely still running while the test acts.
LONG = {"prompt": "tell me everything", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def slower_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("models") / "slower", layers=4, hidden=256, vocab=1024, max_position_embeddings=4096
    )


async def wait_for_metrics(s: aiohttp.ClientSession, url: str, want: dict[str, float], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:")
        }
        if all(values.get(k) == v for k, v in want.items()):
            return
        assert time.monotonic() < deadline, f"metrics never reached {want}: {values}"
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_waiting_queue_bound_answers_429(slower_model_dir: Path, tmp_path: Path) -> None:
    with run_engine(slower_model_dir, tmp_path, "--max-num-seqs", "1", "--max-waiting", "1") as engine:
        async with aiohttp.ClientSession() as s:

            async def complete(body: dict[str, object]) -> tuple[int, str | None, dict[str, object]]:
                async with s.post(f"{engine.url}/v1/completions", json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            first = asyncio.ensure_future(complete(LONG))
            second = asyncio.ensure_future(complete({**LONG, "max_tokens": 5}))
            await wait_for_metrics(s, engine.url, {"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 1})
            status, retry_after, body = await complete(LONG)
            assert status == 429, body
            assert retry_after is not None and int(retry_after) >= 1
            assert "queue" in str(body["error"])
            first.cancel()  # no need to wait for 3000 tokens: the disconnect aborts it and frees the slot
            await asyncio.gather(first, return_exceptions=True)
            second_result = await second
    assert second_result[0] == 200, "the queued request was not disturbed"


@pytest.mark.slow
async def test_sigterm_drains_in_flight_then_exits_zero(slower_model_dir: Path, tmp_path: Path) -> None:
    body = {**LONG, "max_tokens": 600, "stream": True, "stream_options": {"include_usage": True}}
    with run_engine(slower_model_dir, tmp_path) as engine:
        async with aiohttp.ClientSession() as s, s.post(f"{engine.url}/v1/completions", json=body) as stream:
            assert stream.status == 200
            await stream.content.readline()  # generating
            engine.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while True:  # the signal is handled asynchronously
                async with s.get(f"{engine.url}/health") as r:
                    if r.status == 503:
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            async with s.post(f"{engine.url}/v1/completions", json=LONG) as r:
                assert r.status == 503
                assert r.headers.get("Retry-After")
                assert "shutting down" in (await r.json())["error"]["message"]
            rest = (await stream.read()).decode()
        events = [e for e in rest.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: ") :])["usage"]["completion_tokens"] == 600
        assert engine.proc.wait(timeout=30) == 0, engine.log()


@pytest.mark.slow
def test_pickled_checkpoint_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "pickled"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tiny_model_dir / name).read_bytes())
    (model / "pytorch_model.bin").write_bytes(b"not unpickled")
    result = subprocess.run(
        EngineLaunch("test", SERVED, model, (), {}).argv(0),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "pytorch_model.bin" in result.stderr and "safetensors" in result.stderr
