"""A real Prometheus for the live PromQL tests, and the panel renderer that stands in for Grafana."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_api_client import PrometheusConnect

from .monitoring import Query


@dataclass(frozen=True)
class Prometheus:
    url: str
    client: PrometheusConnect

    def instant(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.client.custom_query(expr)
        return result

    def series(self, expr: str, start_s: float, end_s: float, step_s: float) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.client.custom_query_range(
            expr, start_time=_dt(start_s), end_time=_dt(end_s), step=f"{int(step_s * 1000)}ms"
        )
        return result

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Poll until ``expr`` has data (the first scrape lands ~5 s after start): never sleep blindly."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.instant(expr)
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def _dt(seconds: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, tz=UTC)


@contextmanager
def run_prometheus(
    workdir: Path, port: int, scrape_configs: list[dict[str, Any]], rule_groups: list[dict[str, Any]] | None = None
) -> Iterator[Prometheus]:
    """Start the Debian `prometheus` binary on loopback with a 1 s scrape interval; stop it after."""
    workdir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": scrape_configs,
    }
    if rule_groups:
        rules = workdir / "rules.yaml"
        rules.write_text(yaml.safe_dump({"groups": rule_groups}))
        config["rule_files"] = [str(rules)]
    config_file = workdir / "prometheus.yaml"
    config_file.write_text(yaml.safe_dump(config))
    log = (workdir / "prometheus.log").open("wb")
    child = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config_file}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={workdir / 'data'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield Prometheus(url, PrometheusConnect(url=url, disable_ssl=True))
    finally:
        child.terminate()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=5)
        log.close()


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or str(labels)


# Grafana unit -> y-axis label (the ones kvfleet's dashboard uses).
UNIT_LABELS = {"s": "seconds", "reqps": "requests/s", "percentunit": "", "percent": "", "short": ""}


def plot_panel(
    prometheus: Prometheus,
    title: str,
    queries: Sequence[Query],
    start_s: float,
    end_s: float,
    out: Path,
    unit: str = "",
    origin_s: float | None = None,
    no_data_note: str = "",
) -> int:
    """Draw one panel's queries over [start, end] as Grafana would; returns the number of lines drawn.

    The x axis counts seconds from ``origin_s`` (default: ``start_s``). Line styles alternate so
    that series with equal values stay visible; an empty panel shows ``no_data_note``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    lines = 0
    step_s = max(1.0, (end_s - start_s) / 200)
    origin = start_s if origin_s is None else origin_s
    for query in queries:
        for series in prometheus.series(query.expr, start_s, end_s, step_s):
            points = [(float(t) - origin, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
            if points:
                style = ("-", "--", ":", "-.")[lines % 4]
                label = legend(query.legend, series["metric"])
                ax.plot(*zip(*points, strict=True), label=label, linewidth=1.5, linestyle=style)
                lines += 1
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("seconds since the start of the traffic" if origin_s is not None else "seconds")
    ax.set_ylabel(UNIT_LABELS.get(unit, unit), fontsize=8)
    if unit in ("percentunit", "percent"):
        ax.yaxis.set_major_formatter(PercentFormatter(1.0 if unit == "percentunit" else 100.0))
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        text = f"no data\n{no_data_note}" if no_data_note else "no data"
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return lines
