"""``kvfleet autoscaler``: run the autoscaler (in a cluster, or locally over manifest files)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from kvfleet.autoscaler.settings import AutoscalerSettings


@click.group()
def autoscaler() -> None:
    """Traffic- and utilization-driven scaling with scale to zero."""


@autoscaler.command()
@click.option("--mode", type=click.Choice(["kubernetes", "local"]), default="kubernetes", show_default=True)
@click.option("--prometheus-url", envvar="KVFLEET_PROMETHEUS_URL", help="Prometheus HTTP API (kubernetes mode).")
@click.option("--router-url", envvar="KVFLEET_ROUTER_URL", help="Router base URL to scrape (local mode).")
@click.option("--namespace", help="Only this namespace (default: all).")
@click.option("--tick-interval-s", type=float, default=2.0, show_default=True)
@click.option("--listen-host", default="0.0.0.0", show_default=True)
@click.option("--listen-port", type=int, default=8080, show_default=True)
@click.option(
    "--wake-token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="File with the token POST /v1/wake must carry (Authorization: Bearer); the routers send it.",
)
@click.option(
    "--kubeconfig", type=click.Path(dir_okay=False), help="kubeconfig (default: in-cluster, then $KUBECONFIG)."
)
@click.option("--context", help="kubeconfig context.")
@click.option("--leader-election/--no-leader-election", default=True, show_default=True)
@click.option("--identity", envvar="POD_NAME", default="", help="Lease identity ($POD_NAME).")
@click.option("--lease-namespace", envvar="POD_NAMESPACE", default="default", show_default=True)
@click.option(
    "-f",
    "--filename",
    "files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Local mode: InferenceDeployment manifests to scale.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log every decision's detail.")
def run(files: tuple[Path, ...], verbose: bool, **options: Any) -> None:
    """Run the control loop until SIGTERM or SIGINT."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = AutoscalerSettings(**{k: v for k, v in options.items() if v is not None})
    except ValidationError as e:
        for error in e.errors():
            where = ".".join(str(p) for p in error["loc"]) or "settings"
            click.echo(f"invalid setting {where}: {error['msg'].removeprefix('Value error, ')}", err=True)
        sys.exit(2)
    if settings.mode == "local" and not files:
        click.echo("local mode needs -f/--filename with the InferenceDeployments to scale", err=True)
        sys.exit(2)

    async def main() -> None:
        from kvfleet.autoscaler.runner import run_autoscaler

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_autoscaler(settings, stop, deployment_files=list(files))

    asyncio.run(main())
