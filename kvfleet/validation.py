"""Turn validation failures into problems that name the field, for the CLI and the operator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvfleet.resource import InferenceDeployment
from kvfleet.spec import InferenceDeploymentSpec


@dataclass(frozen=True)
class Problem:
    """One invalid field: a dotted path such as ``spec.autoscaling.minReplicas``, and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def _path(loc: tuple[int | str, ...], prefix: str) -> str:
    out = prefix
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        else:
            out = f"{out}.{item}" if out else str(item)
    return out


def problems_from(error: ValidationError, prefix: str = "") -> list[Problem]:
    """Flatten a pydantic error into problems; cross-field errors point at the field they name."""
    problems = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        message = err["msg"]
        if err["type"] == "cross_field":
            loc = loc + tuple(str(ctx["field"]).split("."))
            message = str(ctx["message"])
        elif err["type"] == "extra_forbidden":
            message = f"unknown field {str(loc[-1])!r} (check its spelling and nesting)"
        elif err["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        elif err["type"] == "literal_error":
            message = f"{message} (got {err.get('input')!r})"
        problems.append(Problem(_path(loc, prefix), message))
    return problems


def validate_object(doc: Any) -> tuple[InferenceDeployment | None, list[Problem]]:
    """Validate a whole manifest document; returns the object or the problems."""
    if not isinstance(doc, dict):
        return None, [Problem("(document)", f"expected a mapping, got {type(doc).__name__}")]
    try:
        return InferenceDeployment.model_validate(doc), []
    except ValidationError as e:
        return None, problems_from(e)


def validate_spec(spec: Any) -> tuple[InferenceDeploymentSpec | None, list[Problem]]:
    """Validate a spec alone (what the operator receives); paths start with ``spec``."""
    try:
        return InferenceDeploymentSpec.model_validate(spec), []
    except ValidationError as e:
        return None, problems_from(e, prefix="spec")
