"""Typed settings of local mode (``kvfleet local up``): one frozen object, units in the names."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from kvfleet.autoscaler.settings import TICK_INTERVAL_BOUNDS_S


class LocalSettingsError(ValueError):
    """A local-mode setting is out of its bounds; the message names the setting."""


@dataclass(frozen=True)
class ProcessSettings:
    """How engine processes are started, waited for and stopped."""

    # A tiny CPU model loads in a few seconds; a real one on a laptop can take minutes.
    ready_timeout_s: float = 180.0
    # /health is cheap; 0.2 s keeps a cold start's added latency small without busy-polling.
    health_poll_interval_s: float = 0.2
    health_request_timeout_s: float = 2.0
    # Longest wait for a draining replica's in-flight requests before SIGTERM anyway.
    drain_wait_s: float = 120.0
    # After SIGTERM the engine finishes in-flight work itself; past this it is killed.
    term_grace_s: float = 30.0
    # A replica that dies or never gets ready is restarted after a backoff doubling up to this.
    restart_backoff_max_s: float = 30.0
    restart_backoff_initial_s: float = 0.5
    # A port taken between picking and binding shows up as a start failure; retried this often.
    start_attempts: int = 3

    def __post_init__(self) -> None:
        _positive(self, "ready_timeout_s", "health_poll_interval_s", "health_request_timeout_s")
        _positive(self, "drain_wait_s", "term_grace_s", "restart_backoff_max_s", "restart_backoff_initial_s")
        if not 1 <= self.start_attempts <= 20:
            raise LocalSettingsError(f"start_attempts must be in [1, 20], got {self.start_attempts}")


def for_longest_request(settings: ProcessSettings, max_request_s: float | None) -> ProcessSettings:
    """A deployment that allows requests of ``max_request_s`` (``engine.maxRequestSeconds``) drains
    that long before SIGTERM, as its pods' grace period does in a cluster; unset: the settings' own."""
    if max_request_s is None:
        return settings
    return replace(settings, drain_wait_s=float(max_request_s))


@dataclass(frozen=True)
class LocalSettings:
    """Everything ``kvfleet local up`` needs besides the manifests."""

    host: str = "127.0.0.1"
    router_port: int = 8000
    # The status endpoint `kvfleet local status` reads; 0 picks a free port and writes it to state_dir.
    status_port: int = 8099
    state_dir: Path = Path(".kvfleet/local")
    # How often the autoscaler decides and the view refreshes.
    tick_s: float = 1.0
    # Metrics: None reads the engines directly; a URL queries that Prometheus.
    prometheus_url: str | None = None
    # Start the Debian prometheus binary scraping the router and engines.
    with_prometheus: bool = False
    prometheus_port: int = 0
    prometheus_scrape_interval_s: float = 1.0
    prometheus_binary: str = "prometheus"
    processes: ProcessSettings = field(default_factory=ProcessSettings)

    def __post_init__(self) -> None:
        for name in ("router_port", "status_port", "prometheus_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise LocalSettingsError(f"{name} must be a TCP port in [0, 65535], got {value}")
        low, high = TICK_INTERVAL_BOUNDS_S  # the autoscaler's own bound: local mode runs its loop
        if not low <= self.tick_s <= high:
            raise LocalSettingsError(f"tick_s must be in [{low}, {high}], got {self.tick_s}")
        if not 0.2 <= self.prometheus_scrape_interval_s <= 60:
            raise LocalSettingsError(
                f"prometheus_scrape_interval_s must be in [0.2, 60], got {self.prometheus_scrape_interval_s}"
            )
        if self.prometheus_url is not None and self.with_prometheus:
            raise LocalSettingsError("give either prometheus_url (an existing Prometheus) or with_prometheus, not both")
        if self.prometheus_url is not None and not self.prometheus_url.startswith(("http://", "https://")):
            raise LocalSettingsError(f"prometheus_url must be an http(s) URL, got {self.prometheus_url!r}")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise LocalSettingsError(f"{name} must be > 0, got {value}")
