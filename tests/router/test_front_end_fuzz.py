"""The front end against a well-kept parser (h11) on generated requests, and a short coverage-guided
fuzz run (atheris) of its parser path. A longer run: ``scripts/fuzz-front-end``."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from support.front_end_harness import check_responses, generate_request, read_with_h11, read_with_router, serve_bytes

HERE = Path(__file__).parent
REQUESTS = 2000


def test_the_front_end_reads_every_request_as_h11_does_or_refuses_it() -> None:
    """Any request both accept must be read the same (method, target, headers, body); one h11 refuses
    must not be accepted (a smuggling shape). The router may be stricter than h11: it refuses obs-fold,
    bare LF, control bytes in values, unknown methods, CL with TE and repeated Content-Length; each
    such refusal must be a well-formed error answer."""
    rng = random.Random(20_240_601)
    outcomes: Counter[str] = Counter()
    for _ in range(REQUESTS):
        raw = generate_request(rng)
        theirs, ours = read_with_h11(raw), read_with_router(raw)
        if theirs.outcome == "ok" and ours.outcome == "ok":
            assert ours == theirs, raw
        elif ours.outcome == "ok" or (theirs.outcome == "ok" and ours.outcome == "incomplete"):
            raise AssertionError(f"read differently: h11 {theirs.outcome}, router {ours.outcome}: {raw!r}")
        elif ours.outcome == "error":
            answer = serve_bytes([raw]).output
            status = check_responses(answer)[0]
            assert 400 <= status < 600
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        outcomes[f"{theirs.outcome}/{ours.outcome}"] += 1
    assert outcomes["ok/ok"] > REQUESTS // 5, outcomes  # the generator reaches the accepting paths


def test_trailer_fields_are_not_merged_into_the_headers() -> None:
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\nAuthorization: Bearer stolen\r\n\r\n"
    )
    request = serve_bytes([raw]).requests[0]
    assert request.body == b"{}"
    assert [name.lower() for name, _ in request.raw_headers] == [b"host", b"transfer-encoding"]


def test_a_short_coverage_guided_fuzz_run_finds_nothing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(HERE / "fuzz_corpus", corpus)
    run = subprocess.run(
        [sys.executable, str(HERE / "fuzz_front_end.py"), "-runs=1500", "-max_len=4096", "-seed=1", str(corpus)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Done 1500 runs" in run.stderr
