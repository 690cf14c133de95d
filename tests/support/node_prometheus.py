"""A real Prometheus (Debian's `prometheus`) for the real node, run the way a cluster runs one: in
the node's network namespace (it scrapes pod IPs), its targets discovered from the API server's
EndpointSlices with a ServiceAccount's token and a read-only ClusterRole, and reachable by pods at
the Service the chart's no-monitoring values name (`prometheus-server.monitoring.svc`: a Service
without a selector whose EndpointSlice points at the node address, as for a Prometheus outside
the cluster's pods).

Debian builds Prometheus without its Kubernetes service discovery (`kubernetes_sd_configs` is an
unknown field there), so the discovery is a small loop here that lists Services and EndpointSlices
every 2 s with that token and writes `file_sd_configs` files, which Prometheus watches. The jobs do
what the chart's ServiceMonitors (router, autoscaler: honor_labels, a fixed job name) and the
operator's engine ServiceMonitor (ports http and launcher) ask of the Prometheus Operator, with its
target labels (`namespace`, `pod`, `service`), scraped every 2 s so a test's idle window stays
short. Started and stopped by its PID.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvfleet.contracts import APP_NAME_LABEL, ENGINE_APP
from kvfleet.devcluster.realnode.settings import NodeSettings
from kvfleet.free_port import pick_free_port
from kvfleet_testkit.processes import stop_process
from support.real_node import RealNodeCluster

NAMESPACE = "monitoring"
SERVICE = "prometheus-server"  # charts/kvfleet/ci/no-monitoring-values.yaml's autoscaler.prometheusUrl
PORT = 9090
SCRAPE_INTERVAL = "2s"
START_TIMEOUT_S = 60.0
TOKEN_DURATION = "3h"  # longer than any node suite; Prometheus re-reads the file anyway


@dataclass(frozen=True)
class NodePrometheus:
    url: str  # from the host (a forwarder into the node's namespace)
    in_cluster_url: str  # what pods use

    def query(self, expr: str) -> list[dict[str, Any]]:
        request = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


ENGINE_PORTS = ("http", "launcher")  # operator/render.py's engine ServiceMonitor
COMPONENTS = ("router", "autoscaler")  # the chart's ServiceMonitors, port http


def _job(service: dict[str, Any]) -> tuple[str, tuple[str, ...]] | None:
    """The scrape job a Service's endpoints belong to and the port names scraped, or None."""
    labels = service["metadata"].get("labels") or {}
    if labels.get(APP_NAME_LABEL) == ENGINE_APP:
        return "kvfleet-engines", ENGINE_PORTS
    component = labels.get("app.kubernetes.io/component")
    if labels.get(APP_NAME_LABEL) == "kvfleet" and component in COMPONENTS:
        return f"kvfleet-{component}", ("http",)
    return None


def target_groups(services: list[dict[str, Any]], slices: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """file_sd target groups per job from the cluster's Services and EndpointSlices, labelled as the
    Prometheus Operator labels a ServiceMonitor's targets (namespace, pod, service)."""
    jobs = {(s["metadata"]["namespace"], s["metadata"]["name"]): found for s in services if (found := _job(s))}
    groups: dict[str, list[dict[str, Any]]] = {f"kvfleet-{c}": [] for c in ("engines", *COMPONENTS)}
    for slice_ in slices:
        namespace = slice_["metadata"]["namespace"]
        service = (slice_["metadata"].get("labels") or {}).get("kubernetes.io/service-name", "")
        scraped = jobs.get((namespace, service))
        if scraped is None or slice_.get("addressType") != "IPv4":
            continue
        job, port_names = scraped
        ports = [p["port"] for p in slice_.get("ports") or [] if p.get("name") in port_names]
        for endpoint in slice_.get("endpoints") or []:
            labels = {
                "namespace": namespace,
                "service": service,
                "pod": (endpoint.get("targetRef") or {}).get("name", ""),
            }
            targets = [f"{address}:{port}" for address in endpoint.get("addresses") or [] for port in ports]
            if targets:
                groups[job].append({"targets": targets, "labels": labels})
    return groups


class Discovery:
    """Lists Services and EndpointSlices every ``interval_s`` with the ServiceAccount's token and
    writes each job's file_sd file when it changes (atomically: Prometheus watches the files)."""

    def __init__(self, server: str, ca_file: Path, token: str, folder: Path, interval_s: float = 2.0) -> None:
        self.server, self.token, self.folder, self.interval_s = server, token, folder, interval_s
        self.context = ssl.create_default_context(cafile=str(ca_file))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="prometheus-discovery", daemon=True)
        self.written: dict[str, str] = {}

    def _list(self, path: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(f"{self.server}{path}", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10, context=self.context) as response:
            items: list[dict[str, Any]] = json.loads(response.read())["items"]
            return items

    def refresh(self) -> None:
        groups = target_groups(self._list("/api/v1/services"), self._list("/apis/discovery.k8s.io/v1/endpointslices"))
        for job, found in groups.items():
            text = json.dumps(found, sort_keys=True)
            if self.written.get(job) != text:
                tmp = self.folder / f".{job}.json.tmp"
                tmp.write_text(text)
                tmp.replace(self.file(job))
                self.written[job] = text

    def file(self, job: str) -> Path:
        return self.folder / f"{job}.json"

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                self.refresh()
            except OSError as e:  # the API server restarting: keep the last targets
                print(f"prometheus discovery: {e}", file=sys.stderr)

    def __enter__(self) -> Discovery:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.refresh()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(15)


def scrape_configs(discovery: Discovery) -> list[dict[str, Any]]:
    return [
        {
            "job_name": job,
            # The router's per-model series carry the deployment's namespace as `namespace`.
            "honor_labels": job != "kvfleet-engines",
            "file_sd_configs": [{"files": [str(discovery.file(job))]}],
        }
        for job in ("kvfleet-engines", *(f"kvfleet-{c}" for c in COMPONENTS))
    ]


def _access() -> list[dict[str, Any]]:
    """Its namespace, ServiceAccount and read-only access to what it discovers, and the Service the
    chart's autoscaler reads it at."""
    account = {"kind": "ServiceAccount", "name": "prometheus", "namespace": NAMESPACE}
    role = "kvfleet-node-prometheus"
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus", "namespace": NAMESPACE}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": role},
            "rules": [
                {"apiGroups": [""], "resources": ["services", "pods", "endpoints"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [account],
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": SERVICE, "namespace": NAMESPACE},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": PORT, "protocol": "TCP"}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{SERVICE}-node",
                "namespace": NAMESPACE,
                "labels": {"kubernetes.io/service-name": SERVICE},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [NodeSettings.node_ip], "conditions": {"ready": True}}],
            "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
        },
    ]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextmanager
def node_prometheus(cluster: RealNodeCluster, workdir: Path) -> Iterator[NodePrometheus]:
    workdir.mkdir(parents=True, exist_ok=True)
    cluster.kubectl.apply(_access())
    token = cluster.kubectl("create", "token", "prometheus", "-n", NAMESPACE, f"--duration={TOKEN_DURATION}").strip()
    discovery = Discovery(cluster.state.server, Path(cluster.root) / "pki" / "ca.crt", token, workdir / "targets")
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": scrape_configs(discovery),
    }
    config_file = workdir / "prometheus.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    netns = f"/proc/{cluster.state.pids['netns']}/ns/net"
    listen = f"{NodeSettings.node_ip}:{PORT}"
    host_port = pick_free_port()
    logs = cluster.root / "logs"
    with discovery, (logs / "prometheus.log").open("ab") as log, (logs / "prometheus-forward.log").open("ab") as flog:
        prometheus = subprocess.Popen(
            [
                *("nsenter", f"--net={netns}", "--"),
                "prometheus",
                f"--config.file={config_file}",
                f"--web.listen-address={listen}",
                f"--storage.tsdb.path={workdir / 'data'}",
                "--storage.tsdb.retention.time=3h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        forward = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.devcluster.realnode.forward", f"--netns={netns}", f"{host_port}={listen}"],
            stdout=flog,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{host_port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _ready(url):
                if prometheus.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"prometheus did not start: {(logs / 'prometheus.log').read_text()[-2000:]}")
                time.sleep(0.5)
            yield NodePrometheus(url, f"http://{SERVICE}.{NAMESPACE}.svc")
        finally:
            stop_process(forward, grace_s=10)
            stop_process(prometheus, grace_s=15)
