"""The pin decision (operator/pin.py): pure, hand-checkable."""

from __future__ import annotations

from typing import Any

from kvfleet.operator.pin import Pin, decide_pin, model_key, pin_from_configmap
from kvfleet.spec import InferenceDeploymentSpec

A, B = "a" * 64, "b" * 64


def spec(**model: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {"model": {"uri": "s3://weights/llama", **model}, "cache": {"bucket": "weights"}}
    )


def test_the_first_served_digest_is_pinned_and_then_kept() -> None:
    s = spec()
    first = decide_pin(s, None, None)
    assert first.pin == Pin(model_key(s), None)
    assert first.reason == "not pinned yet: no Ready pod of this model has reported its digest"
    pinned = decide_pin(s, first.pin, A)
    assert pinned.pin == Pin(model_key(s), A)
    # A later pod that served other weights does not move the pin: its launcher is refused instead.
    assert decide_pin(s, pinned.pin, B).pin == Pin(model_key(s), A)


def test_a_model_change_resets_the_pin_even_with_a_served_digest() -> None:
    old = Pin(model_key(spec()), A)
    for changed in (spec(uri="s3://weights/mistral"), spec(revision="v2")):
        decision = decide_pin(changed, old, B)  # B: an old pod still serving the previous model
        assert decision.pin == Pin(model_key(changed), None)
        assert "spec.model changed" in decision.reason


def test_hf_models_are_keyed_by_their_cache_bucket_too() -> None:
    def hf(bucket: str) -> InferenceDeploymentSpec:
        return InferenceDeploymentSpec.model_validate({"model": {"uri": "hf://org/m"}, "cache": {"bucket": bucket}})

    assert model_key(hf("one")) != model_key(hf("two"))


def test_local_models_are_not_pinned() -> None:
    s = InferenceDeploymentSpec.model_validate({"model": {"uri": "pvc://claim/m"}})
    decision = decide_pin(s, None, A)
    assert decision.pin.digest is None and decision.reason == "pvc:// models are not pinned"


def test_a_configmap_that_is_not_a_pin_reads_as_none() -> None:
    assert pin_from_configmap(None) is None
    assert pin_from_configmap({"data": {"modelDigest": A}}) is None  # no model: not ours
    assert pin_from_configmap({"data": {"model": "k", "modelDigest": "not-a-digest"}}) == Pin("k", None)
    assert pin_from_configmap({"data": {"model": "k", "modelDigest": A}}) == Pin("k", A)
