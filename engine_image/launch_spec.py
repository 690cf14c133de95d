"""Read ``/etc/kvfleet/spec.json``, the document the operator mounts for the launcher.

The format is pinned in docs/contracts.md: ``{"name", "namespace", "servedName", "spec"}`` with
the InferenceDeployment spec in camelCase. It is validated with the same models as the CRD, so a
bad spec stops the pod with the field path in the message instead of a half-configured engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.spec import MAX_NAME_CHARS, InferenceDeploymentSpec
from kvfleet.validation import validate_spec

from .errors import SpecError

# spec.json comes from a ConfigMap (1 MiB at most); refuse anything larger before parsing it.
MAX_SPEC_BYTES = 1 << 20


@dataclass(frozen=True)
class LaunchSpec:
    """What the launcher knows about its deployment."""

    name: str
    namespace: str
    served_name: str
    spec: InferenceDeploymentSpec
    # The model digest the deployment pinned (engine_image/model_pin.py); None: not pinned (yet).
    pinned_digest: str | None = None


def parse_launch_spec(doc: Any) -> LaunchSpec:
    """Validate a decoded spec.json; errors name the field (``spec.engine.dtype: ...``)."""
    if not isinstance(doc, dict):
        raise SpecError(f"spec.json must be a JSON object, got {type(doc).__name__}")
    missing = [key for key in ("name", "spec") if key not in doc]
    if missing:
        raise SpecError(f"spec.json lacks {', '.join(missing)}")
    unknown = sorted(set(doc) - {"name", "namespace", "servedName", "spec"})
    if unknown:
        raise SpecError(f"spec.json has unknown keys {unknown} (expected name, namespace, servedName, spec)")
    name, namespace = doc["name"], doc.get("namespace", "default")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise SpecError(f"name: must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    if not isinstance(namespace, str) or not namespace:
        raise SpecError("namespace: must be a non-empty string")
    spec, problems = validate_spec(doc["spec"])
    if spec is None:
        raise SpecError("; ".join(str(p) for p in problems))
    served = doc.get("servedName") or spec.served_name(name)
    if not isinstance(served, str):
        raise SpecError("servedName: must be a string")
    return LaunchSpec(name=name, namespace=namespace, served_name=served, spec=spec)


def load_launch_spec(path: Path) -> LaunchSpec:
    """Read and validate spec.json from ``path``."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"cannot read {path}: {e.strerror or e}") from e
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path} is larger than {MAX_SPEC_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise SpecError(f"{path} is not valid JSON: {e}") from e
    return parse_launch_spec(doc)
