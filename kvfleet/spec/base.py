"""The base every spec model shares (camelCase aliases, unknown fields rejected, immutable), the
cross-field error, and the string patterns and normalisers more than one area's model uses.

One place for them so every area (``model``, ``engine``, ``autoscaling``, ...) validates and
reports the same way."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StringConstraints
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

# S3 bucket naming rules (the subset every S3-compatible server accepts): 3-63 characters,
# lowercase letters, digits, dots and hyphens, starting and ending with a letter or digit.
BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
# Kubernetes resource quantity (https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/)
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$"

Quantity = Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=32)]


def cross_field_error(field: str, message: str) -> PydanticCustomError:
    """An error for a rule that spans fields; ``field`` is appended to the reported path."""
    return PydanticCustomError("cross_field", "{message}", {"field": field, "message": message})


def quantity_as_string(value: Any) -> Any:
    """A quantity in its string form: YAML turns ``cpu: 4`` into an int, and Kubernetes accepts both."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def check_key_prefix(value: str | None) -> str | None:
    """A bucket key prefix that stays under itself: relative, with no '..'."""
    if value is None:
        return value
    if ".." in value:
        raise ValueError("must not contain '..' (object keys are joined under the prefix)")
    if value.startswith("/"):
        raise ValueError("must be relative (no leading '/')")
    return value


class ApiModel(BaseModel):
    """Base for every spec model: camelCase aliases, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict as it appears in a manifest, without unset optionals."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
