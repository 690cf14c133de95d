"""The real Kubernetes control plane for the ``k8s``-marked tests: etcd, kube-apiserver (client
certificates, service-account tokens, RBAC, audit log), kube-controller-manager, kube-scheduler and
kwok GPU nodes, built from Go modules by tools/k8s/build.sh (scripts/bootstrap runs it).

One control plane per test session; each test works in a namespace of its own. Outside CI a test
skips with the reason when the binaries could not be built; under CI (``CI=true``) that fails.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from support.real_cluster import ComponentProcess, Kubectl, operator_process, wait_for

from kvfleet.devcluster.binaries import ensure_binaries
from kvfleet.devcluster.controlplane import ClusterSettings, ControlPlane, ControlPlaneError

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "inferencedeployments.kvfleet.io.yaml"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    try:
        bin_dir = ensure_binaries(quiet=True)
    except ControlPlaneError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the control plane could not be built under CI: {e}")
        pytest.skip(f"no control plane binaries (run tools/k8s/build.sh): {e}")
    plane = ControlPlane(ClusterSettings(root=tmp_path_factory.mktemp("k8s"), bin_dir=bin_dir))
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane) -> Kubectl:
    return Kubectl(control_plane.kubeconfig)


@pytest.fixture(scope="session")
def helm_binary(control_plane: ControlPlane) -> Path:
    return control_plane.settings.bin_dir / "helm"


@pytest.fixture(scope="session")
def crd_installed(kubectl: Kubectl) -> None:
    # --force-conflicts: the chart test may have installed it first, with helm as its manager.
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=kvfleet-tests", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/inferencedeployments.kvfleet.io", "--timeout=60s")
    # The CRD's OpenAPI is published a moment after Established; explain and apply need it.
    wait_for(lambda: kubectl.run("explain", "infd.spec").returncode == 0, 60, "the CRD's OpenAPI to be served")


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    wait_for(lambda: kubectl.get("serviceaccount", "default", name), 30, f"the default ServiceAccount in {name}")
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def start_operator(
    control_plane: ControlPlane, crd_installed: None, tmp_path: Path
) -> Iterator[Callable[..., ComponentProcess]]:
    started: list[ComponentProcess] = []

    def start(*extra: str, kubeconfig: Path | None = None, name: str = "operator") -> ComponentProcess:
        proc = operator_process(kubeconfig or control_plane.kubeconfig, tmp_path / f"{name}.log", *extra).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def monitoring_crds(control_plane: ControlPlane, kubectl: Kubectl) -> None:
    """The Prometheus Operator's own ServiceMonitor and PrometheusRule CRDs (tools/k8s/build.sh)."""
    crds = control_plane.settings.bin_dir.parent / "crds"
    kubectl("apply", "--server-side", "-f", str(crds))
    for path in crds.glob("*.yaml"):
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
