"""Why engine pods do not serve, read from pod status (pure; pods as the API server returns them)."""

from __future__ import annotations

from typing import Any

from kvfleet.operator.conditions import Observed, plan_status
from kvfleet.operator.pod_health import diagnose_pods


def pod(name: str, *, waiting: str | None = None, last: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": extra.pop("conditions", [])}
    cs: dict[str, Any] = {"name": "engine", "state": {"running": {}}}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting, "message": extra.pop("message", f"{waiting} happened")}}
    if last:
        cs["lastState"] = {"terminated": last}
    status["containerStatuses"] = [cs]
    return {"metadata": {"name": name, **extra.pop("meta", {})}, "status": status}


def test_healthy_pods_have_no_diagnosis() -> None:
    assert diagnose_pods([pod("a"), pod("b")]) is None
    assert diagnose_pods([]) is None


def test_crash_loop_carries_the_launchers_termination_message() -> None:
    crashing = pod(
        "m-engine-1",
        waiting="CrashLoopBackOff",
        last={"exitCode": 3, "reason": "Error", "message": "kvfleet launcher failed in phase pull: checksum mismatch"},
    )
    found = diagnose_pods([pod("m-engine-0"), crashing])
    assert found is not None
    assert found.reason == "CrashLoopBackOff"
    assert found.message == (
        "1/2 pods CrashLoopBackOff; m-engine-1: container engine: exit code 3: "
        "kvfleet launcher failed in phase pull: checksum mismatch"
    )


def test_oom_kill_outranks_an_image_pull_and_counts_its_pods() -> None:
    oom = {"exitCode": 137, "reason": "OOMKilled"}
    pods = [
        pod("a", waiting="ImagePullBackOff", message="Back-off pulling image ghcr.io/x:1"),
        pod("b", waiting="CrashLoopBackOff", last=oom),
        pod("c", waiting="CrashLoopBackOff", last=oom),
    ]
    found = diagnose_pods(pods)
    assert found is not None and found.reason == "OOMKilled"
    assert found.message.startswith("2/3 pods OOMKilled; b: container engine was killed out of memory")


def test_unschedulable_uses_the_schedulers_words_and_terminating_pods_are_ignored() -> None:
    cond = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    }
    gone = pod("old", waiting="ImagePullBackOff", meta={"deletionTimestamp": "2026-01-01T00:00:00Z"})
    found = diagnose_pods([pod("new", conditions=[cond]), gone])
    assert found is not None
    assert (found.reason, found.message) == (
        "Unschedulable",
        "1/1 pods Unschedulable; new: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    )


def test_long_messages_are_cut() -> None:
    found = diagnose_pods([pod("a", waiting="ErrImagePull", message="x" * 5000)])
    assert found is not None and len(found.message) == 512 and found.message.endswith("...")


def test_a_pod_problem_is_the_degraded_reason() -> None:
    from datetime import UTC, datetime

    from kvfleet.operator.conditions import DeploymentObservation

    dep = DeploymentObservation(1, 1, 1, 1, 0, 1, 0, None, None)
    crash = diagnose_pods([pod("a", waiting="CrashLoopBackOff", last={"exitCode": 3, "message": "no manifest"})])
    obs = Observed(1, 1, "fixed", False, dep, None, None, "http://r/v1", "s", None, pods=crash)
    plan = plan_status(obs, {}, datetime(2026, 1, 1, tzinfo=UTC))
    degraded = next(c for c in plan.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoopBackOff")
    assert "no manifest" in degraded["message"]
