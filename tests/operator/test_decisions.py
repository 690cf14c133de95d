"""Pure decisions: replica count, drift, status conditions and their transitions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from kvfleet.operator.coldstart import parse_coldstart, ready_pods
from kvfleet.operator.conditions import DeploymentObservation, Observed, plan_status
from kvfleet.operator.drift import first_difference, parse_quantity
from kvfleet.operator.pod_health import PodDiagnosis
from kvfleet.operator.pull_progress import PullsSeen
from kvfleet.operator.replicas import decide_replicas
from kvfleet.operator.settings import OperatorSettings
from kvfleet.pull_progress import PullReport
from kvfleet.spec import InferenceDeploymentSpec

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
T1 = datetime(2025, 1, 1, 12, 5, 0, tzinfo=UTC)


def spec(**fields: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"uri": "s3://model-cache/m"}, **fields})


@pytest.mark.parametrize(
    ("fields", "status_desired", "replicas", "reason_part"),
    [
        ({}, None, 1, "default of 1"),
        ({"replicas": 3}, 7, 3, "spec.replicas"),
        ({"replicas": 0}, None, 0, "spec.replicas"),
        ({"autoscaling": {"minReplicas": 0, "maxReplicas": 4}}, None, 0, "no autoscaler decision"),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 4}}, None, 2, "minReplicas (2)"),
        ({"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}, 3, 3, "autoscaler decision"),
        ({"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}, 9, 4, "above maxReplicas"),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 4}}, 0, 2, "below minReplicas"),
        ({"autoscaling": {"enabled": False}, "replicas": 2}, 4, 2, "autoscaling is off"),
    ],
)
def test_replica_decision(fields: dict[str, Any], status_desired: int | None, replicas: int, reason_part: str) -> None:
    s = spec(**fields)
    decision = decide_replicas(s, status_desired)
    assert decision.replicas == replicas
    assert reason_part in decision.reason


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", 1),
        ("0.5", 0.5),
        ("500m", 0.5),
        ("1Gi", 2**30),
        ("1024Mi", 2**30),
        ("2k", 2000),
        ("1e3", 1000),
        ("x", None),
    ],
)
def test_parse_quantity(text: str, value: float | None) -> None:
    parsed = parse_quantity(text)
    assert (None if parsed is None else float(parsed)) == value


@pytest.mark.parametrize(
    ("desired", "live", "difference"),
    [
        ({"a": 1}, {"a": 1, "added": "by the server"}, None),
        ({"a": 1}, {"a": 2}, "a"),
        ({"a": {"b": [1, 2]}}, {"a": {"b": [1]}}, "a.b"),
        ({"a": {}}, {}, None),  # the server drops empty maps
        ({"x": [{"name": "n"}]}, {"x": [{"name": "n", "default": 1}]}, None),
        (
            {"resources": {"limits": {"cpu": "0.5", "memory": "1024Mi"}}},
            {"resources": {"limits": {"cpu": "500m", "memory": "1Gi"}}},
            None,
        ),
        ({"resources": {"limits": {"cpu": "1"}}}, {"resources": {"limits": {"cpu": "2"}}}, "resources.limits.cpu"),
        ({"emptyDir": {"sizeLimit": "1Gi"}}, {"emptyDir": {"sizeLimit": "1024Mi"}}, None),
        ({"value": "1"}, {"value": "1.0"}, "value"),  # quantities only where Kubernetes has them
        ({"flag": True}, {"flag": 1}, "flag"),
        ({"n": 1}, {"n": 1.0}, None),
        ({"a": 1}, None, "."),
    ],
)
def test_first_difference(desired: Any, live: Any, difference: str | None) -> None:
    assert first_difference(desired, live) == difference


def dep(**status: int) -> DeploymentObservation:
    values = {
        "spec_replicas": 2,
        "generation": 1,
        "observed_generation": 1,
        "replicas": 0,
        "ready_replicas": 0,
        "updated_replicas": 0,
        "available_replicas": 0,
        "deadline_exceeded": None,
        "replica_failure": None,
    }
    values.update(status)
    return DeploymentObservation(**values)  # type: ignore[arg-type]


def observed(deployment: DeploymentObservation | None, desired: int | None = 2, **kw: Any) -> Observed:
    values: dict[str, Any] = {
        "generation": 3,
        "desired_replicas": desired,
        "replica_reason": "why",
        "autoscaling": False,
        "deployment": deployment,
        "invalid_spec": None,
        "apply_error": None,
        "endpoint": "http://router/v1",
        "selector": "a=b",
        "measured_cold_start_s": None,
    }
    values.update(kw)
    return Observed(**values)


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


@pytest.mark.parametrize(
    ("obs", "expected"),
    [
        (
            observed(None),
            {
                "Ready": ("False", "Creating"),
                "Progressing": ("True", "Creating"),
                "Degraded": ("False", "AsExpected"),
                "ScaledToZero": ("False", "Creating"),
            },
        ),
        (
            observed(dep(replicas=2, updated_replicas=2)),
            {"Ready": ("False", "NoReplicaReady"), "Progressing": ("True", "ScalingUp")},
        ),
        (
            observed(dep(replicas=2, updated_replicas=2, ready_replicas=2)),
            {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete")},
        ),
        (observed(dep(replicas=3, updated_replicas=1, ready_replicas=2)), {"Progressing": ("True", "RollingOut")}),
        (
            observed(dep(generation=2, observed_generation=1, replicas=2, updated_replicas=2, ready_replicas=2)),
            {"Progressing": ("True", "RollingOut")},
        ),
        (
            observed(dep(spec_replicas=0), desired=0),
            {
                "Ready": ("True", "ScaledToZero"),
                "ScaledToZero": ("True", "ScaledToZero"),
                "Progressing": ("False", "Idle"),
            },
        ),
        (
            observed(dep(spec_replicas=0, replicas=1, ready_replicas=1), desired=0),
            {"ScaledToZero": ("False", "ScalingDown"), "Progressing": ("True", "ScalingDown")},
        ),
        (
            observed(dep(deadline_exceeded="ReplicaSet x has timed out progressing.")),
            {"Degraded": ("True", "ProgressDeadlineExceeded")},
        ),
        (observed(dep(replica_failure="exceeded quota: gpus")), {"Degraded": ("True", "ReplicaFailure")}),
        (observed(dep(), apply_error="Deployment m-engine: denied"), {"Degraded": ("True", "ApplyFailed")}),
        (
            observed(None, desired=None, invalid_spec="spec.x: bad"),
            {
                "Degraded": ("True", "InvalidSpec"),
                "Ready": ("False", "InvalidSpec"),
                "Progressing": ("False", "InvalidSpec"),
            },
        ),
        (
            observed(dep(replicas=2, updated_replicas=2, ready_replicas=2), desired=None, invalid_spec="spec.x: bad"),
            {
                "Degraded": ("True", "InvalidSpec"),
                "Ready": ("True", "ReplicasReady"),
                "Progressing": ("False", "InvalidSpec"),
            },
        ),
    ],
    ids=[
        "creating",
        "starting",
        "ready",
        "rolling",
        "new-template",
        "zero",
        "scaling-to-zero",
        "deadline",
        "quota",
        "apply-failed",
        "invalid-no-children",
        "invalid-keeps-serving",
    ],
)
def test_conditions(obs: Observed, expected: dict[str, tuple[str, str]]) -> None:
    got = conds(plan_status(obs, None, T0).status)
    assert {k: got[k] for k in expected} == expected
    assert list(got) == ["Ready", "Progressing", "Degraded", "ScaledToZero"]


def test_status_fields() -> None:
    digest = "0f" * 32
    obs = observed(dep(replicas=2, ready_replicas=1), measured_cold_start_s=41.23456, model_digest=digest)
    status = plan_status(obs, None, T0).status
    assert status["modelDigest"] == digest
    assert status["observedGeneration"] == 3
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (2, 1, 2)
    assert status["endpoint"] == "http://router/v1" and status["selector"] == "a=b"
    assert status["measuredColdStartSeconds"] == 41.235
    assert all(
        c["observedGeneration"] == 3 and c["lastTransitionTime"] == "2025-01-01T12:00:00Z" for c in status["conditions"]
    )
    autoscaled = plan_status(observed(dep(), autoscaling=True), None, T0).status
    assert "desiredReplicas" not in autoscaled  # the autoscaler's key
    assert "modelDigest" not in autoscaled  # no launcher reported one


def test_transitions_become_events_once() -> None:
    starting = plan_status(observed(dep(replicas=2, updated_replicas=2)), None, T0)
    # First sight: Ready=False and Progressing=True are news, told by one Normal Event (Ready's);
    # "not degraded" and "not zero" are not news.
    assert [(t.condition.type, t.condition.reason) for t in starting.transitions] == [("Ready", "NoReplicaReady")]
    ready = plan_status(observed(dep(replicas=2, updated_replicas=2, ready_replicas=2)), starting.status, T1)
    # Ready and Progressing=Complete come together: one Event says it.
    assert [(t.condition.reason, t.event_type) for t in ready.transitions] == [("ReplicasReady", "Normal")]
    again = plan_status(observed(dep(replicas=2, updated_replicas=2, ready_replicas=2)), ready.status, T1)
    assert again.transitions == () and again.status == ready.status
    # lastTransitionTime moves only for conditions whose status flipped.
    times = {c["type"]: c["lastTransitionTime"] for c in ready.status["conditions"]}
    assert times["Ready"] == "2025-01-01T12:05:00Z" and times["Degraded"] == "2025-01-01T12:00:00Z"


def test_a_bring_up_step_within_one_status_posts_no_event() -> None:
    """Creating to NoReplicaReady (Ready stays False), RollingOut to ScalingUp (Progressing stays
    True): status carries the step; an Event per step was a write per deployment at scale."""
    creating = plan_status(observed(None), None, T0)
    assert [t.condition.reason for t in creating.transitions] == ["Creating"]
    starting = plan_status(observed(dep(replicas=2, updated_replicas=2)), creating.status, T1)
    assert starting.transitions == ()
    conditions = {c["type"]: c for c in starting.status["conditions"]}
    assert conditions["Ready"]["reason"] == "NoReplicaReady" and conditions["Progressing"]["reason"] == "ScalingUp"


def test_a_new_degraded_reason_is_a_warning_each_time() -> None:
    """A Warning is never folded into another transition's Event, and Degraded speaks on a new reason."""
    pulling = plan_status(observed(dep(replicas=1), pods=PodDiagnosis("ImagePullBackOff", "image x")), None, T0)
    assert ("Degraded", "ImagePullBackOff", "Warning") in [
        (t.condition.type, t.condition.reason, t.event_type) for t in pulling.transitions
    ]
    crash = PodDiagnosis("CrashLoopBackOff", "exit 1")
    crashing = plan_status(observed(dep(replicas=1), pods=crash), pulling.status, T1)
    assert [(t.condition.reason, t.event_type) for t in crashing.transitions] == [("CrashLoopBackOff", "Warning")]


def test_invalid_spec_is_one_warning_event() -> None:
    plan = plan_status(observed(None, desired=None, invalid_spec="spec.x: bad"), None, T0)
    assert [(t.condition.type, t.condition.reason, t.event_type) for t in plan.transitions] == [
        ("Degraded", "InvalidSpec", "Warning")
    ]


def test_settings_are_bounded() -> None:
    with pytest.raises(ValueError, match="startup_budget_min_s"):
        OperatorSettings(startup_budget_min_s=500, startup_budget_max_s=100)
    with pytest.raises(ValueError, match="differ"):
        OperatorSettings(engine_port=9400)
    with pytest.raises(ValueError):
        OperatorSettings(resync_interval_s=0)


@pytest.mark.parametrize(
    ("doc", "seconds"),
    [
        ({"totalSeconds": 12.5}, 12.5),
        ({"totalSeconds": 3}, 3.0),
        ({"totalSeconds": -1}, None),
        ({"totalSeconds": "9"}, None),
        ({"totalSeconds": True}, None),
        ({"total": 1}, None),
        ([1], None),
        ({"totalSeconds": float("nan")}, None),
    ],
)
def test_parse_coldstart(doc: Any, seconds: float | None) -> None:
    assert parse_coldstart(doc) == seconds


def test_ready_pods_newest_first_and_skips_the_unready() -> None:
    def pod(uid: str, ready: str, since: str, ip: str | None = "10.0.0.1", deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"uid": uid}
        if deleting:
            meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        return {
            "metadata": meta,
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": since}]},
        }

    pods = [
        pod("a", "True", "2025-01-01T10:00:00Z"),
        pod("b", "True", "2025-01-01T11:00:00Z"),
        pod("c", "False", "2025-01-01T12:00:00Z"),
        pod("d", "True", "2025-01-01T12:00:00Z", ip=None),
        pod("e", "True", "2025-01-01T13:00:00Z", deleting=True),
    ]
    assert [p.uid for p in ready_pods(pods)] == ["b", "a"]


def test_progressing_says_how_far_the_pull_is_without_a_new_reason() -> None:
    pull = PullReport(
        total_bytes=140 * 10**9, done_bytes=58 * 10**9, downloaded_bytes=58 * 10**9, rate_bytes_per_s=None, eta_s=None
    )
    starting = dep(spec_replicas=1, replicas=1, updated_replicas=1)
    plan = plan_status(observed(starting, desired=1, pulls=PullsSeen(pulling=1, slowest=pull)), None, T0)
    progressing = next(c for c in plan.status["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "ScalingUp")
    assert progressing["message"] == "0/1 replicas ready; pulling 41% (58/140 GB)"
    # The bytes move, the reason stays: no Event per tick of a pull.
    later = PullReport(140 * 10**9, 100 * 10**9, 100 * 10**9, None, None)
    again = plan_status(observed(starting, desired=1, pulls=PullsSeen(1, later)), plan.status, T1)
    assert "pulling 71% (100/140 GB)" in str(again.status["conditions"])
    assert again.transitions == ()
    # Ready and current: a stale report says nothing.
    done = dep(spec_replicas=1, replicas=1, updated_replicas=1, ready_replicas=1)
    settled = plan_status(observed(done, desired=1, pulls=PullsSeen(1, later)), None, T0)
    assert "pulling" not in str(settled.status["conditions"])


def test_the_older_claim_keeps_a_served_name_and_the_newer_is_never_ready() -> None:
    from kvfleet.operator.claims import Claim, claim_of, conflict_message, holder

    older, newer = Claim("zzz", "tiny", 1_767_225_600), Claim("aaa", "tiny", 1_767_225_601)
    assert holder("tiny", newer, [older, newer]) == older  # "aaa" sorts first but is a second younger
    assert holder("tiny", older, [older, newer]) is None
    assert holder("tiny", older, []) is None
    assert holder("tiny", Claim("b", "x", 5), [Claim("a", "y", 5)]) == Claim("a", "y", 5)  # same second: namespace
    assert holder("tiny", Claim("a", "x", None), [Claim("b", "y", 9)]) == Claim("b", "y", 9)  # undated sorts last
    message = conflict_message("tiny", older)
    assert message == 'served name "tiny" is already served by zzz/tiny since 2026-01-01T00:00:00Z'
    body = {"metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"model": {"uri": "s3://models/tiny"}}}
    assert claim_of("zzz", "tiny", body) == ("tiny", older)  # no servedName: the object's name
    assert claim_of("zzz", "bad", {"spec": {"model": {"uri": "ftp://x"}}}) is None  # an invalid spec serves nothing
    # Ready replicas or not, a deployment that does not hold its name is not Ready, and Degraded says why.
    for deployment in (None, dep(replicas=2, ready_replicas=2, updated_replicas=2, available_replicas=2)):
        plan = plan_status(observed(deployment, desired=None, name_conflict=message), None, T0)
        got = conds(plan.status)
        assert got["Ready"] == ("False", "ServedNameConflict") and got["Degraded"] == ("True", "ServedNameConflict")
        assert [(t.event_type, t.condition.type, t.condition.message) for t in plan.transitions] == [
            ("Warning", "Degraded", message)
        ]


# The engine Deployment's status through a rolling update of 3 replicas (maxSurge 1, maxUnavailable
# 0), one entry per status write of the Deployment controller: (generation, observedGeneration,
# replicas, readyReplicas, updatedReplicas). Each replica replaced takes three pod steps.
ROLLOUT = [
    (2, 1, 3, 3, 3),
    (2, 2, 4, 3, 1),
    (2, 2, 4, 4, 1),
    (2, 2, 3, 3, 1),
    (2, 2, 4, 3, 2),
    (2, 2, 4, 4, 2),
    (2, 2, 3, 3, 2),
    (2, 2, 4, 3, 3),
    (2, 2, 4, 4, 3),
    (2, 2, 3, 3, 3),
]


def test_a_rolling_update_writes_status_once_per_replica_replaced() -> None:
    """Status moves when a replica runs the new template, not on each pod step (the surge pod made,
    ready, an old one gone): 5 writes for a rollout of 3 replicas where 10 mirrored every step, and
    never more ready replicas than desired (the surge pod is the engine Deployment's to count)."""
    live = plan_status(observed(dep(spec_replicas=3, replicas=3, ready_replicas=3, updated_replicas=3), 3), None, T0)
    written: list[tuple[int, int, str]] = []
    for generation, seen, replicas, ready, updated in ROLLOUT:
        engine = dep(
            spec_replicas=3,
            generation=generation,
            observed_generation=seen,
            replicas=replicas,
            ready_replicas=ready,
            updated_replicas=updated,
            available_replicas=ready,
        )
        plan = plan_status(observed(engine, 3), live.status, T0)
        if first_difference(plan.status, live.status) is not None:
            progressing = next(c for c in plan.status["conditions"] if c["type"] == "Progressing")
            written.append((plan.status["replicas"], plan.status["readyReplicas"], progressing["message"]))
            live = plan
    assert [message for _, _, message in written] == [
        "the Deployment controller has not seen the latest template yet",
        "1/3 replicas run the current template",
        "2/3 replicas run the current template",
        "3/3 replicas run the current template",
        "3/3 replicas ready and current",
    ]
    assert {(replicas, ready) for replicas, ready, _ in written} == {(3, 3)}
