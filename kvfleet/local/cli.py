"""``kvfleet local``: run deployments on this machine (``up``) and look at a running one (``status``)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import click

from kvfleet.cli_options import format_data, manifest_files, output_format
from kvfleet.local.settings import LocalSettings, LocalSettingsError

DEFAULT_STATE_DIR = Path(".kvfleet/local")


@click.group()
def local() -> None:
    """Run InferenceDeployments locally: engines as child processes behind the router, autoscaled."""


@local.command()
@manifest_files("Manifest file (several InferenceDeployments allowed); repeat for more files.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the router listens on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Router port.")
@click.option(
    "--status-port",
    default=0,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port of the status endpoint `kvfleet local status` reads (0: a free one, recorded in --state-dir).",
)
@click.option("--prometheus", "prometheus_url", default=None, help="Read metrics from this Prometheus URL.")
@click.option("--with-prometheus", is_flag=True, help="Start the `prometheus` binary scraping the router and engines.")
@click.option(
    "--state-dir",
    default=DEFAULT_STATE_DIR,
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Engine logs, Prometheus data and the status endpoint's address.",
)
@click.option("--view/--no-view", default=None, help="Draw the live view (default: when stdout is a terminal).")
@click.option("--tick", "tick_s", default=1.0, show_default=True, type=float, help="Seconds between decisions.")
def up(
    files: tuple[Path, ...],
    host: str,
    port: int,
    status_port: int,
    prometheus_url: str | None,
    with_prometheus: bool,
    state_dir: Path,
    view: bool | None,
    tick_s: float,
) -> None:
    """Serve the manifests' deployments at http://HOST:PORT/v1 until Ctrl-C (a second Ctrl-C forces)."""
    from kvfleet.engine.extras import require_engine_extra

    # Local engines are reference-engine processes: say what to install before starting anything.
    require_engine_extra("kvfleet local up")
    from kvfleet.local.foreground import run_until_signalled
    from kvfleet.local.runtime import LocalRunError, load_manifests

    try:
        settings = LocalSettings(
            host=host,
            router_port=port,
            status_port=status_port,
            state_dir=state_dir,
            tick_s=tick_s,
            prometheus_url=prometheus_url,
            with_prometheus=with_prometheus,
        )
    except LocalSettingsError as e:
        raise click.UsageError(str(e)) from e
    try:
        deployments = load_manifests(files)
        code = asyncio.run(
            run_until_signalled(deployments, settings, view=sys.stdout.isatty() if view is None else view)
        )
    except LocalRunError as e:
        click.echo(f"kvfleet local up: {e}", err=True)
        sys.exit(2)
    sys.exit(code)


@local.command()
@click.option("--url", default=None, help="Status endpoint URL (default: the one recorded in --state-dir).")
@click.option(
    "--state-dir", default=DEFAULT_STATE_DIR, show_default=True, type=click.Path(file_okay=False, path_type=Path)
)
@output_format(default="table", human="table")
@click.option("--json", "as_json", is_flag=True, hidden=True, help="Deprecated: -o json.")
@click.option("--watch", is_flag=True, help="Redraw every second until Ctrl-C (the table only).")
def status(url: str | None, state_dir: Path, output: str, as_json: bool, watch: bool) -> None:
    """Show a running `kvfleet local up`: replicas, queue, requests/s, TTFT, prefix hits, scaling."""
    import urllib.error
    import urllib.request

    from rich.console import Console
    from rich.live import Live

    from kvfleet.local.status import STATUS_PATH, LocalStatus, read_endpoint_file, render_status

    if url is None:
        try:
            url = str(read_endpoint_file(state_dir)["status_url"])
        except LookupError as e:
            raise click.ClickException(str(e)) from e
    if not url.startswith(("http://", "https://")):
        raise click.UsageError(f"--url must be an http(s) URL, got {url!r}")

    def fetch() -> LocalStatus:
        try:
            with urllib.request.urlopen(url.rstrip("/") + STATUS_PATH, timeout=5) as response:  # noqa: S310 (scheme checked)
                return LocalStatus.model_validate_json(response.read())
        except (urllib.error.URLError, TimeoutError) as e:
            raise click.ClickException(f"cannot reach {url}: {e}") from e

    if as_json:
        click.echo("kvfleet local status: --json is deprecated; use -o json", err=True)
        output = "json"
    if output != "table":
        if watch:
            raise click.UsageError("--watch redraws the table; drop it or -o")
        click.echo(format_data(fetch().model_dump(mode="json"), output), nl=False)
        return
    console = Console()
    if not watch:
        console.print(render_status(fetch()))
        return
    with Live(render_status(fetch()), console=console, refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(1)
                live.update(render_status(fetch()))
        except KeyboardInterrupt:
            pass
