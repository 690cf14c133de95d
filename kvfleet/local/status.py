"""What ``kvfleet local up`` reports about itself: the status model, its endpoint, and the view.

The same ``LocalStatus`` is drawn in the foreground (a rich Live panel) and served as JSON on a
small loopback endpoint that ``kvfleet local status`` reads, so both always show the same thing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvfleet.local.prometheus import write_atomically

ENDPOINT_FILE = "endpoint.json"
# Events shown per deployment in the view (the actuator keeps more).
VIEW_EVENTS = 4


class ReplicaStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    replica_id: str
    state: Literal["starting", "ready", "draining"]
    url: str
    pid: int | None = None
    age_s: float = 0.0


class DeploymentStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    served_name: str
    desired_replicas: int
    min_replicas: int
    max_replicas: int
    replicas: list[ReplicaStatus] = Field(default_factory=list)
    queue_depth: float = Field(default=0.0, description="Requests the router holds plus those waiting in engines.")
    running: float = 0.0
    requests_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    prefix_hit_rate: float | None = None
    last_decision: str | None = Field(
        default=None, description="The autoscaler's last decision that changed the count, e.g. 'scale_up -> 2'."
    )
    last_decision_reason: str | None = None
    current_decision: str | None = Field(default=None, description="This tick's decision and its reason.")
    events: list[str] = Field(default_factory=list)

    def count(self, state: str) -> int:
        return sum(1 for r in self.replicas if r.state == state)


class LocalStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    router_url: str
    metrics_source: str = Field(description="'engines (direct scrape)' or the Prometheus URL.")
    prometheus_url: str | None = None
    uptime_s: float = 0.0
    deployments: list[DeploymentStatus] = Field(default_factory=list)


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


_STATE_STYLE = {"starting": "yellow", "ready": "green", "draining": "magenta"}


def render_status(status: LocalStatus) -> RenderableType:
    """The live view: one row per deployment, its replicas, and its recent scaling events."""
    table = Table(expand=True, title=f"kvfleet local  ·  {status.router_url}/v1  ·  metrics: {status.metrics_source}")
    for column in ("deployment", "replicas", "queue", "req/s", "TTFT p50", "TTFT p99", "prefix hits", "last decision"):
        table.add_column(column, overflow="fold", ratio=4 if column == "last decision" else 1)
    parts: list[RenderableType] = [table]
    for d in status.deployments:
        replicas = Text(f"{d.count('ready')}/{d.desired_replicas} ready")
        for r in d.replicas:
            replicas.append(f"\n{r.replica_id} ", style="dim")
            replicas.append(r.state, style=_STATE_STYLE[r.state])
        decision = Text(d.last_decision or "-", style="bold")
        if d.last_decision_reason:
            decision.append(f"\n{d.last_decision_reason}", style="dim")
        if d.current_decision:
            decision.append(f"\nnow: {d.current_decision}", style="italic")
        table.add_row(
            f"{d.name}\n[dim]model {d.served_name}, {d.min_replicas}-{d.max_replicas}[/dim]",
            replicas,
            f"{d.queue_depth:g}",
            f"{d.requests_per_s:.1f}",
            _fmt_s(d.ttft_p50_s),
            _fmt_s(d.ttft_p99_s),
            _fmt_rate(d.prefix_hit_rate),
            decision,
        )
        if d.events:
            parts.append(
                Panel("\n".join(d.events[-VIEW_EVENTS:]), title=f"{d.name}: recent events", title_align="left")
            )
    return Group(*parts)


STATUS_PATH = "/status"


def status_app(snapshot: Callable[[], LocalStatus]) -> web.Application:
    """GET /status -> the current LocalStatus as JSON (read-only; bound to loopback by the caller)."""

    async def handle(_: web.Request) -> web.Response:
        return web.json_response(text=snapshot().model_dump_json())

    app = web.Application()
    app.router.add_get(STATUS_PATH, handle)
    return app


def write_endpoint_file(state_dir: Path, status_url: str, router_url: str, pid: int) -> Path:
    """Record where this run's status endpoint is, for `kvfleet local status` without flags."""
    path = state_dir / ENDPOINT_FILE
    write_atomically(path, json.dumps({"status_url": status_url, "router_url": router_url, "pid": pid}))
    return path


def read_endpoint_file(state_dir: Path) -> dict[str, object]:
    path = state_dir / ENDPOINT_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise LookupError(f"no local run found ({path} is missing): is `kvfleet local up` running here?") from e
    except json.JSONDecodeError as e:
        raise LookupError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("status_url"), str):
        raise LookupError(f"{path} has no status_url")
    return data
