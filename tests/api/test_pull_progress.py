"""The pull-progress report the launcher serves and the operator reads: hand-checkable text, and a
parser that refuses anything a tenant's pod could send outside the contract."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.pull_progress import MAX_TOTAL_BYTES, PullReport, duration_text, parse_report, rate_text

GB = 10**9
MB = 10**6


def report(done: int, total: int, rate: float | None = None, eta: float | None = None) -> PullReport:
    return PullReport(total_bytes=total, done_bytes=done, downloaded_bytes=done, rate_bytes_per_s=rate, eta_s=eta)


@pytest.mark.parametrize(
    ("done", "total", "text"),
    [
        (int(58.8 * GB), 140 * GB, "pulling 42% (58/140 GB)"),
        # Rounded down: 99.9% is not 100%, and 139.99 GB is not 140.
        (140 * GB - 1, 140 * GB, "pulling 99% (139/140 GB)"),
        (140 * GB, 140 * GB, "pulling 100% (140/140 GB)"),
        (0, 140 * GB, "pulling 0% (0/140 GB)"),
        # Under ten of the total's unit, one decimal.
        (1_250 * MB, 3_500 * MB, "pulling 35% (1.2/3.5 GB)"),
        (12 * MB, 64 * MB, "pulling 18% (12/64 MB)"),
        (500, 900, "pulling 55% (500/900 B)"),
        (0, 0, "pulling 100% (0/0 B)"),
    ],
)
def test_summary_without_rate(done: int, total: int, text: str) -> None:
    assert report(done, total).summary() == text


def test_summary_with_rate_and_time_left() -> None:
    r = report(int(58.8 * GB), 140 * GB, rate=1.2 * GB, eta=(140 - 58.8) * GB / (1.2 * GB))
    assert r.summary() == "pulling 42% (58/140 GB), 1.20 GB/s, 1m08s left"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.2, "1 s"), (45, "45 s"), (59.5, "1m00s"), (60, "1m00s"), (185, "3m05s"), (7620, "2h07m")],
)
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


@pytest.mark.parametrize(
    ("rate", "text"), [(1.2 * GB, "1.20 GB/s"), (850 * MB, "850.00 MB/s"), (999, "999 B/s"), (0, "0 B/s")]
)
def test_rate_text(rate: float, text: str) -> None:
    assert rate_text(rate) == text


def test_wire_form_round_trips() -> None:
    r = PullReport(
        total_bytes=140 * GB, done_bytes=58 * GB, downloaded_bytes=50 * GB, rate_bytes_per_s=1.5e9, eta_s=54.6
    )
    assert parse_report(r.to_doc()) == r
    unknown = PullReport(total_bytes=10, done_bytes=0, downloaded_bytes=0, rate_bytes_per_s=None, eta_s=None)
    assert parse_report(unknown.to_doc()) == unknown


GOOD: dict[str, Any] = {
    "totalBytes": 100,
    "doneBytes": 40,
    "downloadedBytes": 40,
    "bytesPerSecond": 5.0,
    "etaSeconds": 12,
}


@pytest.mark.parametrize(
    "change",
    [
        {"totalBytes": None},
        {"totalBytes": -1},
        {"totalBytes": MAX_TOTAL_BYTES + 1},
        {"totalBytes": 100.0},  # counts are integers
        {"totalBytes": True},
        {"doneBytes": 101},  # more done than there is
        {"doneBytes": "40"},
        {"downloadedBytes": -5},
        {"bytesPerSecond": float("nan")},
        {"bytesPerSecond": float("inf")},
        {"bytesPerSecond": -1.0},
        {"bytesPerSecond": 1e13},
        {"etaSeconds": 10**9},
        {"etaSeconds": "soon"},
    ],
)
def test_parser_refuses_what_the_contract_does_not_allow(change: dict[str, Any]) -> None:
    assert parse_report(GOOD) is not None
    assert parse_report({**GOOD, **change}) is None


@pytest.mark.parametrize("doc", [None, [], "pulling", 42])
def test_parser_refuses_non_objects(doc: Any) -> None:
    assert parse_report(doc) is None
