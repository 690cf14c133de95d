"""The model digest a deployment pins: a pure decision, kept in an operator-owned ConfigMap.

The first pod of a model loads what the bucket's manifest says and reports its digest on
``/coldstart``; the operator pins that digest, and every later pod's launcher refuses a manifest
whose digest differs (a model replaced in the bucket, a manifest edited by someone with write access
to it), so the pod never becomes Ready on other weights. Trust on first use: pods that started
before the pin was written are not checked again until they restart.

The pin lives in a ConfigMap mounted into the engine pods, not in the pod template: a ConfigMap
volume follows its object's changes, so writing the pin rolls no GPU pod. It belongs to one model
source (``model_key``): a change of ``spec.model`` (uri, revision) or of the bucket an hf:// model is
cached in resets it, and the next pod of the new spec pins again. Only a pod built from the current
spec (its spec-hash annotation) may set it, so an old pod still serving the previous model during a
rollout never pins that model's digest onto the new one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvfleet.spec import InferenceDeploymentSpec

from . import names

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Pin:
    """``digest`` (None until a pod of this model served one) belongs to the model source ``model``."""

    model: str
    digest: str | None


@dataclass(frozen=True)
class PinDecision:
    pin: Pin
    reason: str


def pinnable(spec: InferenceDeploymentSpec) -> bool:
    """Weight-cache models only: a pvc:// or file:// model's digest is its files' names, sizes and
    mtimes (engine_image/sources.py), which a restore or a copy changes without changing the model."""
    return spec.model.uri.startswith(("s3://", "hf://"))


def model_key(spec: InferenceDeploymentSpec) -> str:
    """What the pin belongs to: the model's uri and revision, and the bucket an hf:// model comes from."""
    source: dict[str, Any] = {"uri": spec.model.uri, "revision": spec.model.revision}
    if spec.model.uri.startswith("hf://"):
        source.update(bucket=spec.cache.bucket, prefix=spec.cache.prefix)
    return json.dumps(source, sort_keys=True, separators=(",", ":"))


def pin_from_configmap(obj: dict[str, Any] | None) -> Pin | None:
    """The pin a live ConfigMap holds; None when there is none or it is not one we wrote."""
    data = (obj or {}).get("data") or {}
    model = data.get(names.PIN_MODEL_KEY)
    if not isinstance(model, str) or not model:
        return None
    digest = data.get(names.PIN_KEY)
    return Pin(model=model, digest=digest if isinstance(digest, str) and _DIGEST.match(digest) else None)


def decide_pin(spec: InferenceDeploymentSpec, live: Pin | None, served: str | None) -> PinDecision:
    """The pin to hold now. ``served``: the digest the newest Ready pod built from this spec reported."""
    key = model_key(spec)
    if not pinnable(spec):
        return PinDecision(Pin(key, None), f"{spec.model.uri.split(':', 1)[0]}:// models are not pinned")
    if live is None:
        live = Pin(key, None)
    elif live.model != key:
        return PinDecision(Pin(key, None), "spec.model changed: the pin is reset until a pod of the new model serves")
    if live.digest is not None:
        return PinDecision(live, f"pinned to {live.digest}")
    if served is not None and _DIGEST.match(served):
        return PinDecision(Pin(key, served), f"pinned to {served}, the digest the first Ready pod of this model served")
    return PinDecision(live, "not pinned yet: no Ready pod of this model has reported its digest")
