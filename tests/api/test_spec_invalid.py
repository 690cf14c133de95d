"""Table-driven bad input: every invalid spec is rejected with an error that names the field."""

from __future__ import annotations

from typing import Any

import pytest
from support.spec_cases import CASES, base, put

from kvfleet.validation import validate_object


def test_at_least_25_cases() -> None:
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("edits", "field", "word"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_spec_names_the_field(edits: list[tuple[str, Any]], field: str, word: str) -> None:
    doc = base()
    for path, value in edits:
        doc = put(doc, path, value)
    deployment, problems = validate_object(doc)
    assert deployment is None
    paths = [p.path for p in problems]
    assert field in paths, f"expected an error at {field}, got {[str(p) for p in problems]}"
    message = next(p.message for p in problems if p.path == field)
    assert word.lower() in message.lower(), f"{field}: {message!r} does not mention {word!r}"


def test_base_is_valid() -> None:
    deployment, problems = validate_object(base())
    assert problems == []
    assert deployment is not None
    assert deployment.spec.autoscaling is not None
    assert deployment.spec.autoscaling.effective_scale_to_zero_after_s == 300.0


def test_quantities_written_as_numbers_are_accepted() -> None:
    deployment, problems = validate_object(put(base(), "spec.resources.cpu", 4))
    assert problems == []
    assert deployment is not None and deployment.spec.resources.cpu == "4"


def test_autoscaling_off_uses_fixed_replicas() -> None:
    doc = put(put(base(), "spec.autoscaling", {"enabled": False}), "spec.replicas", 3)
    deployment, problems = validate_object(doc)
    assert problems == [] and deployment is not None
    assert not deployment.spec.autoscaling_enabled
    assert deployment.spec.fixed_replicas() == 3


@pytest.mark.parametrize("method", ["bitsandbytes", "marlin"])
def test_quantization_vllm_does_not_know_is_refused_only_for_vllm(method: str) -> None:
    """vLLM 0.32 refuses these at start (tests/vllm/test_vllm_engine_fields.py); SGLang takes them."""
    vllm = put(base(), "spec.engine", {"kind": "vllm", "quantization": method})
    deployment, problems = validate_object(vllm)
    assert deployment is None and [p.path for p in problems] == ["spec.engine.quantization"], problems
    sglang = put(base(), "spec.engine", {"kind": "sglang", "quantization": method})
    deployment, problems = validate_object(sglang)
    assert deployment is not None and deployment.spec.engine.quantization == method, problems
