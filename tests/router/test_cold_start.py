"""The pure part of holding through a cold start: what the InferenceDeployment says of it, the time
left, the comment a held stream gets, and the settings' bounds."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from kvfleet.pull_progress import PullReport, duration_text
from kvfleet.router.cold_start import (
    MAX_PROGRESS_CHARS,
    ColdStart,
    cold_start_of,
    comment,
    one_line,
    parse_duration_text,
    remaining_s,
    retry_after_s,
)
from kvfleet.router.kubernetes_source import served_deployment
from kvfleet.router.settings import RouterSettings

PULL = PullReport(140_000_000_000, 58_800_000_000, 58_800_000_000, 1.2e9, 68.0)


def status(message: str, measured: Any = None, progressing: str = "True") -> dict[str, Any]:
    doc: dict[str, Any] = {
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "NoReplicaReady", "message": "0/1 replicas ready"},
            {"type": "Progressing", "status": progressing, "reason": "ScalingUp", "message": message},
        ]
    }
    if measured is not None:
        doc["measuredColdStartSeconds"] = measured
    return {"status": doc}


@pytest.mark.parametrize("seconds", [0, 1, 45, 59, 60, 68, 185, 3599, 3600, 7620])
def test_duration_text_reads_back(seconds: int) -> None:
    assert parse_duration_text(duration_text(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "soon", "1m5s", "-3 s", "2h", "1m08"])
def test_other_durations_are_not_read(text: str) -> None:
    assert parse_duration_text(text) is None


def test_the_pull_progress_and_its_time_left_come_from_the_progressing_condition() -> None:
    obj = status(f"1/1 replicas updated; {PULL.summary()}", measured=90.5)
    cold = cold_start_of(obj, spec_estimate_s=60.0)
    assert cold == ColdStart(90.5, "pulling 42% (58/140 GB), 1.20 GB/s, 1m08s left", 68.0)
    # Several pods pulling: the operator names the slowest; the figure is still read.
    many = cold_start_of(status(f"x; {PULL.summary()} (the slowest of 3 pods pulling)"), None)
    assert many.progress_eta_s == 68.0 and many.estimate_s is None


def test_without_a_measured_figure_the_spec_estimate_counts_and_nothing_else_is_invented() -> None:
    assert cold_start_of(status("0/1 replicas updated"), 60.0) == ColdStart(60.0)
    assert cold_start_of({}, None) == ColdStart()
    # A pull no longer running (Progressing False) is not progress.
    assert cold_start_of(status(PULL.summary(), progressing="False"), 5.0).progress is None


@pytest.mark.parametrize("measured", ["90", True, -1, float("inf"), 1e12])
def test_a_malformed_measured_figure_counts_as_absent(measured: Any) -> None:
    assert cold_start_of(status("", measured=measured), 60.0).estimate_s == 60.0


def test_remaining_time_is_the_estimate_less_the_time_waking_and_never_under_a_pulls_own() -> None:
    assert remaining_s(ColdStart(60.0), 20.0) == 40.0
    assert remaining_s(ColdStart(60.0), 75.0) == 0.0
    assert remaining_s(ColdStart(60.0, "pulling", 68.0), 20.0) == 68.0
    assert remaining_s(ColdStart(None, "pulling", 68.0), 20.0) == 68.0
    assert remaining_s(ColdStart(), 5.0) is None
    assert [retry_after_s(x) for x in (0.0, 0.2, 1.0, 29.01)] == [1, 1, 1, 30]


def test_a_comment_is_one_bounded_line_of_legal_sse() -> None:
    pulling = ColdStart(90.0, PULL.summary(), 68.0)
    assert comment("llama", pulling, 12.7, 12.7) == (
        b": cold start: pulling 42% (58/140 GB), 1.20 GB/s, 1m08s left; held 12 s\n\n"
    )
    assert comment("llama", ColdStart(60.0), 3.2, 10.0) == b": cold start: waking llama, about 50 s left; held 3 s\n\n"
    assert comment("llama", ColdStart(), 0.0, 0.0) == b": cold start: waking llama; held 0 s\n\n"
    # Past the estimate, the comment says so rather than "0 s left".
    late = comment("llama", ColdStart(60.0), 70.4, 75.0)
    assert late == b": cold start: waking llama, longer than its 1m00s estimate; held 1m10s\n\n"
    # A model name is a client's string: it cannot end the comment and start an event.
    hostile = comment("x\n\ndata: {}\r", ColdStart(), 0.0, 0.0)
    assert hostile.count(b"\n") == 2 and hostile.endswith(b"\n\n") and b"\r" not in hostile
    assert len(one_line("é" * 1000)) == MAX_PROGRESS_CHARS


def test_the_kubernetes_source_reads_the_cold_start_with_the_deployment() -> None:
    obj = {
        "metadata": {"name": "llama", "namespace": "team"},
        "spec": {
            "model": {"uri": "s3://models/llama"},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "coldStartSeconds": 120},
            "routing": {"maxQueueWaitSeconds": 300},
        },
        **status(PULL.summary()),
    }
    served = served_deployment(("team", "llama"), obj)
    assert served is not None
    assert served.cold_start == ColdStart(120.0, PULL.summary(), 68.0)


@pytest.mark.parametrize(
    ("field", "value"), [("cold_start_comment_interval_s", 0.0), ("cold_start_comment_interval_s", 61)]
)
def test_the_comment_interval_is_bounded(field: str, value: float) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        RouterSettings(**{field: value})
