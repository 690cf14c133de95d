"""Real local servers for the autoscaler's tests: a metrics endpoint whose values the test sets,
the Prometheus binary scraping it, and KMock as the Kubernetes API."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kmock
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfleet.kube.client import KubeClient
from kvfleet_testkit.kmock_resources import register_inference_deployments
from tests.conftest import pick_free_port

MODEL = "tiny-chat"


@dataclass
class MetricsEndpoint:
    """vLLM-named engine metrics and kvfleet router metrics for one model, set by the test."""

    url: str
    port: int
    running: Gauge
    waiting: Gauge
    kv: Gauge
    ttft: Histogram
    queue: Gauge
    inflight: Gauge
    requests: Counter
    server: Any
    stopped: bool = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.shutdown()
            self.server.server_close()


def serve_text_format(registry: CollectorRegistry, port: int) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """/metrics in the Prometheus text format, always.

    prometheus_client's own server (0.26) answers Prometheus' OpenMetrics Accept header with names
    escaped to underscores (``vllm:num_requests_running`` becomes ``vllm_num_requests_running``);
    engines serve the text format, and so does this endpoint.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def metrics_endpoint() -> Iterator[MetricsEndpoint]:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "running", ["model_name"], registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=registry)
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name"], registry=registry)
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "ttft",
        ["model_name"],
        buckets=(0.1, 0.25, 0.5, 1.0, 2.5),
        registry=registry,
    )
    # The router's labels (namespace: the deployment's); engines get theirs from the scrape target.
    queue = Gauge("kvfleet_router_queue_depth", "queue", ["namespace", "model"], registry=registry)
    inflight = Gauge("kvfleet_router_inflight", "inflight", ["namespace", "model", "replica"], registry=registry)
    requests = Counter("kvfleet_router_requests", "requests", ["namespace", "model", "code"], registry=registry)
    port = pick_free_port()
    server, thread = serve_text_format(registry, port)
    endpoint = MetricsEndpoint(
        f"http://127.0.0.1:{port}", port, running, waiting, kv, ttft, queue, inflight, requests, server
    )
    try:
        yield endpoint
    finally:
        endpoint.stop()
        thread.join(timeout=5)


@dataclass
class PrometheusServer:
    url: str
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def scrape_job(job: str, port: int, namespace: str, *, honor_labels: bool) -> str:
    """One scrape job as the Prometheus Operator writes it for a ServiceMonitor: the target's
    ``namespace`` label, and honor_labels where the ServiceMonitor sets honorLabels (the router's)."""
    return (
        f"  - job_name: {job}\n    honor_labels: {str(honor_labels).lower()}\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{port}']\n        labels: {{namespace: {namespace}}}\n"
    )


def start_prometheus(tmp_path: Path, scrape_port: int, jobs: str | None = None) -> PrometheusServer:
    """Prometheus scraping every second: ``jobs`` (scrape_job lines), or the one endpoint of a
    deployment in namespace default that serves both engine and router series."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus binary is missing: run scripts/bootstrap (Debian package 'prometheus')")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
        + (jobs or scrape_job("kvfleet", scrape_port, "default", honor_labels=True))
    )
    port = pick_free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = PrometheusServer(f"http://127.0.0.1:{port}", process)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return server
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"prometheus did not become ready; log:\n{(tmp_path / 'prometheus.log').read_text()[-2000:]}")
        time.sleep(0.1)


@pytest.fixture
def prometheus(tmp_path: Path, metrics_endpoint: MetricsEndpoint) -> Iterator[PrometheusServer]:
    server = start_prometheus(tmp_path, metrics_endpoint.port)
    try:
        yield server
    finally:
        server.stop()


INFD = "kvfleet.io/v1alpha1/inferencedeployments"
LEASES = "coordination.k8s.io/v1/leases"
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


@dataclass
class Kube:
    emulator: kmock.KubernetesEmulator
    url: str

    def api(self) -> KubeClient:
        return KubeClient.for_server(self.url, timeout_s=5.0)

    def add_deployment(self, name: str, spec: dict[str, Any], status: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            # KMock invents neither uid nor resourceVersion.
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "resourceVersion": "1"},
            "spec": spec,
        }
        if status is not None:
            body["status"] = status
        self.emulator.objects[kmock.resource(INFD), "default", name] = body

    def deployment(self, name: str) -> Any:
        return self.emulator.objects[kmock.resource(INFD), "default", name]

    def lease(self, name: str = "kvfleet-autoscaler") -> Any:
        return self.emulator.objects[kmock.resource(LEASES), "default", name]


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    emulator = kmock.KubernetesEmulator()
    register_inference_deployments(emulator)
    # Not in KMock's bundled list (built-ins v1 and apiregistration only): register it.
    emulator.resources[LEASES] = kmock.ResourceInfo(kind="Lease", singular="lease", namespaced=True, verbs=VERBS)
    async with emulator, kmock.Server(emulator) as server:
        yield Kube(emulator, str(server.url).rstrip("/"))
