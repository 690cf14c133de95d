"""values.yaml documents every key, and values.schema.json types every key and refuses unknown ones."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import yaml

from .conftest import CHART

VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# Values that are Kubernetes objects (validated by the API server) or free-form string maps.
FREE_FORM = re.compile(
    r"(^|\.)(podSecurityContext|containerSecurityContext|affinity|resources|extraEnv|tolerations)$"
    r"|(^|\.)(namespaceSelector|podSelector)$"
    r"|(^|\.)(annotations|labels|podAnnotations|podLabels|nodeSelector|commonLabels|alertLabels)$"
)


def free_form(path: str) -> bool:
    """True for a free-form value or anything inside one."""
    parts = path.split(".")
    return any(FREE_FORM.search(".".join(parts[: i + 1])) for i in range(len(parts)))


def key_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            if not FREE_FORM.search(path):
                yield from key_paths(value, path)


def commented_keys(text: str) -> set[str]:
    """Key paths whose line in values.yaml has a comment line directly above it."""
    documented, stack = set(), []  # stack of (indent, key)
    previous = ""
    for line in text.splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w-]*):", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group(2)))
            if previous.lstrip().startswith("#"):
                documented.add(".".join(k for _, k in stack))
        if line.strip():
            previous = line
    return documented


def schema_node(path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = SCHEMA
    for part in path.split("."):
        node = (node or {}).get("properties", {}).get(part)
    return node


def test_every_key_is_documented() -> None:
    documented = commented_keys(VALUES_TEXT)
    undocumented = []
    for path in key_paths(VALUES):
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        # A section header's comment covers its children only when they are a Kubernetes object.
        if path not in documented and not (FREE_FORM.search(parent) and parent in documented):
            undocumented.append(path)
    # Section headers (image, scope, serviceAccount...) document themselves through their children.
    undocumented = [p for p in undocumented if not isinstance(_get(p), dict) or FREE_FORM.search(p)]
    assert undocumented == []


def _get(path: str) -> Any:
    node: Any = VALUES
    for part in path.split("."):
        node = node[part]
    return node


def test_every_key_is_in_the_schema() -> None:
    missing = [p for p in key_paths(VALUES) if schema_node(p) is None and not FREE_FORM.search(p.rsplit(".", 1)[0])]
    assert missing == []


def test_schema_is_strict() -> None:
    def walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        yield path, node
        for name, child in node.get("properties", {}).items():
            yield from walk(child, f"{path}.{name}" if path else name)

    for path, node in walk(SCHEMA, ""):
        if path == "global" or (path and free_form(path) and not FREE_FORM.search(path)):
            continue  # Helm's globals, and the constraints inside free-form Kubernetes objects
        assert "type" in node or "enum" in node or "const" in node, f"{path or '(root)'} has no type"
        assert path == "" or node.get("description"), f"{path} has no description"
        if node.get("type") == "object" and not FREE_FORM.search(path):
            assert node.get("additionalProperties") is False, f"{path or '(root)'} accepts unknown keys"
            # Every key is required, so a values file that drops a default fails loudly.
            assert set(node.get("required", [])) == set(node["properties"]) - {"global"}, path


def test_defaults_pass_the_schema_and_every_enum_default_is_allowed() -> None:
    import helm_python

    with helm_python.Chart.load(str(CHART)) as chart:
        chart.validate_schema(chart.merge_values({}))
    enum = schema_node("monitoring.prometheusRule.ttftSloSeconds")
    assert enum is not None and VALUES["monitoring"]["prometheusRule"]["ttftSloSeconds"] in enum["enum"]
