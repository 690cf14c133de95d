"""Fixtures for the chart tests: render the chart with Helm's Go SDK (helm-python-sdk), offline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "kvfleet"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "kvf"
NAMESPACE = "kvfleet-system"

Rendered = dict[str, str]


def load_values(path: Path) -> dict[str, Any]:
    values = yaml.safe_load(path.read_text()) or {}
    assert isinstance(values, dict), f"{path} is not a mapping"
    return values


def render(values: dict[str, Any], namespace: str = NAMESPACE) -> Rendered:
    """Template path -> rendered text, exactly as `helm template` would produce it."""
    with helm_python.Chart.load(str(CHART)) as chart:
        chart.validate_schema(chart.merge_values(values))
        return chart.render(values=values, name=RELEASE, namespace=namespace, is_install=True)


def objects(rendered: Rendered) -> list[dict[str, Any]]:
    """Every Kubernetes object in the rendered manifests (NOTES.txt and empty documents left out)."""
    found = []
    for path, text in sorted(rendered.items()):
        if not path.endswith(".yaml"):
            continue
        found.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return found


@pytest.fixture(scope="session")
def render_ci() -> Callable[[Path], list[dict[str, Any]]]:
    """Render a ci/*-values.yaml once per session (rendering is pure, so caching is safe)."""
    cache: dict[Path, list[dict[str, Any]]] = {}

    def _render(path: Path) -> list[dict[str, Any]]:
        if path not in cache:
            cache[path] = objects(render(load_values(path)))
        return cache[path]

    return _render
