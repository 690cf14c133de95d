"""``kvfleet router``: run the router from the command line."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import ValidationError

from kvfleet.router.replicas import ReplicaSource, StaticReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import HttpWakeSignal, NoWakeSignal, WakeSignal
from kvfleet.spec import RoutingSpec


@click.group()
def router() -> None:
    """Run the OpenAI-compatible, prefix-aware router."""


def load_settings(path: Path | None, overrides: dict[str, Any]) -> RouterSettings:
    """Settings from a YAML/JSON file (snake_case fields), with command-line overrides on top."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise click.BadParameter(f"{path} must hold a mapping of settings", param_hint="--settings")
        data.update(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RouterSettings.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise click.BadParameter(problems, param_hint="settings") from None


def parse_tokenizers(values: tuple[str, ...]) -> dict[str, str]:
    """``--kv-events-tokenizer MODEL=DIR`` (repeated) as served name -> folder."""
    tokenizers: dict[str, str] = {}
    for value in values:
        model, sep, folder = value.partition("=")
        if not sep or not model or not folder:
            raise click.BadParameter(f"{value!r}: expected MODEL=DIR", param_hint="--kv-events-tokenizer")
        if model in tokenizers:
            raise click.BadParameter(f"{model!r} is given twice", param_hint="--kv-events-tokenizer")
        tokenizers[model] = folder
    return tokenizers


def parse_replicas(values: tuple[str, ...], strategy: str) -> StaticReplicaSource:
    source = StaticReplicaSource()
    counts: dict[str, int] = {}
    for value in values:
        model, sep, url = value.partition("=")
        if not sep or not model or not url:
            raise click.BadParameter(f"{value!r}: expected MODEL=URL", param_hint="--replica")
        url, _, events = url.partition(",kv-events-port=")
        if events and not events.isdigit():
            raise click.BadParameter(f"{value!r}: kv-events-port must be a port number", param_hint="--replica")
        if model not in counts:
            source.set_deployment(model, routing=RoutingSpec(strategy=strategy))
        counts[model] = counts.get(model, 0) + 1
        try:
            source.add(
                model, f"{model}-{counts[model] - 1}", url.rstrip("/"), kv_events_port=int(events) if events else None
            )
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--replica") from None
    return source


@router.command()
@click.option("--host", default=None, help="Listen address [default: 127.0.0.1; 0.0.0.0 in a pod].")
@click.option("--port", type=int, default=None, help="Listen port [default: 8080].")
@click.option(
    "--settings",
    "settings_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML or JSON file with RouterSettings fields.",
)
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    help="MODEL=URL of a fixed replica (repeat); static discovery. MODEL=URL,kv-events-port=N: its KV events' port.",
)
@click.option(
    "--strategy",
    type=click.Choice(["prefix", "least-load", "round-robin"]),
    default="prefix",
    show_default=True,
    help="Routing strategy for --replica models.",
)
@click.option("--kubernetes", is_flag=True, help="Discover InferenceDeployments and EndpointSlices in the cluster.")
@click.option("--namespace", default=None, help="With --kubernetes: watch one namespace (default: all).")
@click.option("--kube-server", default=None, help="With --kubernetes: API server URL without auth (kubectl proxy).")
@click.option("--kubeconfig", default=None, help="With --kubernetes: kubeconfig file instead of in-cluster config.")
@click.option("--autoscaler-url", default=None, help="Autoscaler base URL for wake signals (POST /v1/wake).")
@click.option(
    "--wake-token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File with the token the autoscaler's /v1/wake requires (sent as Authorization: Bearer).",
)
@click.option(
    "--placement/--no-placement",
    default=None,
    help="Credit each prompt's rendezvous home so several routers agree [default: on; RouterSettings.placement].",
)
@click.option(
    "--load-bound-slack-requests",
    type=int,
    default=None,
    help="In-flight requests allowed over the load bound's cap [default: 2].",
)
@click.option(
    "--max-held-requests",
    type=int,
    default=None,
    help="Requests held across all models while they have no ready replica; more get 429 [default: 2000].",
)
@click.option(
    "--cold-start-comments/--no-cold-start-comments",
    default=None,
    help="Send held streams an SSE comment every interval while their model wakes, so proxies do not time "
    "them out [default: on].",
)
@click.option(
    "--cold-start-comment-interval-s",
    type=float,
    default=None,
    help="Seconds between two cold-start comments; the first is sent at once [default: 1].",
)
@click.option(
    "--client-namespace-header",
    default=None,
    help="Client scoping: the header (set by the authenticating gateway) naming the client's namespace; "
    "clients reach only that namespace's models and the shared ones [default: off].",
)
@click.option(
    "--shared-namespace",
    "shared_namespaces",
    multiple=True,
    help="With --client-namespace-header: a namespace whose models every client reaches (repeat).",
)
@click.option(
    "--kv-events-port",
    type=int,
    default=None,
    help="Subscribe to the replicas' KV-cache events at this port (or the one each replica names) [default: off].",
)
@click.option(
    "--kv-events-announced-only/--no-kv-events-announced-only",
    default=None,
    help="Subscribe only to replicas whose discovery names their events port (the EndpointSlice's kv-events).",
)
@click.option(
    "--kv-events-replay/--no-kv-events-replay",
    default=None,
    help="Ask each engine's replay socket (the events port + 1) for what it buffers on connecting [default: on].",
)
@click.option(
    "--kv-events-report-hits/--no-kv-events-report-hits",
    default=None,
    help="Ask engines to announce the cached blocks each request hits (vllm_xargs kv_cache_report_mode) [default: on].",
)
@click.option(
    "--kv-events-fetch-tokenizers/--no-kv-events-fetch-tokenizers",
    default=None,
    help="Fetch an unlisted model's tokenizer from its replicas' launcher port (Kubernetes discovery) [default: on].",
)
@click.option(
    "--kv-events-tokenizer",
    "kv_events_tokenizer",
    multiple=True,
    help="MODEL=DIR: the served model's tokenizer.json (and tokenizer_config.json) folder (repeat).",
)
@click.option("--peer-load-port", type=int, default=None, help="UDP port for the routers' load reports [default: off].")
@click.option("--peer-load-peer", "peer_load_peer", multiple=True, help="HOST:PORT of the other routers (repeat).")
@click.option("--peer-load-key-file", default=None, help="File with the HMAC key the routers sign load reports with.")
@click.option("--log-level", default="INFO", show_default=True)
def serve(
    host: str | None,
    port: int | None,
    settings_file: Path | None,
    replicas: tuple[str, ...],
    strategy: str,
    kubernetes: bool,
    namespace: str | None,
    kube_server: str | None,
    kubeconfig: str | None,
    autoscaler_url: str | None,
    wake_token_file: Path | None,
    placement: bool | None,
    load_bound_slack_requests: int | None,
    max_held_requests: int | None,
    cold_start_comments: bool | None,
    cold_start_comment_interval_s: float | None,
    client_namespace_header: str | None,
    shared_namespaces: tuple[str, ...],
    kv_events_port: int | None,
    kv_events_announced_only: bool | None,
    kv_events_replay: bool | None,
    kv_events_report_hits: bool | None,
    kv_events_fetch_tokenizers: bool | None,
    kv_events_tokenizer: tuple[str, ...],
    peer_load_port: int | None,
    peer_load_peer: tuple[str, ...],
    peer_load_key_file: str | None,
    log_level: str,
) -> None:
    """Serve the OpenAI API and route each request to a replica of its model."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_settings(
        settings_file,
        {
            "host": host,
            "port": port,
            "placement": placement,
            "load_bound_slack_requests": load_bound_slack_requests,
            "max_held_requests": max_held_requests,
            "cold_start_comments": cold_start_comments,
            "cold_start_comment_interval_s": cold_start_comment_interval_s,
            "client_namespace_header": client_namespace_header,
            "shared_namespaces": shared_namespaces or None,
            "kv_events_port": kv_events_port,
            "kv_events_announced_only": kv_events_announced_only,
            "kv_events_replay": kv_events_replay,
            "kv_events_report_hits": kv_events_report_hits,
            "kv_events_fetch_tokenizers": kv_events_fetch_tokenizers,
            "kv_events_tokenizers": parse_tokenizers(kv_events_tokenizer) or None,
            "peer_load_port": peer_load_port,
            "peer_load_peers": peer_load_peer or None,
            "peer_load_key_file": peer_load_key_file,
        },
    )
    if kubernetes == bool(replicas):
        raise click.UsageError("give either --kubernetes or one or more --replica MODEL=URL")
    source: ReplicaSource
    if kubernetes:
        from kvfleet.kube import KubeClient, KubeError
        from kvfleet.router.kubernetes_source import KubernetesReplicaSource

        try:
            client = (
                KubeClient.for_server(kube_server, user_agent="kvfleet-router")
                if kube_server
                # In a pod: its service account (unless --kubeconfig); else $KUBECONFIG.
                else KubeClient.from_kubeconfig(kubeconfig, user_agent="kvfleet-router")
            )
        except KubeError as e:
            raise click.UsageError(str(e)) from e
        source = KubernetesReplicaSource(client, namespace=namespace)
    else:
        source = parse_replicas(replicas, strategy)
    wake: WakeSignal = NoWakeSignal()
    if autoscaler_url:
        wake = HttpWakeSignal(autoscaler_url, timeout_s=settings.wake_timeout_s, token_file=wake_token_file)
    sys.exit(run_event_loop(_serve(settings, source, wake)))


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed (about 1.5x the proxy throughput of asyncio's default loop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


# Allocations between young-generation collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 50_000


def _tune_gc() -> None:
    """Fewer, cheaper cyclic-GC passes for the router process (its own process only, never when embedded).

    A proxied request allocates ~60 containers, so at the default threshold a collection ran every ~12
    requests and the older generations rescanned everything imported at start-up. Freezing the start-up
    heap and collecting the young generation every 50k allocations cut ~5 us of CPU per request under
    wrk (docs/benchmarks/router.md). Request garbage is still reference-counted at once; only cycles wait
    longer, bounded by the threshold (a few MB).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


async def _serve(settings: RouterSettings, source: ReplicaSource, wake: WakeSignal) -> int:
    from kvfleet.router.server import RouterServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = RouterServer(settings, source, wake)
    await server.start()
    _tune_gc()
    click.echo(f"kvfleet router listening on {server.url}", err=True)
    try:
        await stop.wait()
    finally:
        # Stop accepting, let in-flight requests finish (up to shutdown_timeout_s), then close.
        await server.stop()
        if isinstance(wake, HttpWakeSignal):
            await wake.close()
    return 0
