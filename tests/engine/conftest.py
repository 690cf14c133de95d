"""Engine fixtures: a tiny random-weight model built once per session, real `kvfleet engine serve`
processes on free loopback ports (always stopped), an in-process EngineCore, and an unpaged
oracle: transformers' LlamaForCausalLM run on the whole sequence at every step."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvfleet.engine.engine_core import EngineCore, load_engine_core
from kvfleet.engine.request import EngineRequest, RequestOutput
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.settings import EngineSettings
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.free_port import pick_free_port
from kvfleet.local.models import EngineLaunch
from kvfleet_testkit.processes import stop_process

SERVED = "tiny"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", layers=2, hidden=64, vocab=1024)


@dataclass
class EngineProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def run_engine(model_dir: Path, log_dir: Path, *args: str) -> Iterator[EngineProcess]:
    """Start a real engine server and stop it (SIGTERM, then SIGKILL) however the test ends."""
    port = pick_free_port()
    log_path = log_dir / f"engine-{port}.log"
    cmd = EngineLaunch("test", SERVED, model_dir, ("--threads", "1", *args), {}).argv(port)
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    engine = EngineProcess(proc, port, log_path)
    try:
        deadline = time.monotonic() + 90
        while not _healthy(engine.url):
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}:\n{engine.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine not healthy after 90 s:\n{engine.log()}")
            time.sleep(0.1)
        yield engine
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def engine_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with run_engine(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--kv-blocks", "256") as engine:
        yield engine


def make_core(model_dir: Path, **settings: object) -> EngineCore:
    defaults: dict[str, object] = {
        "device": "cpu",
        "num_kv_blocks": 256,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
    }
    return load_engine_core(model_dir, EngineSettings(**{**defaults, **settings}), SERVED)  # type: ignore[arg-type]


def run_to_completion(
    core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams, max_steps: int = 10_000
) -> dict[str, list[int]]:
    """Submit every prompt at once, step until all finish, return each request's output token ids."""
    for request_id, prompt in prompts.items():
        core.add_request(EngineRequest(request_id, prompt, params, time.monotonic()))
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    finished: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == set(prompts), "every request must finish"
    return outputs


@pytest.fixture(scope="session")
def oracle(tiny_model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy tokens from transformers' LlamaForCausalLM, recomputing the whole sequence each step
    (no KV cache at all): the plain, unpaged single-sequence reference."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
        return ids[len(prompt) :]

    return greedy
