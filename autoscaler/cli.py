"""``kvfleet autoscaler``: run the autoscaler against a Kubernetes API.

Local mode is ``kvfleet local up``: it runs this same control loop with a process actuator and the
router. ``--mode local`` is refused with that pointer rather than run a loop that acts on nothing.
"""

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

LOCAL_MODE_REFUSED = (
    "kvfleet autoscaler run: --mode local (and -f, --router-url) is refused: it would decide for engines "
    "that nothing starts. Local mode is `kvfleet local up -f FILE`, which runs this control loop with "
    "engine processes and the router."
)


@click.group()
def autoscaler() -> None:
    """Traffic- and utilization-driven scaling with scale to zero."""


@autoscaler.command()
@click.option(
    "--mode",
    type=click.Choice(["kubernetes", "local"]),
    default="kubernetes",
    show_default=True,
    help="kubernetes; local is refused: local mode is `kvfleet local up`.",
)
@click.option("--prometheus-url", envvar="KVFLEET_PROMETHEUS_URL", help="Prometheus HTTP API.")
@click.option("--router-url", hidden=True, help="Refused: local mode is `kvfleet local up`.")
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
@click.option("--lease-duration-s", type=float, help="A standby takes the Lease this long after the last renewal (15).")
@click.option("--renew-deadline-s", type=float, help="The leader stops acting after this long without renewing (10).")
@click.option("--retry-period-s", type=float, help="Time between renewals (2; client-go's defaults).")
@click.option(
    "-f",
    "--filename",
    "files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    hidden=True,
    help="Refused: local mode is `kvfleet local up -f FILE`.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log every decision's detail.")
def run(files: tuple[Path, ...], router_url: str | None, verbose: bool, **options: Any) -> None:
    """Run the control loop until SIGTERM or SIGINT."""
    if options["mode"] == "local" or files or router_url:
        click.echo(LOCAL_MODE_REFUSED, err=True)
        sys.exit(2)
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

    async def main() -> None:
        from kvfleet.autoscaler.runner import run_autoscaler

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_autoscaler(settings, stop)

    asyncio.run(main())
