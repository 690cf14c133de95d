"""The shared token bucket (kvfleet/token_bucket.py): full at the start, refilled at ``rate``, never past
``burst``; the router's event rate (burst = rate) and the engine's replay rate (a larger burst) use it."""

from __future__ import annotations

from kvfleet.token_bucket import TokenBucket


def test_bursts_then_refills_at_the_rate_up_to_the_burst() -> None:
    now = [0.0]
    bucket = TokenBucket(10.0, 20.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(21)] == [True] * 20 + [False]
    now[0] += 0.25  # 2.5 tokens back
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    now[0] += 100.0  # idle for long: back to the burst, not more
    assert sum(bucket.take() for _ in range(30)) == 20
    same = TokenBucket(5.0, clock=lambda: now[0])  # burst defaults to the rate
    assert sum(same.take() for _ in range(10)) == 5
