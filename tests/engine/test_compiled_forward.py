"""torch.compile of the forward pass: same outputs as eager, shape buckets, and the compile cache
(hit on the second start, never loaded for another identity, rebuilt when damaged).

The tests marked ``compile`` run Inductor's C++ backend (a few seconds per graph on two cores), so
they share one tiny model and compile as few graphs as the check needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvfleet.engine.compile_cache import (
    COMPILE_MANIFEST,
    INDUCTOR_SUBDIR,
    START_REPORT,
    cache_files,
    check_cache,
    compile_identity,
)
from kvfleet.engine.compiled_forward import bucket_for
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.request import EngineRequest
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.settings import EngineSettings

from .conftest import make_core, run_to_completion

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts() -> dict[str, list[int]]:
    # Different lengths: decode steps of 1..4 sequences and prefill chunks longer than any bucket.
    return {f"r{i}": [(7 * i + j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(4)}


def test_bucket_is_the_smallest_size_that_holds_the_step() -> None:
    assert bucket_for(1, (1, 2, 4, 8)) == 1
    assert bucket_for(3, (8, 1, 4, 2)) == 4
    assert bucket_for(8, (1, 2, 4, 8)) == 8
    assert bucket_for(9, (1, 2, 4, 8)) is None


def test_compile_settings_are_bounded_and_auto_resolves_by_device() -> None:
    with pytest.raises(ValueError, match="compile_sizes_tokens"):
        EngineSettings(compile_sizes_tokens=())
    with pytest.raises(ValueError, match="compile_sizes_tokens"):
        EngineSettings(compile_sizes_tokens=(1, 1))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineSettings(compile_sizes_tokens=(1, 1024), max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="compile"):
        EngineSettings(compile="yes")  # type: ignore[arg-type]
    auto = EngineSettings()
    assert auto.compile_enabled("cuda")
    assert not auto.compile_enabled("cpu")  # measured not to pay on CPU
    assert not EngineSettings(compile="off").compile_enabled("cuda")
    assert EngineSettings(compile="on").compile_enabled("cpu")


def test_a_cache_for_another_identity_is_never_trusted(tmp_path: Path, tiny_model_dir: Path) -> None:
    ours = compile_identity(tiny_model_dir, torch.float32, CPU, mode="static", sizes_tokens=(1, 2))
    assert check_cache(tmp_path, ours).reason == "no compile cache yet"
    (tmp_path / INDUCTOR_SUBDIR).mkdir()
    assert "never finished" in check_cache(tmp_path, ours).reason
    (tmp_path / COMPILE_MANIFEST).write_text(json.dumps({"identity": {**ours, "torch": "2.0.0"}}))
    verdict = check_cache(tmp_path, ours)
    assert not verdict.hit and "torch '2.0.0' != " in verdict.reason
    (tmp_path / COMPILE_MANIFEST).write_text(json.dumps({"identity": {**ours, "sizesTokens": [1, 2, 4]}}))
    assert "sizesTokens" in check_cache(tmp_path, ours).reason
    (tmp_path / COMPILE_MANIFEST).write_text("{not json")
    assert "unreadable" in check_cache(tmp_path, ours).reason
    (tmp_path / COMPILE_MANIFEST).write_text(json.dumps({"identity": ours}))
    assert "lists no cache files" in check_cache(tmp_path, ours).reason
    (tmp_path / INDUCTOR_SUBDIR / "graph").write_bytes(b"compiled")
    files = cache_files(tmp_path)
    assert list(files) == [f"{INDUCTOR_SUBDIR}/graph"]
    (tmp_path / COMPILE_MANIFEST).write_text(json.dumps({"identity": ours, "files": files}))
    assert check_cache(tmp_path, ours).hit
    (tmp_path / INDUCTOR_SUBDIR / "graph").write_bytes(b"compiles")  # same size, other bytes
    assert "graph is damaged" in check_cache(tmp_path, ours).reason
    (tmp_path / INDUCTOR_SUBDIR / "graph").unlink()
    assert "graph is missing" in check_cache(tmp_path, ours).reason
    other_dtype = compile_identity(tiny_model_dir, torch.bfloat16, CPU, mode="static", sizes_tokens=(1, 2))
    assert "dtype" in check_cache(tmp_path, other_dtype).reason


def _compiled_core(model_dir: Path, artifacts: Path, **settings: object) -> EngineCore:
    return make_core(model_dir, compile="on", artifacts_dir=artifacts, torch_threads=1, **settings)


@pytest.mark.compile
@pytest.mark.slow
def test_static_buckets_match_eager_and_the_second_start_hits_the_cache(tmp_path: Path, tiny_model_dir: Path) -> None:
    eager = make_core(tiny_model_dir, compile="off")
    expected = run_to_completion(eager, prompts(), GREEDY)

    artifacts = tmp_path / "artifacts"
    first = _compiled_core(tiny_model_dir, artifacts, compile_mode="static", compile_sizes_tokens=(2, 4))
    assert run_to_completion(first, prompts(), GREEDY) == expected
    report = json.loads((artifacts / START_REPORT).read_text())
    assert report["cacheHit"] is False and report["compileSeconds"] > 0
    assert json.loads((artifacts / COMPILE_MANIFEST).read_text())["identity"]["sizesTokens"] == [2, 4]
    assert json.loads((artifacts / "artifacts.json").read_text())["compile"]["cacheHit"] is False

    # Padding: a one-token step runs in the size-2 graph and gives eager's logits.
    batch_logits = []
    for core in (eager, first):
        core.add_request(EngineRequest("p", [5], GREEDY, 0.0))
        chunks = core.scheduler.schedule().chunks
        batch, _ = core.runner.build_batch(chunks)
        batch_logits.append(core.runner.forward(batch))
    assert batch_logits[1].shape == batch_logits[0].shape == (1, core.model.config.vocab_size)
    torch.testing.assert_close(batch_logits[1], batch_logits[0], rtol=1e-4, atol=1e-4)

    second = _compiled_core(tiny_model_dir, artifacts, compile_mode="static", compile_sizes_tokens=(2, 4))
    report = json.loads((artifacts / START_REPORT).read_text())
    assert report["cacheHit"] is True, report
    assert run_to_completion(second, prompts(), GREEDY) == expected


@pytest.mark.compile
@pytest.mark.slow
def test_dynamic_graph_matches_eager_and_a_damaged_cache_is_never_loaded(tmp_path: Path, tiny_model_dir: Path) -> None:
    expected = run_to_completion(make_core(tiny_model_dir, compile="off"), prompts(), GREEDY)
    artifacts = tmp_path / "artifacts"
    first = _compiled_core(tiny_model_dir, artifacts, compile_mode="dynamic")
    assert run_to_completion(first, prompts(), GREEDY) == expected
    # Damage the compiled kernels but keep the manifest: the identity matches, the files do not.
    # Loading a damaged shared library would crash the process, so it must never be attempted.
    kernels = [p for p in (artifacts / INDUCTOR_SUBDIR).rglob("*.so") if p.is_file()]
    assert kernels
    for path in kernels:
        path.unlink()  # a new inode: this process still maps the old one, as a new process would not
        path.write_bytes(b"\0garbage")
    torch._dynamo.reset()  # a new process would start with no in-memory graphs either
    second = _compiled_core(tiny_model_dir, artifacts, compile_mode="dynamic")
    report = json.loads((artifacts / START_REPORT).read_text())
    assert report["cacheHit"] is False and "is damaged" in report["reason"], report
    assert run_to_completion(second, prompts(), GREEDY) == expected
