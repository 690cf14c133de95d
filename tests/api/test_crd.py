"""The generated CRD is structural, documented, and carries the subresources and columns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kvfleet.crd import CRD_FILE_NAME, PRESERVE_UNKNOWN_FIELDS, build_crd, openapi_schema


def walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")


def test_schema_is_structural() -> None:
    for path, node in walk(openapi_schema(), ""):
        exempt = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert "type" in node or exempt, f"{path or '(root)'} has no type"
        assert not ("properties" in node and "additionalProperties" in node), f"{path}: both"
        assert "$ref" not in node and "title" not in node, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, True), bool), f"{path}: {bound} must be the v3.0 boolean"
        if "default" in node:
            assert node["default"] is not None, f"{path}: null default"


def test_preserve_unknown_fields_only_where_justified() -> None:
    preserved = {p for p, n in walk(openapi_schema(), "") if n.get("x-kubernetes-preserve-unknown-fields")}
    assert preserved == set(PRESERVE_UNKNOWN_FIELDS)
    assert all(len(why) > 40 for why in PRESERVE_UNKNOWN_FIELDS.values())


def test_every_field_is_described_for_kubectl_explain() -> None:
    schema = openapi_schema()
    for path, node in walk(schema["properties"]["spec"], "spec"):
        if path.endswith(("[]", ".*")):
            continue
        assert node.get("description"), f"{path} has no description"


def test_defaults_enums_and_cel() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]
    engine = spec["engine"]["properties"]
    assert engine["kind"]["enum"] == ["vllm", "sglang", "reference"]
    assert engine["tensorParallelSize"]["default"] == 1
    assert engine["maxModelLen"]["minimum"] == 1
    autoscaling = spec["autoscaling"]
    rules = [r["rule"] for r in autoscaling["x-kubernetes-validations"]]
    assert any("self.minReplicas <= self.maxReplicas" in r for r in rules)
    top_rules = [r["rule"] for r in openapi_schema()["properties"]["spec"]["x-kubernetes-validations"]]
    assert any("tensorParallelSize" in r for r in top_rules)
    assert any("self.replicas" in r for r in top_rules)
    assert spec["model"]["properties"]["uri"]["pattern"].startswith("^(s3|hf|pvc|file)")
    assert "pattern" in spec["cache"]["properties"]["bucket"]
    assert spec["cache"]["properties"]["prefix"]["x-kubernetes-validations"][0]["rule"] == "!self.contains('..')"
    cpu = spec["resources"]["properties"]["cpu"]
    assert cpu["x-kubernetes-int-or-string"] is True


def test_crd_shape() -> None:
    crd = build_crd()
    assert crd["metadata"]["name"] == "inferencedeployments.kvfleet.io"
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["infd"] and names["categories"] == ["kvfleet"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Engine", "Ready", "Desired", "Status", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for field in (
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "desiredReplicas",
        "lastScaleTime",
        "scaleReason",
        "endpoint",
        "modelDigest",
        "measuredColdStartSeconds",
        "conditions",
        "selector",
    ):
        assert field in status, field
    condition = status["conditions"]["items"]["properties"]
    assert condition["type"]["enum"] == ["Ready", "Progressing", "Degraded", "ScaledToZero"]


def test_file_on_disk_is_the_generated_one(repo_root: Path) -> None:
    on_disk = yaml.safe_load((repo_root / "crds" / CRD_FILE_NAME).read_text())
    assert on_disk == build_crd()
