"""The status model, its endpoint, `kvfleet local status`, and the rich view."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import yaml
from aiohttp import web
from click.testing import CliRunner
from rich.console import Console

from kvfleet.cli import cli
from kvfleet.local.status import (
    DeploymentStatus,
    LocalStatus,
    ReplicaStatus,
    read_endpoint_file,
    render_status,
    status_app,
    write_endpoint_file,
)

STATUS = LocalStatus(
    router_url="http://127.0.0.1:8000",
    metrics_source="engines (direct scrape)",
    deployments=[
        DeploymentStatus(
            name="tiny",
            served_name="tiny",
            desired_replicas=2,
            min_replicas=0,
            max_replicas=3,
            replicas=[
                ReplicaStatus(replica_id="tiny-1", state="ready", url="http://127.0.0.1:1"),
                ReplicaStatus(replica_id="tiny-2", state="starting", url="http://127.0.0.1:2"),
                ReplicaStatus(replica_id="tiny-0", state="draining", url="http://127.0.0.1:3"),
            ],
            queue_depth=5,
            requests_per_s=12.5,
            ttft_p50_s=0.042,
            ttft_p99_s=1.5,
            prefix_hit_rate=0.73,
            last_decision="scale_up -> 2",
            last_decision_reason="concurrency: load 7.0 over 30s / 4 per replica -> 2",
            events=["12:00:00 start tiny-2: 1 live replica(s), 2 wanted: start 1"],
        )
    ],
)


def _text(status: LocalStatus) -> str:
    console = Console(record=True, width=200)
    console.print(render_status(status))
    return console.export_text()


def test_view_shows_every_field_the_issue_asks_for() -> None:
    text = _text(STATUS)
    for expected in (
        "1/2 ready",
        "tiny-1 ready",
        "tiny-2 starting",
        "tiny-0 draining",
        "12.5",  # requests/s
        "42 ms",  # TTFT p50
        "1.50 s",  # TTFT p99
        "73%",  # prefix hit rate
        "scale_up -> 2",
        "load 7.0 over 30s",
        "start tiny-2",
    ):
        assert expected in text, expected


def test_view_with_no_data_shows_dashes() -> None:
    empty = STATUS.model_copy(
        update={
            "deployments": [
                DeploymentStatus(name="x", served_name="x", desired_replicas=0, min_replicas=0, max_replicas=1)
            ]
        }
    )
    text = _text(empty)
    assert "0/0 ready" in text and "-" in text


def test_endpoint_file_round_trip_and_missing(tmp_path: Path) -> None:
    write_endpoint_file(tmp_path, "http://127.0.0.1:1234", "http://127.0.0.1:8000", 42)
    assert read_endpoint_file(tmp_path)["status_url"] == "http://127.0.0.1:1234"
    try:
        read_endpoint_file(tmp_path / "nothing")
    except LookupError as e:
        assert "is `kvfleet local up` running here?" in str(e)
    else:
        raise AssertionError("missing endpoint file was not reported")


async def test_status_command_reads_the_endpoint(tmp_path: Path, free_port: int) -> None:
    runner = web.AppRunner(status_app(lambda: STATUS))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    try:
        write_endpoint_file(tmp_path, f"http://127.0.0.1:{free_port}", STATUS.router_url, 1)
        cli_runner = CliRunner()
        # The CLI blocks (urllib); run it off the loop that serves the endpoint.
        command = ["local", "status", "--state-dir", str(tmp_path)]
        as_json = await asyncio.to_thread(cli_runner.invoke, cli, [*command, "-o", "json"])
        assert as_json.exit_code == 0, as_json.output
        assert LocalStatus.model_validate(json.loads(as_json.output)) == STATUS
        as_yaml = await asyncio.to_thread(cli_runner.invoke, cli, [*command, "-o", "yaml"])
        assert LocalStatus.model_validate(yaml.safe_load(as_yaml.output)) == STATUS
        # The old flag still works, and says what replaced it.
        deprecated = await asyncio.to_thread(cli_runner.invoke, cli, [*command, "--json"])
        assert deprecated.exit_code == 0 and "use -o json" in deprecated.stderr
        assert LocalStatus.model_validate(json.loads(deprecated.stdout)) == STATUS
        table = await asyncio.to_thread(cli_runner.invoke, cli, ["local", "status", "--state-dir", str(tmp_path)])
        assert table.exit_code == 0 and "tiny-2" in table.output
    finally:
        await runner.cleanup()


def test_status_command_without_a_run_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["local", "status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "no local run found" in result.output


def test_local_group_is_listed() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert "local" in result.output
