"""A one-context kubeconfig for tests of how kvfleet.kube loads and sends credentials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_kubeconfig(folder: Path, server: str, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "team"}}],
        "current-context": "x",
    }
    path = folder / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path
