"""Run the Debian ``prometheus`` binary for local mode, scraping the router and the engines.

Engines come and go, so they are listed through file-based service discovery: local mode
rewrites one targets file (atomically: temp file then rename, so Prometheus never reads half a
file) whenever a replica is added or removed, and Prometheus picks the change up through inotify.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvfleet.free_port import pick_free_port
from kvfleet.local.processes import ChildProcess, ProcessStartError, spawn, wait_healthy

ENGINE_JOB = "kvfleet-engines"
ROUTER_JOB = "kvfleet-router"


@dataclass(frozen=True)
class ScrapeTarget:
    """One host:port to scrape and the labels to attach to its series."""

    address: str
    labels: Mapping[str, str]


def render_config(scrape_interval_s: float, router_address: str, engine_targets_file: Path) -> dict[str, Any]:
    """The prometheus.yml for local mode: the router statically, the engines by file discovery."""
    interval = f"{int(scrape_interval_s * 1000)}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": ROUTER_JOB, "static_configs": [{"targets": [router_address]}]},
            {
                "job_name": ENGINE_JOB,
                # Re-read on change via inotify; the interval is only the fallback.
                "file_sd_configs": [{"files": [str(engine_targets_file)], "refresh_interval": "5s"}],
            },
        ],
    }


def render_targets(targets: Iterable[ScrapeTarget]) -> list[dict[str, Any]]:
    """File-SD JSON: one group per target so each keeps its own labels."""
    return [{"targets": [t.address], "labels": dict(t.labels)} for t in sorted(targets, key=lambda t: t.address)]


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class LocalPrometheus:
    """A prometheus child process and its targets file."""

    child: ChildProcess
    url: str
    targets_file: Path

    def set_engine_targets(self, targets: Iterable[ScrapeTarget]) -> None:
        write_atomically(self.targets_file, json.dumps(render_targets(targets), indent=1))

    async def stop(self, grace_s: float = 10.0) -> int:
        return await self.child.stop(grace_s)


def _write_files(workdir: Path, router_address: str, scrape_interval_s: float) -> tuple[Path, Path]:
    # Prometheus resolves relative paths from the config file's folder: give it absolute ones.
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    targets_file = workdir / "engine-targets.json"
    write_atomically(targets_file, "[]")
    config_file = workdir / "prometheus.yml"
    config = render_config(scrape_interval_s, router_address, targets_file)
    write_atomically(config_file, yaml.safe_dump(config, sort_keys=False))
    return targets_file, config_file


async def start_prometheus(
    workdir: Path,
    router_address: str,
    session: aiohttp.ClientSession,
    *,
    port: int = 0,
    scrape_interval_s: float = 1.0,
    binary: str = "prometheus",
    ready_timeout_s: float = 30.0,
) -> LocalPrometheus:
    """Write the config, start Prometheus on loopback and wait until it answers /-/ready."""
    targets_file, config_file = _write_files(workdir, router_address, scrape_interval_s)
    workdir = config_file.parent
    port = port or pick_free_port()
    argv = [
        binary,
        f"--config.file={config_file}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={workdir / 'data'}",
        # Local mode looks minutes back at most; keep the disk use small.
        "--storage.tsdb.retention.time=2h",
    ]
    child = await spawn(argv, workdir / "prometheus.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(child, f"{url}/-/ready", session, ready_timeout_s, 0.1, 2.0)
    except (ProcessStartError, asyncio.CancelledError):
        await child.stop(5.0)
        raise
    return LocalPrometheus(child=child, url=url, targets_file=targets_file)
