"""The chart's RBAC on a real API server with `--authorization-mode=RBAC`: the operator, the router and
the autoscaler run as local processes with tokens of the chart's own ServiceAccounts through a whole
lifecycle (create, scale from zero on a request, delete) and get no 403; then each rule is removed in
turn and the requests the components really made (from the API server's audit log) show which
operation each rule allows that nothing else does, so every rule is proven needed."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.real_cluster import BIN, ComponentProcess, Kubectl, audit_entries, condition, wait_for

from kvfleet.devcluster.controlplane import ControlPlane, kubeconfig_document
from kvfleet.free_port import pick_free_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
RELEASE_NS = "kvfleet-system"
COMPONENTS = ("kvfleet-operator", "kvfleet-router", "kvfleet-autoscaler")


@dataclass(frozen=True)
class Op:
    """One request a component made, as RBAC sees it."""

    verb: str
    group: str
    resource: str  # with its subresource: inferencedeployments/status
    namespace: str


def ops_of(entries: list[dict[str, Any]], user: str, since: str) -> set[Op]:
    found = set()
    for e in entries:
        if e.get("user", {}).get("username") != user or e.get("requestReceivedTimestamp", "") < since:
            continue
        ref = e.get("objectRef")
        if not ref or not ref.get("resource"):
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        found.add(Op(e["verb"], ref.get("apiGroup", ""), resource, ref.get("namespace", "")))
    return found


def forbidden(entries: list[dict[str, Any]], users: set[str], since: str) -> list[str]:
    return [
        f"{e['user']['username']} {e['verb']} {e.get('requestURI')}"
        for e in entries
        if e.get("user", {}).get("username") in users
        and e.get("requestReceivedTimestamp", "") >= since
        # RBAC's own refusals (a 403 for a namespace being deleted is admission's, not RBAC's).
        and (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"
    ]


def can(kubectl: Kubectl, user: str, op: Op) -> bool:
    """A SubjectAccessReview, answered by the API server's RBAC authorizer."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{RELEASE_NS}", "system:authenticated"],
            "resourceAttributes": {
                "verb": op.verb,
                "group": op.group,
                "resource": op.resource.split("/")[0],
                "subresource": op.resource.split("/")[1] if "/" in op.resource else "",
                "namespace": op.namespace,
            },
        },
    }
    out = kubectl("create", "-o", "json", "-f", "-", stdin=json.dumps(review))
    return bool(json.loads(out)["status"].get("allowed"))


def token_kubeconfig(kubectl: Kubectl, control_plane: ControlPlane, sa: str, folder: Path) -> Path:
    token = kubectl("create", "token", sa, "-n", RELEASE_NS, "--duration=1h").strip()
    token_file = folder / f"{sa}.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    path = folder / f"{sa}.kubeconfig"
    assert control_plane.state is not None
    path.write_text(
        kubeconfig_document(
            control_plane.state.server, control_plane.pki.ca_cert, {"tokenFile": str(token_file)}, name=sa
        )
    )
    return path


def helm(control_plane: ControlPlane, folder: Path, *args: str) -> str:
    env = {
        **os.environ,
        **{k: str(folder / k.lower()) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")},
    }
    result = subprocess.run(
        [str(control_plane.settings.bin_dir / "helm"), "--kubeconfig", str(control_plane.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def chart_rbac(
    control_plane: ControlPlane,
    kubectl: Kubectl,
    crd_installed: None,
    monitoring_crds: None,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[dict[str, Any]]:
    """The chart installed for its ServiceAccounts and RBAC (its pods are kwok's, not ours)."""
    values: dict[str, Any] = dict(request.param)
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    for ns in (values.get("scope") or {}).get("namespaces") or []:
        if kubectl.get("namespace", ns) is None:
            kubectl("create", "namespace", ns)
    helm(
        control_plane,
        tmp_path,
        "install",
        "kvfleet",
        str(CHART),
        "-n",
        RELEASE_NS,
        "--create-namespace",
        "-f",
        str(values_file),
        "--skip-crds",
    )
    yield values
    helm(control_plane, tmp_path, "uninstall", "kvfleet", "-n", RELEASE_NS, "--wait")


def lease_args(values: dict[str, Any]) -> list[str]:
    """The autoscaler's leader-election flags as the chart renders them for these values: a Lease
    only with replicas > 1 (charts/kvfleet/templates/autoscaler.yaml)."""
    if int((values.get("autoscaler") or {}).get("replicas", 1)) <= 1:
        return ["--no-leader-election"]
    return ["--leader-election", "--identity", "test-autoscaler", "--lease-namespace", RELEASE_NS]


def lifecycle(
    control_plane: ControlPlane,
    kubectl: Kubectl,
    folder: Path,
    namespace: str,
    scope_args: list[str],
    autoscaler_lease_args: list[str],
) -> None:
    """Operator, router and autoscaler as the chart's ServiceAccounts: create, wake from zero, delete."""
    kc = {sa: token_kubeconfig(kubectl, control_plane, sa, folder) for sa in COMPONENTS}
    # A Lease left by an earlier run would spare the autoscaler its create.
    kubectl("delete", "lease", "kvfleet-autoscaler", "-n", RELEASE_NS, "--ignore-not-found")
    autoscaler_port, router_port = pick_free_port(), pick_free_port()
    # The wake token the chart generated, as its Secret volume would give it to both pods.
    secret = kubectl.json("get", "secret", "kvfleet-wake-token", "-n", RELEASE_NS)
    wake_token = folder / "wake-token"
    wake_token.write_bytes(base64.b64decode(secret["data"]["token"]))
    bin_kvfleet = str(BIN / "kvfleet")
    procs = [
        ComponentProcess(
            [bin_kvfleet, "operator", "run", "--resync-interval-s", "2", *scope_args],
            kc["kvfleet-operator"],
            folder / "operator.log",
        ),
        ComponentProcess(
            [
                bin_kvfleet,
                "autoscaler",
                "run",
                "--prometheus-url",
                "http://127.0.0.1:9",
                "--tick-interval-s",
                "1",
                "--listen-host",
                "127.0.0.1",
                "--listen-port",
                str(autoscaler_port),
                *autoscaler_lease_args,
                "--wake-token-file",
                str(wake_token),
                "--kubeconfig",
                str(kc["kvfleet-autoscaler"]),
                *(["--namespace", namespace] if scope_args else []),
            ],
            kc["kvfleet-autoscaler"],
            folder / "autoscaler.log",
        ),
        ComponentProcess(
            [
                bin_kvfleet,
                "router",
                "serve",
                "--kubernetes",
                "--kubeconfig",
                str(kc["kvfleet-router"]),
                "--port",
                str(router_port),
                "--autoscaler-url",
                f"http://127.0.0.1:{autoscaler_port}",
                "--wake-token-file",
                str(wake_token),
                # As the chart runs it with router.kvEvents: subscribe where a slice names kv-events.
                "--kv-events-port=5557",
                "--kv-events-announced-only",
                *(["--namespace", namespace] if scope_args else []),
            ],
            kc["kvfleet-router"],
            folder / "router.log",
        ),
    ]
    for proc in procs:
        proc.start()
    try:
        doc = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
        doc["metadata"] = {"name": "life", "namespace": namespace}
        kubectl.apply(doc, "--server-side", "--field-manager=alice")
        wait_for(
            lambda: (condition(kubectl.get("infd", "life", namespace), "ScaledToZero") or {}).get("status") == "True",
            60,
            "ScaledToZero",
        )
        # A request for the model wakes it: the router holds it and signals the autoscaler, which
        # writes status.desiredReplicas; the operator scales; kwok makes the pod Ready; the router
        # sees it through the EndpointSlice.
        import urllib.request

        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{router_port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        wait_for(lambda: _ready(router_port), 30, "the router to listen")
        # The kwok pod has no engine behind its IP: the answer itself fails, the wake does not.
        with contextlib.suppress(OSError):
            urllib.request.urlopen(request, timeout=15)
        wait_for(
            lambda: (kubectl.get("infd", "life", namespace) or {}).get("status", {}).get("readyReplicas") == 1,
            60,
            "woken to one Ready replica",
        )
        # The router found the replica through the real EndpointSlice (named by its pod).
        pod = kubectl.json("get", "pods", "-n", namespace, "-l", "kvfleet.io/deployment=life")["items"][0]
        pod_name = pod["metadata"]["name"]
        replica = f'kvfleet_router_inflight{{model="tiny",namespace="{namespace}",replica="{pod_name}"}}'
        wait_for(lambda: replica in _metrics(router_port), 30, f"the router to know {replica}")
        # The engine Service names its kv-events port, the real EndpointSlice controller copies it into
        # the slice, and the router subscribed there (no engine answers behind a kwok pod's IP).
        service = kubectl.json("get", "service", "life-engine", "-n", namespace)
        assert {"name": "kv-events", "port": 5557, "protocol": "TCP", "targetPort": "kv-events"} in service["spec"][
            "ports"
        ]
        subscribed = f'kvfleet_router_kv_event_subscriptions{{model="tiny",namespace="{namespace}"}} 1.0'
        wait_for(lambda: subscribed in _metrics(router_port), 30, "the router to subscribe to the replica's events")
        kubectl("delete", "infd", "life", "-n", namespace, "--timeout=60s")
        time.sleep(3)  # the router and autoscaler see the deletion
    finally:
        for p in procs:
            p.stop()


def _metrics(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def _ready(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status in (200, 503)
    except OSError:
        return False


def _owner(namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    doc["metadata"] = {"name": "owner", "namespace": namespace}
    return dict(doc)


def owned_child_allowed(kubectl: Kubectl, kubeconfig: Path, namespace: str) -> bool:
    owner = kubectl.json("get", "infd", "owner", "-n", namespace)
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned-probe",
            "namespace": namespace,
            "ownerReferences": [
                {
                    "apiVersion": "kvfleet.io/v1alpha1",
                    "kind": "InferenceDeployment",
                    "name": "owner",
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
    }
    as_operator = Kubectl(kubeconfig)
    result = as_operator.run(
        "apply", "--server-side", "--field-manager=kvfleet-operator", "-f", "-", stdin=json.dumps(child)
    )
    if result.returncode == 0:
        kubectl("delete", "configmap", "owned-probe", "-n", namespace)
        return True
    assert "blockOwnerDeletion" in result.stderr or "forbidden" in result.stderr.lower(), result.stderr
    return False


def roles_of(kubectl: Kubectl, values: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(kind, namespace, name) of every Role and ClusterRole the release made."""
    found = []
    for kind in ("clusterrole", "role"):
        for item in kubectl.json("get", kind, "-A", "-l", "app.kubernetes.io/instance=kvfleet")["items"]:
            found.append((kind, item["metadata"].get("namespace", ""), item["metadata"]["name"]))
    return found


SCOPES = [
    # One autoscaler (the chart's default): no leader election, so no Lease rule.
    pytest.param({}, id="cluster"),
    # Two: the Lease, and the Role in the release namespace that grants it.
    pytest.param(
        {"scope": {"mode": "namespace", "namespaces": ["team-a"]}, "autoscaler": {"replicas": 2}}, id="namespace"
    ),
]


@pytest.mark.parametrize("chart_rbac", SCOPES, indirect=True)
def test_chart_rbac_is_sufficient_and_every_rule_is_needed(
    control_plane: ControlPlane, kubectl: Kubectl, chart_rbac: dict[str, Any], tmp_path: Path
) -> None:
    scoped = (chart_rbac.get("scope") or {}).get("mode") == "namespace"
    namespace = "team-a" if scoped else "rbac-life"
    if kubectl.get("namespace", namespace) is None:
        kubectl("create", "namespace", namespace)
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 1))
    scope_args = ["--namespace", namespace] if scoped else []
    lifecycle(control_plane, kubectl, tmp_path, namespace, scope_args, lease_args(chart_rbac))

    folder_kc = {sa: tmp_path / f"{sa}.kubeconfig" for sa in COMPONENTS}
    kubectl.apply(_owner(namespace), "--server-side", "--field-manager=alice")
    assert owned_child_allowed(kubectl, folder_kc["kvfleet-operator"], namespace)
    entries = audit_entries(Path(control_plane.settings.root))
    users = {f"system:serviceaccount:{RELEASE_NS}:{sa}" for sa in COMPONENTS}
    assert forbidden(entries, users, since) == [], "a component was refused"
    ops = {user: ops_of(entries, user, since) for user in users}
    for user, made in ops.items():
        assert made, f"{user} made no request"

    # Remove each rule in turn: some request a component really made must now be refused.
    report = []
    for kind, ns, name in roles_of(kubectl, chart_rbac):
        role = kubectl.json("get", kind, name, *(["-n", ns] if ns else []))
        subjects = {
            f"system:serviceaccount:{s['namespace']}:{s['name']}"
            for b in kubectl.json("get", f"{kind}binding", "-A", "-l", "app.kubernetes.io/instance=kvfleet")["items"]
            if b["roleRef"]["name"] == name
            for s in b.get("subjects", [])
        }
        user = next(iter(subjects & users))
        rules = role["rules"]
        for i, rule in enumerate(rules):
            trimmed = {k: v for k, v in role.items() if k != "status"}
            trimmed["rules"] = rules[:i] + rules[i + 1 :]
            trimmed["metadata"] = {
                k: role["metadata"][k] for k in ("name", "labels", "annotations") if k in role["metadata"]
            }
            if ns:
                trimmed["metadata"]["namespace"] = ns
            kubectl("replace", "-f", "-", stdin=json.dumps(trimmed))
            try:
                if any(r.endswith("/finalizers") for r in rule["resources"]):
                    # Checked by admission, not by a request of its own: a child owned with
                    # blockOwnerDeletion, applied as the operator, must now be refused.
                    allowed = owned_child_allowed(kubectl, folder_kc["kvfleet-operator"], namespace)
                    denied: list[Any] = [] if allowed else ["apply a child with blockOwnerDeletion"]
                else:
                    covered = [
                        op
                        for op in ops[user]
                        if op.group in rule["apiGroups"]
                        and op.resource in rule["resources"]
                        and op.verb in rule["verbs"]
                    ]
                    denied = [op for op in covered if not can(kubectl, user, op)]
            finally:
                restored = {**trimmed, "rules": rules}
                kubectl("replace", "-f", "-", stdin=json.dumps(restored))
            report.append(f"{name} rule {rule['resources']} {rule['verbs']}: denies {sorted(map(str, denied))[:3]}")
    print("\n".join(report))
    assert all("denies []" not in line for line in report), "rules no request needed:\n" + "\n".join(report)
