"""The generated CRD on a real kube-apiserver: accepted, documented by `kubectl explain`, printed with
its columns, and rejecting every invalid spec `kvfleet validate` rejects, naming the same field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.real_cluster import Kubectl
from support.spec_cases import CASES, base, put

from kvfleet.crd import openapi_schema
from kvfleet.devcluster.controlplane import AdminApi, ControlPlane
from kvfleet.spec import GROUP, PLURAL, VERSION
from kvfleet.validation import validate_object

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
BAD_SPECS = REPO / "tests" / "api" / "fixtures" / "bad-specs.yaml"


def admin(control_plane: ControlPlane) -> AdminApi:
    return AdminApi(control_plane.state.server if control_plane.state else "", control_plane.pki)


def server_create(control_plane: ControlPlane, namespace: str, doc: dict[str, Any]) -> tuple[int, Any]:
    """POST with dryRun (nothing is stored) and strict field validation, as `kubectl apply` sends."""
    doc = copy.deepcopy(doc)
    doc.setdefault("metadata", {})["namespace"] = namespace
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}?dryRun=All&fieldValidation=Strict"
    return admin(control_plane).call("POST", path, doc)


def causes(body: Any) -> list[tuple[str, str]]:
    details = body.get("details") or {} if isinstance(body, dict) else {}
    return [(c.get("field", ""), c.get("message", "")) for c in details.get("causes") or []]


def test_crd_is_established(kubectl: Kubectl, crd_installed: None) -> None:
    crd = kubectl.json("get", "crd", f"{PLURAL}.{GROUP}")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True"
    assert conditions.get("NamesAccepted") == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["infd"]


def test_explain_documents_every_autoscaling_field(kubectl: Kubectl, crd_installed: None) -> None:
    fields = openapi_schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    out = kubectl("explain", "infd.spec.autoscaling")
    flat = " ".join(out.split())
    for name, schema in fields.items():
        assert f"{name}\t" in out or f"{name} " in out or f"{name}<" in out, f"{name} missing from explain"
        first_words = " ".join(schema["description"].split()[:6])
        assert first_words in flat, f"{name}: {first_words!r} not in kubectl explain output"


def test_printer_columns_show_status_values(kubectl: Kubectl, crd_installed: None, namespace: str) -> None:
    doc = put(base(), "metadata.namespace", namespace)
    kubectl.apply(doc)
    status = {
        "status": {
            "readyReplicas": 2,
            "desiredReplicas": 3,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "ScalingUp",
                    "message": "2 of 3 replicas ready",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        }
    }
    kubectl("patch", "infd", "m", "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status))
    out = kubectl("get", "infd", "m", "-n", namespace).splitlines()
    assert out[0].split() == ["NAME", "MODEL", "ENGINE", "READY", "DESIRED", "STATUS", "AGE"]
    row = out[1].split()
    assert row[:6] == ["m", "s3://model-cache/models/llama", "vllm", "2", "3", "ScalingUp"]


@pytest.mark.parametrize(("case", "edits", "field"), [c[:3] for c in CASES], ids=[c[0] for c in CASES])
def test_api_server_rejects_what_validate_rejects(
    control_plane: ControlPlane, crd_installed: None, case: str, edits: list[tuple[str, Any]], field: str
) -> None:
    doc = base()
    for path, value in edits:
        doc = put(doc, path, value)
    status, body = server_create(control_plane, "default", doc)
    if "unknown field" in dict((c[0], c[3]) for c in CASES)[case]:
        # Unknown fields fail decoding before validation: 400 (kubectl's default is strict), not 422.
        assert status == 400, f"expected 400, got {status}: {body}"
        assert f'unknown field "{field}"' in body["message"]
        return
    assert status == 422, f"expected 422, got {status}: {body}"
    found = causes(body)
    assert any(f == field for f, _ in found), f"API server names {found}, validate names {field}"
    assert next(m for f, m in found if f == field), "a cause without a message"


def test_bad_spec_fixtures_rejected_by_both(control_plane: ControlPlane, crd_installed: None) -> None:
    docs = [d for d in yaml.safe_load_all(BAD_SPECS.read_text()) if d]
    assert len(docs) >= 4
    for doc in docs:
        _, problems = validate_object(copy.deepcopy(doc))
        assert problems, f"{doc['metadata']['name']} is valid for kvfleet validate"
        status, body = server_create(control_plane, "default", doc)
        paths = {p.path for p in problems}
        if status == 400:  # an unknown field: refused while decoding, before validation
            assert any(f'unknown field "{path}"' in body["message"] for path in paths), body
            continue
        assert status == 422, f"{doc['metadata']['name']}: {status} {body}"
        server_fields = {f for f, _ in causes(body)}
        assert server_fields & paths, (doc["metadata"]["name"], server_fields, problems)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_accepted(control_plane: ControlPlane, crd_installed: None, path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "InferenceDeployment":
            status, body = server_create(control_plane, "default", doc)
            assert status == 201, f"{path.name}: {status} {body}"


def test_valid_base_is_accepted(control_plane: ControlPlane, crd_installed: None) -> None:
    status, body = server_create(control_plane, "default", base())
    assert status == 201, body
