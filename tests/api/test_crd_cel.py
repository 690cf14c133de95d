"""The CRD's CEL rules, evaluated by a real CEL interpreter (cel-python), agree with the models:
every example passes every rule, and the cross-field mistakes the API server can catch fail one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from support.spec_cases import CASES, base, put

from kvfleet.crd import openapi_schema

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
# Spec mistakes that a CEL rule in the CRD mirrors (ids from test_spec_invalid.CASES).
MIRRORED = [
    "min-gt-max",
    "tp-not-dividing-gpus",
    "scale-to-zero-needs-min-0",
    "replicas-with-autoscaling",
    "pickle-without-consent",
    "panic-window-not-shorter",
    "artifacts-without-bucket",
    "host-path-missing",
    "env-value-and-value-from",
    "dotdot-in-cache-prefix",
    "dotdot-in-artifacts-prefix",
    "sglang-without-gpus",
    "tp-without-gpus",
    "vllm-unknown-quantization",
    "queue-wait-shorter-than-cold-start",
    "managed-flag-in-extra-args",
    "bad-bucket-in-uri",
    "dotdot-in-uri",
]


def rules_by_path(node: dict[str, Any], path: str = "") -> list[tuple[str, str]]:
    found = [(path, rule["rule"]) for rule in node.get("x-kubernetes-validations", [])]
    for name, child in node.get("properties", {}).items():
        found += rules_by_path(child, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        found += rules_by_path(node["items"], f"{path}[]")
    return found


RULES = rules_by_path(openapi_schema())


def values_at(doc: Any, path: str) -> list[Any]:
    nodes = [doc]
    for part in path.split("."):
        is_list = part.endswith("[]")
        key = part.removesuffix("[]")
        nodes = [n[key] for n in nodes if isinstance(n, dict) and key in n]
        if is_list:
            nodes = [item for n in nodes for item in n]
    return nodes


def failing_rules(doc: dict[str, Any]) -> list[str]:
    env = celpy.Environment()
    failed = []
    for path, rule in RULES:
        program = env.program(env.compile(rule))
        for value in values_at(doc, path):
            if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
                failed.append(f"{path}: {rule}")
    return failed


def test_there_are_rules_to_check() -> None:
    assert len(RULES) >= 10


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_pass_every_rule(example: Path) -> None:
    for doc in yaml.safe_load_all(example.read_text()):
        assert failing_rules(doc) == []


def test_base_passes_every_rule() -> None:
    assert failing_rules(base()) == []


@pytest.mark.parametrize("case_id", MIRRORED)
def test_mirrored_mistakes_fail_a_rule(case_id: str) -> None:
    (edits,) = [c[1] for c in CASES if c[0] == case_id]
    doc = base()
    for path, value in edits:
        doc = put(doc, path, value)
    assert failing_rules(doc), f"{case_id} passes every CEL rule"
