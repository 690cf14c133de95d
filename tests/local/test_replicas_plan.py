"""The pure scale plan: what to start and what to drain, by hand-checkable cases."""

from __future__ import annotations

import pytest

from kvfleet.local.replicas import ReplicaView, plan_scale, restart_backoff_s


def r(replica_id: str, state: str = "ready", inflight: int = 0, started: float = 0.0) -> ReplicaView:
    return ReplicaView(replica_id, state, inflight, started)  # type: ignore[arg-type]


def test_starting_replicas_count_toward_the_target() -> None:
    plan = plan_scale([r("a", "starting"), r("b")], desired=3, max_replicas=4)
    assert plan.start == 1 and plan.drain == ()
    assert "2 live replica(s), 3 wanted" in plan.reason


def test_draining_replicas_do_not_count() -> None:
    plan = plan_scale([r("a", "draining"), r("b")], desired=2, max_replicas=4)
    assert plan.start == 1


def test_scale_down_drains_starting_first_then_least_loaded_newest() -> None:
    replicas = [
        r("old-busy", inflight=5, started=1.0),
        r("old-idle", inflight=0, started=2.0),
        r("new-idle", inflight=0, started=3.0),
        r("booting", "starting", started=4.0),
    ]
    assert plan_scale(replicas, desired=3, max_replicas=4).drain == ("booting",)
    assert plan_scale(replicas, desired=2, max_replicas=4).drain == ("booting", "new-idle")
    assert plan_scale(replicas, desired=0, max_replicas=4).drain == ("booting", "new-idle", "old-idle", "old-busy")


def test_desired_is_capped_and_noop_says_so() -> None:
    plan = plan_scale([r("a"), r("b")], desired=9, max_replicas=2)
    assert plan.is_noop and "capped from 9" in plan.reason
    with pytest.raises(ValueError, match="desired replicas must be >= 0"):
        plan_scale([], desired=-1, max_replicas=2)


def test_backoff_doubles_and_is_bounded() -> None:
    assert [restart_backoff_s(n, 0.5, 3.0) for n in range(5)] == [0.0, 0.5, 1.0, 2.0, 3.0]
    assert restart_backoff_s(10_000, 0.5, 3.0) == 3.0
