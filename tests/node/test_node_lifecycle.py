"""`kvfleet dev cluster up --real-node`: a pod really runs on the node: a process in the kubelet's
cgroup, its image from containerd, logs and exec through the API server, a readiness probe over the
pod network, a ClusterIP Service through kube-proxy's rules. (`down` leaving nothing behind is
checked by the ``real_node`` fixture's teardown.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.real_cluster import wait_for
from support.real_node import RealNodeCluster

from kvfleet.devcluster.controlplane import ClusterSettings, ControlPlane
from kvfleet.devcluster.realnode import cgroups, images
from kvfleet.devcluster.realnode.binaries import ensure_coredns
from kvfleet.devcluster.realnode.settings import NODE_NAME, NodeError, NodeSettings

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static: one static binary, an image of one file
IMAGE = "kvfleet.local/busybox:1"


def web_pod(namespace: str) -> list[dict[str, object]]:
    script = (
        "/bin/busybox echo started $(/bin/busybox hostname); "
        "/bin/busybox echo hello-from-$(/bin/busybox hostname) > /www/index.html; "
        "exec /bin/busybox httpd -f -p 8080 -h /www"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "namespace": namespace, "labels": {"app": "web"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE_NAME},
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534},
            "containers": [
                {
                    "name": "web",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/busybox", "sh", "-c", script],
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/index.html", "port": 8080}, "periodSeconds": 1},
                    "resources": {"limits": {"cpu": "100m", "memory": "32Mi"}},
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "www", "mountPath": "/www"}],
                }
            ],
            "volumes": [{"name": "www", "emptyDir": {}}],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    return [pod, service]


def test_a_pod_really_runs(real_node: RealNodeCluster) -> None:
    kubectl = real_node.kubectl
    nodes = {n["metadata"]["name"]: n for n in kubectl.json("get", "nodes")["items"]}
    info = nodes[NODE_NAME]["status"]["nodeInfo"]
    assert info["kubeletVersion"].startswith("v1.36.") and info["containerRuntimeVersion"].startswith("containerd://")
    # The kwok node stays, tainted: pods land on it only when they ask to.
    assert nodes["kwok-gpu-0"]["spec"]["taints"][0]["key"] == "kvfleet.io/kwok"

    images.import_image(real_node.socket, images.files_image(IMAGE, {"/bin/busybox": BUSYBOX}, ["/bin/busybox"]))
    kubectl("create", "namespace", "smoke")
    wait_for(lambda: kubectl.get("serviceaccount", "default", "smoke"), 60, "the default ServiceAccount")
    kubectl.apply(web_pod("smoke"))
    kubectl("wait", "-n", "smoke", "--for=condition=Ready", "pod/web", "--timeout=120s", timeout_s=130)
    pod = kubectl.json("get", "pod", "web", "-n", "smoke")
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert pod["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")
    assert pod["status"]["podIP"].startswith("10.88.")
    # The kubelet's streaming through the API server: logs and exec.
    assert "started web" in kubectl("logs", "-n", "smoke", "web")
    cgroup_root = f"/kvfleet-{real_node.node['cluster_id']}"
    assert f"{cgroup_root}/kubepods" in kubectl(
        "exec", "-n", "smoke", "web", "--", "/bin/busybox", "cat", "/proc/self/cgroup"
    )
    # A real process on this machine, in the kubelet's cgroup root.
    assert cgroups.processes(cgroup_root)
    # Pod to Service to pod (itself, through the bridge's hairpin), by kube-proxy's rules.
    cluster_ip = kubectl.json("get", "service", "web", "-n", "smoke")["spec"]["clusterIP"]
    body = kubectl("exec", "-n", "smoke", "web", "--", "/bin/busybox", "wget", "-qO-", f"http://{cluster_ip}/")
    assert body.strip() == "hello-from-web"
    # The same Service by name, through the node's cluster DNS: the resolv.conf the kubelet wrote
    # (the node address, the namespace's search path), a fully qualified name and one completed by
    # the search path ("web" alone is the pod's own hostname in its /etc/hosts).
    resolv = kubectl("exec", "-n", "smoke", "web", "--", "/bin/busybox", "cat", "/etc/resolv.conf")
    assert f"nameserver {NodeSettings.node_ip}" in resolv and "search smoke.svc.cluster.local" in resolv, resolv
    answer = kubectl("exec", "-n", "smoke", "web", "--", "/bin/busybox", "nslookup", "web.smoke.svc.cluster.local")
    assert cluster_ip in answer, answer
    for name in ("web.smoke", "web.smoke.svc"):
        body = kubectl("exec", "-n", "smoke", "web", "--", "/bin/busybox", "wget", "-qO-", f"http://{name}/")
        assert body.strip() == "hello-from-web", name
    # A name that is no Service does not resolve (NXDOMAIN, not a hang).
    missing = kubectl.run(
        "exec", "-n", "smoke", "web", "--", "/bin/busybox", "nslookup", "nope.smoke.svc.cluster.local"
    )
    assert missing.returncode != 0 and "NXDOMAIN" in missing.stdout, missing.stdout
    print(f"real node up in {real_node.started_s:.1f} s")


def test_a_failed_start_leaves_nothing(node_binaries: tuple[Path, Path], tmp_path: Path) -> None:
    """The kubelet exits at once: `up` fails naming it, and every process it had started (control
    plane, containerd, the cluster DNS, kube-proxy, the namespace holder, the forwarder) is gone,
    with the cgroups."""
    k8s_bin, node_bin = node_binaries
    broken = tmp_path / "bin"
    broken.mkdir()
    for name in ("kube-proxy", "crictl", "pause"):
        (broken / name).symlink_to(node_bin / name)
    (broken / "kubelet").write_text("#!/bin/sh\necho 'kubelet: refusing to start (test)' >&2\nexit 3\n")
    (broken / "kubelet").chmod(0o755)
    settings = ClusterSettings(
        root=tmp_path / "dev", bin_dir=k8s_bin, gpu_nodes=1, node_bin_dir=broken, coredns=ensure_coredns(quiet=True)
    )
    plane = ControlPlane(settings)
    with pytest.raises(NodeError, match="kubelet exited with status 3") as failure:
        plane.start()
    assert "refusing to start (test)" in str(failure.value)
    cluster_ids = [p.name for h in cgroups.hierarchies() for p in h.glob("kvfleet-*")]
    assert plane._node is not None
    assert f"kvfleet-{plane._node.settings.cluster_id}" not in cluster_ids
    assert not [n for n, proc in plane._node.procs.items() if proc.poll() is None]
    assert plane.state is None
    # Every control-plane process named the cluster's folder on its command line: none is left.
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(tmp_path).encode() in (entry / "cmdline").read_bytes():
                    left.append(entry.name)
            except OSError:
                continue
    assert not left
