"""The control plane's plumbing for a scale run, and kvfleet's components as local processes
with the tokens of the chart's own ServiceAccounts (its RBAC, rendered by the Helm SDK)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfleet.devcluster.controlplane import ControlPlane, kubeconfig_document
from kvfleet.free_port import pick_free_port
from kvfleet.kube import KubeClient, Ref
from kvfleet.kube.watch import ResourceWatch

from .objects import POLICY, now_iso

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CHART = REPO / "charts" / "kvfleet"
RELEASE_NS = "kvfleet-system"
SA = {"operator": "kvfleet-operator", "router": "kvfleet-router", "autoscaler": "kvfleet-autoscaler"}
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def run(argv: list[str], stdin: str | None = None, env: dict[str, str] | None = None, timeout_s: float = 300) -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}...: {result.stderr[-2000:]}")
    return result.stdout


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far; NaN once it is gone (its log says why)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds spent by every process on the machine's cores that a phase is made of: the
    control plane's (API server, etcd, controllers, scheduler, kwok), kvfleet's components, and this
    bench process itself (its watches), so a phase's cost is read beside the floor's, not only its
    latency. ``start`` then ``spent``."""

    def __init__(self, pids: Callable[[], Mapping[str, int]]) -> None:
        self._pids = pids
        self._at: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {name: process_cpu_s(pid) for name, pid in {**self._pids(), "bench": os.getpid()}.items()}

    def start(self) -> None:
        self._at = self._now()

    def spent(self) -> dict[str, float]:
        """CPU seconds per process since ``start`` (routers summed), and ``total``."""
        spent: dict[str, float] = {}
        for name, now in self._now().items():
            before = self._at.get(name)
            if before is None or now != now or before != before:  # NaN: not running through the phase
                continue
            key = "routers" if name.startswith("router-") else name
            spent[key] = spent.get(key, 0.0) + now - before
        spent = {k: round(v, 1) for k, v in spent.items()}
        spent["total"] = round(sum(spent.values()), 1)
        return spent


class Cluster:
    def __init__(self, plane: ControlPlane, folder: Path) -> None:
        self.plane, self.folder = plane, folder
        self.kubectl = [str(BIN / "kubectl"), "--kubeconfig", str(plane.kubeconfig)]
        self.audit = Path(plane.settings.root) / "logs" / "audit.log"

    def control_plane_pids(self) -> dict[str, int]:
        assert self.plane.state is not None
        return dict(self.plane.state.pids)

    def k(self, *args: str, stdin: str | None = None) -> str:
        return run([*self.kubectl, *args], stdin=stdin)

    def install_chart_rbac(self) -> dict[str, Path]:
        """The chart installed for its ServiceAccounts and RBAC (its own pods are kwok's), and a
        kubeconfig with a token of each component's ServiceAccount."""
        bin_dir = self.plane.settings.bin_dir
        self.k("apply", "--server-side", "-f", str(REPO / "crds"))
        self.k("apply", "--server-side", "-f", str(bin_dir.parent / "crds"))
        self.k("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        # The chart rendered by the Helm SDK (helm-python-sdk, in process); only its identities and
        # RBAC are applied: the components run here as processes, not as the chart's pods.
        import helm_python

        with helm_python.Chart.load(str(CHART)) as chart:
            rendered = chart.render(values={}, name="kvfleet", namespace=RELEASE_NS, is_install=True)
        rbac = [
            doc
            for path, text in rendered.items()
            if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text)
            if doc and doc["kind"] in RBAC_KINDS
        ]
        self.k("create", "namespace", RELEASE_NS)
        self.k("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(rbac))
        out = {}
        assert self.plane.state is not None
        for comp, sa in SA.items():
            token = self.k("create", "token", sa, "-n", RELEASE_NS, "--duration=3h").strip()
            (self.folder / f"{sa}.token").write_text(token)
            path = self.folder / f"{sa}.kubeconfig"
            path.write_text(
                kubeconfig_document(
                    self.plane.state.server,
                    self.plane.pki.ca_cert,
                    {"tokenFile": str(self.folder / f"{sa}.token")},
                    name=sa,
                )
            )
            out[comp] = path
        return out


class Component:
    """A kvfleet process; CPU and peak RSS read from /proc."""

    def __init__(self, name: str, argv: list[str], kubeconfig: Path, folder: Path) -> None:
        self.name, self.argv, self.kubeconfig, self.folder = name, argv, kubeconfig, folder
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.started_iso = ""

    def start(self) -> Component:
        with open(self.folder / f"{self.name}.log", "ab") as log:
            self.started_iso, self.started_at = now_iso(), time.monotonic()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
            )
        return self

    def cpu_s(self) -> float:
        assert self.proc is not None
        return process_cpu_s(self.proc.pid)

    def peak_rss_mb(self) -> float:
        """The most resident memory the process has held since it started (VmHWM)."""
        return self._status_mb("VmHWM:")

    def rss_mb(self) -> float:
        """Resident memory now (VmRSS): beside the peak, what is held rather than passed through."""
        return self._status_mb("VmRSS:")

    def _status_mb(self, field_name: str) -> float:
        assert self.proc is not None
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return float("nan")
        for line in status.splitlines():
            if line.startswith(field_name):
                return round(int(line.split()[1]) / 1024, 1)
        return 0.0

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def components(kc: dict[str, Path], folder: Path, autoscaler_port: int) -> dict[str, Component]:
    kvfleet = str(BIN / "kvfleet")
    (folder / "policy.yaml").write_text(yaml.safe_dump(POLICY))

    def router(i: int) -> Component:
        argv = [kvfleet, "router", "serve", "--kubernetes", "--kubeconfig", str(kc["router"])]
        argv += ["--port", str(pick_free_port()), "--autoscaler-url", f"http://127.0.0.1:{autoscaler_port}"]
        return Component(f"router-{i}", argv, kc["router"], folder)

    autoscaler = [kvfleet, "autoscaler", "run", "--prometheus-url", "http://127.0.0.1:9", "--listen-host"]
    # One autoscaler, as the chart runs it by default: no leader election (no Lease, no renewals).
    autoscaler += ["127.0.0.1", "--listen-port", str(autoscaler_port), "--no-leader-election"]
    autoscaler += ["--kubeconfig", str(kc["autoscaler"])]
    return {
        "operator": Component(
            "operator",
            [kvfleet, "operator", "run", "--policy-file", str(folder / "policy.yaml"), "--port", str(pick_free_port())],
            kc["operator"],
            folder,
        ),
        "autoscaler": Component("autoscaler", autoscaler, kc["autoscaler"], folder),
        "router-0": router(0),
        "router-1": router(1),
        "router-2": router(2),
    }


async def until_healthy(c: Component, timeout_s: float) -> float | None:
    """Seconds from the component's start until its /healthz answers 200 (None: it never did)."""
    url = f"http://127.0.0.1:{c.argv[c.argv.index('--port') + 1]}/healthz"
    while time.monotonic() - c.started_at < timeout_s:
        if await asyncio.to_thread(answers_200, url):
            return round(time.monotonic() - c.started_at, 1)
        await asyncio.sleep(0.5)
    return None


def answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def router_port(c: Component) -> int:
    return int(c.argv[c.argv.index("--port") + 1])


def router_replicas(port: int) -> int:
    """How many (model, replica) pairs the router lists (one kvfleet_router_inflight series each)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return -1
    return sum(1 for line in text.splitlines() if line.startswith("kvfleet_router_inflight{"))


# --- reads and writes of many objects ---------------------------------------------------------


async def create_all(
    api: KubeClient, ref: Ref, docs: list[dict], concurrency: int = 32
) -> dict[tuple[str, str], float]:
    """POST every object (bounded concurrency); the monotonic time each was accepted."""
    limit = asyncio.Semaphore(concurrency)
    created: dict[tuple[str, str], float] = {}

    async def one(doc: dict) -> None:
        async with limit:
            meta = doc["metadata"]
            await api.create(ref.collection(meta["namespace"]), doc, field_manager="bench")
            created[(meta["namespace"], meta["name"])] = time.monotonic()

    await asyncio.gather(*(one(d) for d in docs))
    return created


async def list_all(api: KubeClient, ref: Ref, selector: str = "") -> list[dict]:
    items: list[dict] = []
    params = {"limit": "500", **({"labelSelector": selector} if selector else {})}
    while True:
        body = await api.get(ref.collection(None), params)
        items += body.get("items") or []
        cont = (body.get("metadata") or {}).get("continue")
        if not cont:
            return items
        params["continue"] = cont


async def newer_than_now(api: KubeClient, ref: Ref) -> Callable[[dict], bool]:
    """A predicate: the object's generation is past the one it has now (its spec changed since;
    one that does not exist now counts from 0)."""
    before = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d["metadata"].get("generation") or 0
        for d in await list_all(api, ref)
    }

    def newer(d: dict) -> bool:
        m = d["metadata"]
        return (m.get("generation") or 0) > before.get((m["namespace"], m["name"]), 0)

    return newer


async def until_no_pods(api: KubeClient, selector: str, timeout_s: float) -> None:
    """Poll until no pod matches ``selector`` (a deleted set's garbage collected), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and await list_all(api, Ref("v1", "pods"), selector):  # noqa: ASYNC110 (polls the server)
        await asyncio.sleep(2)


async def wait_each(
    api: KubeClient,
    ref: Ref,
    keys: set[tuple[str, str]],
    done: Callable[[dict], bool],
    timeout_s: float,
    selector: str = "",
) -> dict[tuple[str, str], float]:
    """Watch (one LIST, then its events) until ``done`` holds for every key; the first time each
    was seen done. A watch, not a LIST a second: at 1,000 objects polling would cost the 2 cores
    what it measures, and see a change up to a poll late."""
    at: dict[tuple[str, str], float] = {}
    finished = asyncio.Event()
    if not keys:
        return at

    def seen(key: tuple[str, str], obj: Mapping[str, Any] | None) -> None:
        if obj is not None and key in keys and key not in at and done(dict(obj)):
            at[key] = time.monotonic()
            if len(at) == len(keys):
                finished.set()

    watch = ResourceWatch(api, ref.collection(None), seen, label_selector=selector or None)
    task = asyncio.create_task(watch.run())
    try:
        await asyncio.wait_for(finished.wait(), timeout_s)
    except TimeoutError:
        pass  # the caller reports what was not done
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return at


@dataclass
class ScaleRun:
    """What every phase of one scale works with."""

    cluster: Cluster
    admin: KubeClient
    n: int
    window_s: float
    phase_timeout_s: float
    baseline_window_s: float = 0.0
    """The window of the operator reading by GET (the baseline); 0: skipped."""
    kc: dict[str, Path] = field(default_factory=dict)
    procs: dict[str, Component] = field(default_factory=dict)
    valid: set[tuple[str, str]] = field(default_factory=set)
    """The valid InferenceDeployments applied (namespace, name)."""
    floor_change_s: float | None = None
    """How long the floor's change to all took (the change goal is 3x this)."""

    def cpu_meter(self) -> CpuMeter:
        """CPU of the control plane, kvfleet's running components and the bench (``CpuMeter``)."""
        return CpuMeter(
            lambda: {
                **self.cluster.control_plane_pids(),
                **{k: c.proc.pid for k, c in self.procs.items() if c.proc is not None and c.proc.poll() is None},
            }
        )

    @property
    def change_bound_s(self) -> float:
        """The change to all waits until the goal is surely missed (3x the floor's), at least the
        phase bound: a bound below the goal's could only say "not rolled", never met or not."""
        goal_s = 3 * self.floor_change_s if self.floor_change_s else 0.0
        return max(self.phase_timeout_s, goal_s)
