"""The real node's Prometheus targets (tests/support/node_prometheus.py): which Services' endpoints
each scrape job gets, on which ports, with the labels the autoscaler's PromQL selects by. Pure: no
cluster needed."""

from __future__ import annotations

from typing import Any

from support.node_prometheus import scrape_configs, target_groups


def _service(namespace: str, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name, "labels": labels or {}}}


def _chart(component: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/component": component}
    return _service("kvfleet-system", f"kvfleet-{component}", labels)


ENGINE = {"app.kubernetes.io/name": "kvfleet-engine", "kvfleet.io/deployment": "tiny"}


def _slice(namespace: str, service: str, ports: dict[str, int], *pods: tuple[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": n, "port": p} for n, p in ports.items()],
        "endpoints": [{"addresses": [ip], "targetRef": {"kind": "Pod", "name": pod}} for pod, ip in pods],
    }


def test_engines_routers_and_autoscalers_each_get_their_job_ports_and_labels() -> None:
    services = [
        _service("team-a", "tiny-engine", ENGINE),
        *(_chart(c) for c in ("router", "autoscaler", "operator")),
        _service("default", "kubernetes"),
    ]
    slices = [
        _slice(
            "team-a", "tiny-engine", {"http": 8000, "launcher": 8090, "kv-events": 5557}, ("tiny-engine-1", "10.88.0.5")
        ),
        _slice(
            "kvfleet-system",
            "kvfleet-router",
            {"http": 8080, "peer-load": 9000},
            ("r-1", "10.88.0.2"),
            ("r-2", "10.88.0.3"),
        ),
        _slice("kvfleet-system", "kvfleet-autoscaler", {"http": 8081}, ("a-1", "10.88.0.4")),
        _slice("kvfleet-system", "kvfleet-operator", {"http": 8080}, ("o-1", "10.88.0.6")),
        _slice("default", "kubernetes", {"https": 6443}, ("api", "10.99.0.1")),
    ]
    groups = target_groups(services, slices)
    assert groups["kvfleet-engines"] == [
        {
            "targets": ["10.88.0.5:8000", "10.88.0.5:8090"],
            "labels": {"namespace": "team-a", "service": "tiny-engine", "pod": "tiny-engine-1"},
        }
    ]
    assert [g["targets"] for g in groups["kvfleet-router"]] == [["10.88.0.2:8080"], ["10.88.0.3:8080"]]
    assert [g["labels"]["pod"] for g in groups["kvfleet-router"]] == ["r-1", "r-2"]
    assert [g["targets"] for g in groups["kvfleet-autoscaler"]] == [["10.88.0.4:8081"]]
    assert set(groups) == {"kvfleet-engines", "kvfleet-router", "kvfleet-autoscaler"}


def test_an_endpoint_slice_of_another_namespace_with_the_same_service_name_is_not_scraped() -> None:
    services = [_service("team-a", "tiny-engine", ENGINE)]
    slices = [_slice("team-b", "tiny-engine", {"http": 8000}, ("p", "10.88.0.9"))]
    assert target_groups(services, slices)["kvfleet-engines"] == []


def test_router_and_autoscaler_jobs_keep_the_series_own_namespace_label() -> None:
    class Files:
        def file(self, job: str) -> str:
            return f"/t/{job}.json"

    configs = {c["job_name"]: c for c in scrape_configs(Files())}
    assert configs["kvfleet-router"]["honor_labels"] and configs["kvfleet-autoscaler"]["honor_labels"]
    assert not configs["kvfleet-engines"]["honor_labels"]
