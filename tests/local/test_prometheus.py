"""The real Debian prometheus binary scrapes replicas that come and go through file discovery."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import aiohttp
import pytest
from support.local_support import REPLICA_SERVER

from kvfleet.free_port import pick_free_port
from kvfleet.local.processes import spawn
from kvfleet.local.prometheus import ENGINE_JOB, ScrapeTarget, render_config, start_prometheus

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary")


def test_config_scrapes_router_statically_and_engines_by_file(tmp_path: Path) -> None:
    config = render_config(0.5, "127.0.0.1:8000", tmp_path / "t.json")
    assert config["global"]["scrape_interval"] == "500ms"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["kvfleet-router"]["static_configs"] == [{"targets": ["127.0.0.1:8000"]}]
    assert jobs[ENGINE_JOB]["file_sd_configs"][0]["files"] == [str(tmp_path / "t.json")]


async def _up_series(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/api/v1/query", params={"query": f'up{{job="{ENGINE_JOB}"}}'}) as response:
        body = await response.json()
    return {r["metric"]["replica"]: float(r["value"][1]) for r in body["data"]["result"]}


async def _active_targets(session: aiohttp.ClientSession, url: str) -> set[str]:
    async with session.get(f"{url}/api/v1/targets") as response:
        body = await response.json()
    return {t["labels"].get("replica", "") for t in body["data"]["activeTargets"] if t["scrapePool"] == ENGINE_JOB}


@pytest.mark.slow
async def test_prometheus_follows_replicas(tmp_path: Path) -> None:
    port = pick_free_port()
    replica = await spawn([sys.executable, str(REPLICA_SERVER), "--port", str(port)], tmp_path / "r.log")
    async with aiohttp.ClientSession() as session:
        prom = await start_prometheus(tmp_path / "prom", "127.0.0.1:1", session, scrape_interval_s=0.5)
        try:
            target = ScrapeTarget(f"127.0.0.1:{port}", {"deployment": "tiny", "replica": "tiny-1"})
            prom.set_engine_targets([target])
            assert json.loads(prom.targets_file.read_text())[0]["labels"]["replica"] == "tiny-1"
            # The first sample takes a few seconds: poll, never sleep a fixed time.
            for _ in range(200):
                if (await _up_series(session, prom.url)).get("tiny-1") == 1.0:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("prometheus never scraped the replica")
            prom.set_engine_targets([])
            for _ in range(200):
                if "tiny-1" not in await _active_targets(session, prom.url):
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("prometheus kept scraping a removed replica")
        finally:
            await prom.stop()
            await replica.stop(5)
    assert prom.child.returncode is not None
