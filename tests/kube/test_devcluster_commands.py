"""The dev cluster's command lines (pure): the controllers' client rate comes from ClusterSettings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvfleet.devcluster.commands import component_argv, kwok_configuration
from kvfleet.devcluster.pki import make_pki
from kvfleet.devcluster.settings import ClusterSettings

PORTS = {
    name: 20000 + i
    for i, name in enumerate(
        ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kwok-node")
    )
}


@pytest.fixture
def settings(tmp_path: Path) -> ClusterSettings:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return ClusterSettings(root=tmp_path / "cluster", bin_dir=bin_dir)


def rate_flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith(("--kube-api-qps", "--kube-api-burst"))]


def test_controllers_send_at_the_settings_rate_and_kubernetes_defaults_at_zero(
    settings: ClusterSettings, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path / "pki", service_ip="10.96.0.1")
    argv = component_argv(settings, pki, PORTS, tmp_path / "kubeconfig")
    for component in ("kube-controller-manager", "kube-scheduler"):
        assert rate_flags(argv[component]) == ["--kube-api-qps=200", "--kube-api-burst=400"], component
    assert rate_flags(argv["kwok"]) == []
    defaults = component_argv(dataclasses.replace(settings, controllers_api_qps=0), pki, PORTS, tmp_path / "kc")
    assert rate_flags(defaults["kube-controller-manager"]) == rate_flags(defaults["kube-scheduler"]) == []


def test_kwok_plays_the_settings_pod_stages_at_once(settings: ClusterSettings, tmp_path: Path) -> None:
    argv = component_argv(settings, make_pki(tmp_path / "pki", service_ip="10.96.0.1"), PORTS, tmp_path / "kc")
    assert f"--config={settings.root / 'kwok-config.yaml'}" in argv["kwok"]
    options = kwok_configuration(settings)["options"]
    assert isinstance(options, dict) and options["podPlayStageParallelism"] == 32
