"""The Kubernetes actuator, the deployment listing and Lease election against KMock."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from support.watch_api import WatchApi

from kvfleet.autoscaler.actuators import ActuatorError, KubernetesActuator, ScaleCommand, TargetGone
from kvfleet.autoscaler.controller import Controller
from kvfleet.autoscaler.deployments import KubernetesDeployments, Scaled
from kvfleet.autoscaler.leader import LeaseElector, lease_verdict
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.settings import LeaseSettings
from kvfleet.autoscaler.sources import Target
from kvfleet.kube.client import KubeClient
from kvfleet.spec import AutoscalingSpec
from tests.autoscaler.conftest import Kube
from tests.autoscaler.doubles import InProcessActuator, StaticDeployments
from tests.conftest import pick_free_port

SPEC = {
    "model": {"uri": "s3://models/tiny", "servedName": "tiny-chat"},
    "engine": {"kind": "reference"},
    "resources": {"gpus": 0},
    "autoscaling": {"minReplicas": 1, "maxReplicas": 5},
}


async def test_actuator_patches_status_only(kube: Kube) -> None:
    kube.add_deployment("chat", SPEC, status={"replicas": 1, "readyReplicas": 1})
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    async with kube.api() as api:
        actuator = KubernetesActuator(api)
        await actuator.apply(Target("default", "chat", "tiny-chat"), ScaleCommand(3, "scale_up: load 40", at))
    obj = kube.deployment("chat")
    assert obj["status"]["desiredReplicas"] == 3
    assert obj["status"]["scaleReason"] == "scale_up: load 40"
    assert obj["status"]["lastScaleTime"] == "2026-01-02T03:04:05Z"
    assert obj["status"]["readyReplicas"] == 1  # the operator's fields are left alone
    assert obj["spec"] == SPEC  # never spec
    requests = [r for r in kube.emulator if r.method == "PATCH"]
    assert [str(r.url.path) for r in requests] == [
        "/apis/kvfleet.io/v1alpha1/namespaces/default/inferencedeployments/chat/status"
    ]
    assert requests[0].headers["Content-Type"] == "application/merge-patch+json"
    assert requests[0].params["fieldManager"] == "kvfleet-autoscaler"


async def test_actuator_errors(kube: Kube) -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    async with kube.api() as api:
        with pytest.raises(TargetGone, match="default/gone no longer exists"):
            await KubernetesActuator(api).apply(Target("default", "gone", "x"), ScaleCommand(1, "r", at))
    dead = KubeClient.for_server(f"http://127.0.0.1:{pick_free_port()}", timeout_s=2)
    async with dead:
        with pytest.raises(ActuatorError, match="Cannot connect to host"):
            await KubernetesActuator(dead).apply(Target("default", "chat", "x"), ScaleCommand(1, "r", at))


async def test_lists_autoscaled_deployments_and_skips_invalid_ones(kube: Kube) -> None:
    kube.add_deployment(
        "chat",
        SPEC,
        status={"replicas": 2, "readyReplicas": 1, "desiredReplicas": 3, "measuredColdStartSeconds": 42.0},
    )
    kube.add_deployment("fixed", {**SPEC, "autoscaling": None, "replicas": 2})
    kube.add_deployment("broken", {**SPEC, "autoscaling": {"minReplicas": 9, "maxReplicas": 2}})
    async with kube.api() as api:
        watched = KubernetesDeployments(api)
        await watched.watch.sync()
        items = await watched.list()
    assert [(s.target.key, s.target.served_name, s.target.ready_replicas, s.current_replicas) for s in items] == [
        ("default/chat", "tiny-chat", 1, 3)
    ]
    assert items[0].target.measured_cold_start_s == 42.0
    assert items[0].spec.max_replicas == 5


class Clock:
    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


async def test_lease_election_never_two_leaders(kube: Kube) -> None:
    clock = Clock(1_800_000_000.0)
    async with kube.api() as api:
        a = LeaseElector(api, LeaseSettings(namespace="default", identity="a"), clock)
        b = LeaseElector(api, LeaseSettings(namespace="default", identity="b"), clock)

        assert await a.step() is True  # no Lease yet: a creates it
        assert await b.step() is False
        lease = kube.lease()
        assert lease["spec"]["holderIdentity"] == "a"
        assert lease["spec"]["leaseDurationSeconds"] == 15

        clock.at += 5
        assert await a.step() is True  # renews
        assert await b.step() is False
        assert kube.lease()["spec"]["renewTime"].startswith("2027-01-15T08:00:05")

        # a stops renewing (hung, partitioned). After its 10 s renew deadline it stops acting;
        # after the 15 s lease duration b takes over. Never both at once.
        clock.at += 11
        assert a.is_leader is False
        assert await b.step() is False  # 11 s < 15 s: still a's
        clock.at += 5
        assert await b.step() is True
        assert kube.lease()["spec"]["holderIdentity"] == "b"
        assert kube.lease()["spec"]["leaseTransitions"] == 1
        assert await a.step() is False
        assert not (a.is_leader and b.is_leader)

        # b shuts down and releases: a takes over at its next step, not a lease duration later.
        await b.release()
        assert kube.lease()["spec"].get("holderIdentity") is None
        assert await a.step() is True
        assert kube.lease()["spec"]["leaseTransitions"] == 2


async def test_a_leader_renews_with_one_patch_and_no_read(kube: Kube) -> None:
    """Renewing from the Lease the last write returned halves the autoscaler's steady-state requests."""
    clock = Clock(1_800_000_000.0)
    async with kube.api() as api:
        elector = LeaseElector(api, LeaseSettings(namespace="default", identity="a"), clock)
        assert await elector.step() is True  # GET (404), then POST
        before = len(list(kube.emulator))
        for _ in range(3):
            clock.at += 2
            assert await elector.step() is True
        renewals = list(kube.emulator)[before:]
        assert [r.method for r in renewals] == ["PATCH"] * 3
        assert kube.lease()["spec"]["renewTime"].startswith("2027-01-15T08:00:06")


async def test_leader_that_cannot_renew_stops_by_the_renew_deadline(kube: Kube) -> None:
    clock = Clock(1_800_000_000.0)
    async with kube.api() as api:
        elector = LeaseElector(api, LeaseSettings(namespace="default", identity="a"), clock)
        assert await elector.step() is True
    # The API server becomes unreachable: the leader keeps acting until 10 s after its last
    # renewal (the Lease is still its own for 15 s), then stops.
    elector.api = KubeClient.for_server(f"http://127.0.0.1:{pick_free_port()}", timeout_s=1)
    async with elector.api:
        clock.at += 5
        assert await elector.step() is True
        clock.at += 5
        assert await elector.step() is False
        assert elector.leader_changed.is_set()


def test_lease_verdicts() -> None:
    spec = {"holderIdentity": "x", "renewTime": "2026-01-01T00:00:00.000000Z", "leaseDurationSeconds": 15}
    t0 = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    assert lease_verdict(None, "me", t0) == "create"
    assert lease_verdict({"spec": spec}, "x", t0) == "renew"
    assert lease_verdict({"spec": spec}, "me", t0 + 15) == "follow"
    assert lease_verdict({"spec": spec}, "me", t0 + 15.1) == "acquire"
    assert lease_verdict({"spec": {**spec, "holderIdentity": ""}}, "me", t0) == "acquire"
    assert lease_verdict({"spec": {"holderIdentity": "x"}}, "me", t0) == "acquire"
    with pytest.raises(ValueError, match="retry_period_s < renew_deadline_s"):
        LeaseSettings(namespace="default", identity="a", renew_deadline_s=20)


@pytest.mark.parametrize("user", ["token", "tokenFile", "relativeTokenFile"])
async def test_kubeconfig_token_is_sent(tmp_path: Path, user: str) -> None:
    """Inline tokens and token files (absolute, or relative to the kubeconfig as kubectl reads them)
    reach the API server as a bearer token (a client that lost it went out as system:anonymous)."""
    token_file = tmp_path / "token"
    token_file.write_text("abc.def\n")
    api = WatchApi()
    url = await api.start()
    users = {"token": {"token": "abc.def"}, "tokenFile": {"tokenFile": str(token_file)}}
    users["relativeTokenFile"] = {"tokenFile": "token"}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": users[user]}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    try:
        async with KubeClient.from_kubeconfig(str(path)) as client:
            await client.get("/apis/kvfleet.io/v1alpha1/inferencedeployments")
        assert [r.authorization for r in api.requests] == ["Bearer abc.def"]
    finally:
        await api.stop()


async def test_wakes_for_unknown_names_are_answered_from_the_watched_set() -> None:
    """A wake names any namespace/name it likes: an unknown one must not cost the API server a LIST
    (the listing is the watch's cache; only the watch's own first LIST reaches the server)."""
    from kvfleet.autoscaler.controller import Controller
    from kvfleet.autoscaler.observation import Observation

    class NoMetrics:
        observed: list[str] = []

        async def observe(self, target: Target, now_s: float) -> Observation:
            self.observed.append(target.key)
            return Observation.failed(now_s, "no metrics here", ready_replicas=target.ready_replicas)

        async def close(self) -> None:
            pass

    api = WatchApi()
    await api.start()
    client = KubeClient.for_server(api.url, timeout_s=5)
    try:
        path = "/apis/kvfleet.io/v1alpha1/namespaces/default/inferencedeployments"
        await api.put(path, {"metadata": {"name": "chat", "namespace": "default"}, "spec": SPEC})
        watched = KubernetesDeployments(client)
        await watched.watch.sync()
        metrics = NoMetrics()
        controller = Controller(watched, metrics, InProcessActuator())
        for i in range(50):
            await controller.tick(wakes={("default", f"ghost-{i}")}, only_woken=True)
        await controller.tick(wakes={("default", "chat")}, only_woken=True)
        assert len(api.seen("list")) == 1  # the watch's first LIST, nothing per wake
        assert metrics.observed == ["default/chat"]  # unknown names woke nothing
    finally:
        await client.close()
        await api.stop()


class _Busy:
    """Reports 40 requests in flight on one ready replica (ceil(40 / 16) = 3 replicas)."""

    async def observe(self, target: Target, now_s: float) -> Observation:
        return Observation(
            sampled_at_s=now_s, ready_replicas=1, engine_concurrency=40.0, queue_depth=0.0, arrival_rate_rps=0.0
        )

    async def close(self) -> None:
        pass


async def test_loop_skips_ticks_until_the_watch_has_listed(caplog: pytest.LogCaptureFixture) -> None:
    # The watch has not listed yet (its API server is not there): the loop skips the tick with a
    # warning instead of failing, and decides nothing.
    dead = KubeClient.for_server(f"http://127.0.0.1:{pick_free_port()}", timeout_s=2)
    async with dead:
        controller = Controller(KubernetesDeployments(dead), _Busy(), InProcessActuator())
        with caplog.at_level(logging.WARNING, logger="kvfleet.autoscaler.controller"):
            assert await controller.tick() == []
    assert "cannot list deployments" in caplog.text and "not listed yet" in caplog.text


async def test_loop_keeps_deciding_when_patching_status_fails(kube: Kube, caplog: pytest.LogCaptureFixture) -> None:
    # The Kubernetes actuator's failure reaches the loop as an ActuatorError: logged once, the
    # decision kept, and applied on a later tick once the API server answers.
    kube.add_deployment("chat", SPEC, status={"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1})
    scaled = Scaled(Target("default", "chat", "tiny-chat", ready_replicas=1), AutoscalingSpec(max_replicas=5), 1, 1)
    dead = KubeClient.for_server(f"http://127.0.0.1:{pick_free_port()}", timeout_s=2)
    async with dead, kube.api() as live:
        controller = Controller(StaticDeployments([scaled]), _Busy(), KubernetesActuator(dead))
        with caplog.at_level(logging.WARNING, logger="kvfleet.autoscaler.controller"):
            [decision] = await controller.tick()
            [_] = await controller.tick()
        assert (decision.desired_replicas, decision.reason) == (3, "scale_up")
        assert sum("cannot apply 3 replicas" in r.getMessage() for r in caplog.records) == 1
        assert kube.deployment("chat")["status"]["desiredReplicas"] == 1  # not written yet
        controller.actuator = KubernetesActuator(live)
        await controller.tick()
    assert kube.deployment("chat")["status"]["desiredReplicas"] == 3
    assert "concurrency: load 40.0" in kube.deployment("chat")["status"]["scaleReason"]
