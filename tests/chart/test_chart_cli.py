"""The arguments the chart renders are accepted by the real `kvfleet` commands they start.

Each rendered argument list is parsed by the real click command (unknown flags and bad values fail
here), then the parsed values build that component's real settings object, as its command does
before it starts (bounds and cross-field rules fail here).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import helm_python
import pytest

from kvfleet.autoscaler.settings import AutoscalerSettings
from kvfleet.cli import cli
from kvfleet.operator.settings import OperatorSettings
from kvfleet.router.cli import load_settings as load_router_settings
from kvfleet.router.cli import parse_tokenizers
from kvfleet.router.settings import RouterSettings

from .conftest import CI_VALUES, NAMESPACE, objects, render

Render = Callable[[Path], list[dict[str, Any]]]
COMPONENTS = ["operator", "router", "autoscaler"]


def container(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith(f"-{component}")]
    first: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return first


def kubelet_expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Expand $(VAR) references as the kubelet does for a container's args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def parse(args: list[str]) -> tuple[click.Command, dict[str, Any], list[str]]:
    group, name, *flags = args
    ctx = click.Context(cli)
    command = cli.get_command(ctx, group)
    assert isinstance(command, click.Group), group
    sub = command.get_command(ctx, name)
    assert sub is not None, f"kvfleet {group} has no {name} command"
    # Parse only (no invoke): unknown options and bad values raise click.UsageError here.
    sub_ctx = sub.make_context(f"kvfleet {group} {name}", list(flags), parent=ctx)
    return sub, sub_ctx.params, flags


def build_settings(component: str, params: dict[str, Any]) -> object:
    """The settings object each command builds from its parsed options (see its cli.py)."""
    if component == "operator":
        assert not (params["all_namespaces"] and params["namespaces"])
        values = {"namespaces": params["namespaces"], "health_port": params["health_port"]}
        if params["router_endpoint"]:
            values["router_endpoint"] = params["router_endpoint"]
        return OperatorSettings.model_validate(values)
    if component == "router":
        assert params["kubernetes"] and not params["replicas"], "the chart's router discovers replicas in Kubernetes"
        keys = ("host", "port", "placement", "load_bound_slack_requests", "max_held_requests")
        keys += ("kv_events_port", "kv_events_announced_only", "kv_events_fetch_tokenizers")
        keys += ("cold_start_comments", "cold_start_comment_interval_s")
        overrides = {k: params[k] for k in keys}
        overrides["client_namespace_header"] = params["client_namespace_header"]
        overrides["shared_namespaces"] = params["shared_namespaces"] or None
        overrides["kv_events_tokenizers"] = parse_tokenizers(params["kv_events_tokenizer"]) or None
        return load_router_settings(None, overrides)
    options = {k: v for k, v in params.items() if k not in ("files", "verbose") and v is not None}
    return AutoscalerSettings(**options)


@pytest.mark.parametrize("component", COMPONENTS)
@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_rendered_args_start_the_real_command(component: str, values_file: Path, render_ci: Render) -> None:
    spec = container(render_ci(values_file), component)
    env = {"POD_NAME": f"kvf-kvfleet-{component}-7d9f-abcde", "POD_NAMESPACE": NAMESPACE}
    assert {e["name"] for e in spec["env"]} >= set(env), "the args refer to env vars the pod must set"
    sub, params, flags = parse(kubelet_expand(spec["args"], env))
    settings = build_settings(component, params)
    # A repeated option that is not `multiple` silently keeps only the last value.
    repeated = [f for f, n in Counter(a.split("=", 1)[0] for a in flags if a.startswith("--")).items() if n > 1]
    for flag in repeated:
        option = next(p for p in sub.params if isinstance(p, click.Option) and flag in p.opts)
        assert option.multiple, f"{flag} is repeated but {sub.name} keeps only the last one"
    # The port the command listens on is the container port the probes and the Service use.
    (port,) = spec["ports"]
    listen_port = {"operator": "health_port", "router": "port", "autoscaler": "listen_port"}[component]
    assert getattr(settings, listen_port) == port["containerPort"]


def test_namespace_mode_narrows_every_component(render_ci: Render) -> None:
    docs = render_ci(next(p for p in CI_VALUES if p.name == "namespaced-values.yaml"))
    env = {"POD_NAME": "pod-1", "POD_NAMESPACE": NAMESPACE}
    parsed = {c: parse(kubelet_expand(container(docs, c)["args"], env))[1] for c in COMPONENTS}
    operator = build_settings("operator", parsed["operator"])
    autoscaler = build_settings("autoscaler", parsed["autoscaler"])
    assert isinstance(operator, OperatorSettings) and isinstance(autoscaler, AutoscalerSettings)
    assert operator.namespaces == ("team-a",)
    assert autoscaler.namespace == "team-a"
    assert parsed["router"]["namespace"] == "team-a"  # passed to its KubernetesReplicaSource, not its settings


def test_autoscaler_elects_a_leader_in_its_own_namespace() -> None:
    docs = objects(render({"autoscaler": {"replicas": 2, "tickIntervalSeconds": 0.5, "verbose": True}}))
    spec = container(docs, "autoscaler")
    _, params, _ = parse(kubelet_expand(spec["args"], {"POD_NAME": "pod-1", "POD_NAMESPACE": NAMESPACE}))
    settings = build_settings("autoscaler", params)
    assert isinstance(settings, AutoscalerSettings)
    assert settings.lease is not None and settings.lease.identity == "pod-1" and settings.lease.namespace == NAMESPACE
    # The chart's Lease timing (values.yaml: 12 renewals a minute, failover within 30 s).
    lease = settings.lease
    assert (lease.lease_duration_s, lease.renew_deadline_s, lease.retry_period_s) == (30, 20, 5)
    assert settings.namespace is None and settings.loop.tick_interval_s == 0.5 and params["verbose"]


def test_one_autoscaler_elects_no_leader() -> None:
    spec = container(objects(render({})), "autoscaler")
    _, params, _ = parse(kubelet_expand(spec["args"], {"POD_NAME": "pod-1", "POD_NAMESPACE": NAMESPACE}))
    settings = build_settings("autoscaler", params)
    assert isinstance(settings, AutoscalerSettings)
    assert not settings.leader_election and settings.lease is None


@pytest.mark.parametrize(("port", "url"), [(80, "http://kvf-kvfleet-router.ml.svc/v1"), (8000, None)])
def test_operator_points_status_endpoint_at_this_router(port: int, url: str | None) -> None:
    docs = objects(render({"router": {"service": {"port": port}}}, namespace="ml"))
    _, params, _ = parse(container(docs, "operator")["args"])
    settings = build_settings("operator", params)
    assert isinstance(settings, OperatorSettings)
    assert settings.router_endpoint == (url or f"http://kvf-kvfleet-router.ml.svc:{port}/v1")


@pytest.mark.parametrize(("placement", "slack", "held"), [(True, 2, 2000), (False, 0, 17)])
def test_router_placement_values_reach_its_settings(placement: bool, slack: int, held: int) -> None:
    values = {"placement": placement, "loadBoundSlackRequests": slack, "maxHeldRequests": held}
    docs = objects(render({"router": values}))
    spec = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    args = spec["spec"]["template"]["spec"]["containers"][0]["args"]
    _, params, _ = parse(args)
    settings = build_settings("router", params)
    assert isinstance(settings, RouterSettings)
    assert (settings.placement, settings.load_bound_slack_requests) == (placement, slack)
    assert settings.max_held_requests == held


@pytest.mark.parametrize(("comments", "interval_s"), [(True, 1), (False, 0.25)])
def test_router_cold_start_values_reach_its_settings(comments: bool, interval_s: float) -> None:
    values = {"coldStart": {"comments": comments, "commentIntervalSeconds": interval_s}}
    docs = objects(render({"router": values}))
    spec = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    _, params, _ = parse(spec["spec"]["template"]["spec"]["containers"][0]["args"])
    settings = build_settings("router", params)
    assert isinstance(settings, RouterSettings)
    assert (settings.cold_start_comments, settings.cold_start_comment_interval_s) == (comments, interval_s)


def test_router_client_scoping_values_reach_its_settings() -> None:
    values = {"clientNamespaceHeader": "X-Kvfleet-Namespace", "sharedNamespaces": ["platform", "models"]}
    docs = objects(render({"router": values}))
    spec = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    _, params, _ = parse(spec["spec"]["template"]["spec"]["containers"][0]["args"])
    settings = build_settings("router", params)
    assert isinstance(settings, RouterSettings)
    assert settings.client_namespace_header == "X-Kvfleet-Namespace"
    assert settings.shared_namespaces == ("platform", "models")
    # Off by default: no flag, every client reaches every model.
    default = next(
        d for d in objects(render({})) if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")
    )
    _, params, _ = parse(default["spec"]["template"]["spec"]["containers"][0]["args"])
    off = build_settings("router", params)
    assert isinstance(off, RouterSettings) and off.client_namespace_header is None and off.shared_namespaces == ()
    # KV events on by default, with tokenizers fetched from the engines (nothing mounted).
    assert off.kv_events_port == 5557 and off.kv_events_announced_only and off.kv_events_fetch_tokenizers
    assert off.kv_events_tokenizers == {}


def test_shared_namespaces_without_the_header_fail_the_install() -> None:
    with pytest.raises(
        helm_python.HelmRenderError,
        match=re.escape("router.sharedNamespaces is only used with router.clientNamespaceHeader"),
    ):
        render({"router": {"sharedNamespaces": ["platform"]}})
    with pytest.raises(helm_python.HelmValuesError, match="sharedNamespaces"):
        render({"router": {"clientNamespaceHeader": "X-Ns", "sharedNamespaces": ["Bad_NS"]}})


def test_ha_routers_subscribe_to_kv_events_with_their_tokenizers(render_ci: Render) -> None:
    docs = render_ci(next(p for p in CI_VALUES if p.name == "ha-values.yaml"))
    _, params, _ = parse(container(docs, "router")["args"])
    settings = build_settings("router", params)
    assert isinstance(settings, RouterSettings)
    assert settings.kv_events_port == 5557 and settings.kv_events_announced_only
    assert settings.kv_events_tokenizers == {
        "llama-3.1-8b": "/var/lib/kvfleet/tokenizers/0/llama-3.1-8b",
        "qwen2.5-7b": "/var/lib/kvfleet/tokenizers/1/qwen2.5-7b",
    }
    assert settings.kv_events_fetch_tokenizers  # other models: fetched; the listed ones are mounted and win
    docs = render({"router": {"kvEvents": {"fetchTokenizers": False}}})
    router = next(d for d in objects(docs) if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    _, params, _ = parse(router["spec"]["template"]["spec"]["containers"][0]["args"])
    off = build_settings("router", params)
    assert isinstance(off, RouterSettings) and off.kv_events_port == 5557 and not off.kv_events_fetch_tokenizers
