"""The real node's configuration, pure (kvfleet.devcluster.realnode): what containerd, the kubelet,
kube-proxy and the API server are told, checked without starting anything."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvfleet.devcluster.pki import Pki
from kvfleet.devcluster.realnode.cgroups import hierarchies
from kvfleet.devcluster.realnode.config import (
    containerd_config,
    coredns_rbac,
    corefile,
    holder_plan,
    kube_proxy_config,
    kubelet_config,
    node_argv,
)
from kvfleet.devcluster.realnode.forward import Route
from kvfleet.devcluster.realnode.settings import DNS_USER, NodeError, NodeSettings
from kvfleet.devcluster.realnode.wiring import with_real_node


def settings(tmp_path: Path) -> NodeSettings:
    return NodeSettings(root=tmp_path / "node", bin_dir=tmp_path / "bin", cluster_id="abc123")


def test_containerd_config_is_toml_with_the_settings_pods_need(tmp_path: Path) -> None:
    s = settings(tmp_path)
    doc = tomllib.loads(containerd_config(s))
    cri = doc["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True  # without it every pod fails on this kind of machine
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert doc["grpc"]["address"] == str(s.containerd_socket)
    # Every path containerd writes is the node's own.
    assert all(str(v).startswith(str(s.root)) for v in (doc["root"], doc["state"], cri["cni"]["conf_dir"]))


def test_kubelet_and_kube_proxy_leave_the_host_alone(tmp_path: Path) -> None:
    s = settings(tmp_path)
    kubelet = kubelet_config(s, tmp_path / "ca.crt")
    assert kubelet["cgroupRoot"] == "/kvfleet-abc123"
    assert (kubelet["cgroupDriver"], kubelet["failCgroupV1"], kubelet["failSwapOn"]) == ("cgroupfs", False, False)
    assert kubelet["makeIPTablesUtilChains"] is False
    assert kubelet["authentication"]["anonymous"]["enabled"] is False
    # Imported images are never garbage-collected (the pause image among them: nothing re-pulls it).
    assert kubelet["imageGCHighThresholdPercent"] == 100
    proxy = kube_proxy_config(s, tmp_path / "kc")
    assert proxy["conntrack"]["maxPerCore"] == 0  # the host's conntrack table is not ours to size
    plan = holder_plan(s)
    assert set(plan["private_dirs"]) == {"/var/lib", "/var/log", "/run"}
    assert all(source.startswith(str(s.root)) for source in plan["private_dirs"].values())
    assert plan["sysctls"]["/proc/sys/vm/overcommit_memory"] == "1"


def test_pods_resolve_through_the_node_s_coredns_only_when_it_runs(tmp_path: Path) -> None:
    bare = settings(tmp_path)
    assert kubelet_config(bare, tmp_path / "ca.crt")["clusterDNS"] == []
    assert "coredns" not in node_argv(
        bare,
        {k: tmp_path / k for k in ("containerd", "kubelet", "kube-proxy")}
        | {"kubelet-kubeconfig": tmp_path / "kk", "corefile": tmp_path / "Corefile"},
    )
    s = NodeSettings(
        root=tmp_path / "node", bin_dir=tmp_path / "bin", cluster_id="abc123", coredns=tmp_path / "coredns"
    )
    assert kubelet_config(s, tmp_path / "ca.crt")["clusterDNS"] == ["10.99.0.1"]
    conf = corefile(s, tmp_path / "coredns.kubeconfig")
    assert "bind 10.99.0.1" in conf and f"kubeconfig {tmp_path / 'coredns.kubeconfig'}" in conf
    assert "kubernetes cluster.local in-addr.arpa ip6.arpa" in conf
    assert "forward" not in conf  # nothing upstream is reachable from the namespace
    files = {k: tmp_path / k for k in ("containerd", "kubelet", "kube-proxy", "kubelet-kubeconfig", "corefile")}
    assert node_argv(s, files)["coredns"] == [str(tmp_path / "coredns"), "-conf", str(tmp_path / "corefile")]
    # Read-only: list and watch of what it serves, bound to its own user.
    (_, role), (_, binding) = coredns_rbac()
    assert {v for rule in role["rules"] for v in rule["verbs"]} == {"list", "watch"}
    assert binding["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DNS_USER}]


def test_the_api_server_serves_the_node_and_authorizes_kubelets(tmp_path: Path) -> None:
    pki = Pki(*(tmp_path / n for n in ("ca", "cak", "s", "sk", "admin.crt", "admin.key", "sa", "sap")))
    argv = {"kube-apiserver": ["kube-apiserver", "--bind-address=127.0.0.1", "--authorization-mode=RBAC"]}
    api = with_real_node(argv, settings(tmp_path), pki)["kube-apiserver"]
    assert [a for a in api if a.startswith("--bind-address")] == ["--bind-address=0.0.0.0"]
    assert "--authorization-mode=Node,RBAC" in api and "--authorization-mode=RBAC" not in api
    assert "--advertise-address=10.99.0.1" in api
    assert f"--kubelet-client-certificate={tmp_path / 'admin.crt'}" in api


def test_bad_input_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(NodeError, match="cluster_id"):
        NodeSettings(root=tmp_path, bin_dir=tmp_path, cluster_id="a/b")
    with pytest.raises(NodeError, match="root /run/x must not be under /run"):
        NodeSettings(root=Path("/run/x"), bin_dir=tmp_path, cluster_id="a")
    with pytest.raises(ValueError, match="HOSTPORT=ADDR:PORT"):
        Route.parse("8080")
    assert Route.parse("8080=service:ns/web:80") == Route(8080, "service:ns/web:80")


def test_cgroup_hierarchies_v1_and_v2() -> None:
    mounts = (
        "cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n"
        "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
    )
    assert hierarchies(mounts) == [Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/unified")]
