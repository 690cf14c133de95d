"""Phase timing with an injected clock: hand-checkable numbers."""

from __future__ import annotations

import json

import pytest

from kvfleet.engine_image.phases import PhaseRecord, PhaseRecorder


class StepClock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_phases_sum_to_the_total_and_report_details() -> None:
    seen: list[PhaseRecord] = []
    recorder = PhaseRecorder(StepClock(0, 2.5, 2.5, 3.0, 3.0, 7.0, 7.0, 7.25), on_record=seen.append)
    with recorder.phase("pull") as detail:
        detail["source"] = "s3"
    assert not recorder.complete
    with recorder.phase("artifacts") as detail:
        detail["hit"] = False
    with recorder.phase("engine_start"):
        pass
    with recorder.phase("first_ready"):
        pass
    assert recorder.complete
    assert [r.phase for r in seen] == ["pull", "artifacts", "engine_start", "first_ready"]
    assert [r.seconds for r in seen] == [2.5, 0.5, 4.0, 0.25]
    report = recorder.report()
    assert report["totalSeconds"] == 7.25
    assert report["phases"] == {"pull": 2.5, "artifacts": 0.5, "engine_start": 4.0, "first_ready": 0.25}
    assert report["phaseDetails"]["pull"] == {"source": "s3"}
    assert report["phaseDetails"]["artifacts"] == {"hit": False}


def test_incomplete_report_has_no_total() -> None:
    recorder = PhaseRecorder(StepClock(0, 1))
    with recorder.phase("pull"):
        pass
    assert recorder.report() == {
        "complete": False,
        "totalSeconds": None,
        "phases": {"pull": 1},
        "phaseDetails": {"pull": {}},
    }


def test_a_failed_phase_is_not_recorded() -> None:
    recorder = PhaseRecorder(StepClock(0, 1))
    with pytest.raises(RuntimeError), recorder.phase("pull"):
        raise RuntimeError("no weights")
    assert recorder.records == {}


def test_a_phase_is_recorded_once() -> None:
    recorder = PhaseRecorder(StepClock(0, 1, 2))
    with recorder.phase("pull"):
        pass
    with pytest.raises(ValueError), recorder.phase("pull"):
        pass


def test_log_line_is_one_json_object() -> None:
    line = PhaseRecord("engine_start", 1.23456, {"pid": 42}).log_line()
    assert "\n" not in line
    assert json.loads(line) == {"event": "coldstart_phase", "phase": "engine_start", "seconds": 1.2346, "pid": 42}
