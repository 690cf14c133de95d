"""The chart on a real API server with the helm CLI (built from its Go module): every CI values file
installs (workloads become available on kwok nodes), upgrades and uninstalls cleanly, and its
rendered manifests pass the API server's own dry run."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.real_cluster import Kubectl, wait_for

from kvfleet.devcluster.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
VALUES = sorted((CHART / "ci").glob("*.yaml"))


class Helm:
    def __init__(self, binary: Path, kubeconfig: Path, home: Path) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.binary), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=self.env,
            check=False,
        )

    def __call__(self, *args: str) -> str:
        result = self.run(*args)
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}\n{result.stdout[-2000:]}"
        return result.stdout


@pytest.fixture(scope="module")
def helm(control_plane: ControlPlane, helm_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(helm_binary, control_plane.kubeconfig, tmp_path_factory.mktemp("helm"))


@pytest.fixture
def release_namespace(kubectl: Kubectl) -> Iterator[str]:
    yield "kvfleet-system"
    kubectl.run("delete", "namespace", "kvfleet-system", "--wait=true", "--timeout=60s")
    wait_for(lambda: kubectl.get("namespace", "kvfleet-system") is None, 60, "kvfleet-system gone")


def test_helm_reports_the_servers_version(helm: Helm) -> None:
    out = helm("version", "--short")
    assert out.startswith("v4."), out
    # kubeVersion in Chart.yaml is checked against the server's /version at install: the build's
    # version stamps make it v1.36.x instead of v0.0.0-master.
    with_kube = helm("template", "x", str(CHART), "--validate")
    assert "kind: Deployment" in with_kube


@pytest.mark.parametrize("values", VALUES, ids=[v.stem for v in VALUES])
def test_chart_installs_upgrades_and_uninstalls(
    helm: Helm, kubectl: Kubectl, monitoring_crds: None, release_namespace: str, values: Path
) -> None:
    spec = yaml.safe_load(values.read_text()) or {}
    for ns in (spec.get("scope") or {}).get("namespaces") or []:
        if kubectl.get("namespace", ns) is None:
            kubectl("create", "namespace", ns)

    rendered = helm("template", "kvfleet", str(CHART), "-n", release_namespace, "-f", str(values), "--include-crds")
    if kubectl.get("namespace", release_namespace) is None:
        kubectl("create", "namespace", release_namespace)
    out = kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered)
    assert "(server dry run)" in out
    kubectl("delete", "namespace", release_namespace, "--wait=true", "--timeout=60s")

    # The chart installs the CRD itself; one applied another way first (another test, or a user's
    # `kubectl apply -f crds/`) needs --skip-crds, as the README says: Helm 4 will not take it over.
    crd_there = kubectl.get("crd", "inferencedeployments.kvfleet.io") is not None
    claims = claims_named(rendered)
    for claim in claims:  # the platform's claims the values mount (ha: the routers' tokenizers)
        provide_claim(kubectl, release_namespace, claim)
    helm(
        "install",
        "kvfleet",
        str(CHART),
        "-n",
        release_namespace,
        "--create-namespace",
        "-f",
        str(values),
        *(["--skip-crds"] if crd_there else []),
        "--wait",
        "--timeout",
        "120s",
    )
    assert kubectl.get("crd", "inferencedeployments.kvfleet.io") is not None
    deployments = kubectl.json("get", "deployments", "-n", release_namespace)["items"]
    assert deployments, "the chart installed no Deployment"
    for d in deployments:
        assert d["status"].get("availableReplicas") == d["spec"]["replicas"], d["metadata"]["name"]

    helm(
        "upgrade",
        "kvfleet",
        str(CHART),
        "-n",
        release_namespace,
        "-f",
        str(values),
        "--set",
        "operator.logLevel=debug",
        "--wait",
        "--timeout",
        "120s",
    )
    history = helm("history", "kvfleet", "-n", release_namespace, "-o", "yaml")
    assert [h["status"] for h in yaml.safe_load(history)][-1] == "deployed"
    assert len(yaml.safe_load(history)) == 2

    helm("uninstall", "kvfleet", "-n", release_namespace, "--wait", "--timeout", "120s")
    left = kubectl(
        "get",
        "all,configmaps,serviceaccounts,roles,rolebindings,clusterroles,clusterrolebindings",
        "-A",
        "-l",
        "app.kubernetes.io/instance=kvfleet",
        "-o",
        "name",
    )
    assert left.strip() == "", f"left behind after uninstall:\n{left}"
    for claim in claims:
        kubectl("delete", "pvc", claim, "-n", release_namespace, "--wait=false")
        kubectl("delete", "pv", f"{release_namespace}-{claim}", "--wait=false")


def claims_named(rendered: str) -> list[str]:
    """The PersistentVolumeClaims the rendered pods mount, in order."""
    out: list[str] = []
    for doc in yaml.safe_load_all(rendered):
        pod = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
        for volume in pod.get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and claim not in out:
                out.append(claim)
    return out


def provide_claim(kubectl: Kubectl, namespace: str, claim: str) -> None:
    """A claim bound to a static PersistentVolume, as a platform team provides one: the controller-manager's
    PV controller binds them (no storage driver needed), so the scheduler places the pods that mount it."""
    if kubectl.get("namespace", namespace) is None:
        kubectl("create", "namespace", namespace)
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-{claim}"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": f"/var/lib/kvfleet-test/{claim}"},
            "claimRef": {"namespace": namespace, "name": claim},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": pv["metadata"]["name"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    for doc in (pv, pvc):
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    wait_for(
        lambda: ((kubectl.get("pvc", claim, namespace) or {}).get("status") or {}).get("phase") == "Bound",
        60,
        f"claim {claim} to bind",
    )
