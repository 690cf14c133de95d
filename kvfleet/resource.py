"""A whole InferenceDeployment object (metadata + spec + status) and loading it from YAML."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from kvfleet.spec import API_VERSION, KIND, MAX_NAME_CHARS, NAME_PATTERN, InferenceDeploymentSpec
from kvfleet.status import InferenceDeploymentStatus


class ObjectMeta(BaseModel):
    """The part of metadata kvfleet reads; everything else the API server owns is kept as is."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)] = Field(
        description="Name; child objects are named after it."
    )
    namespace: Annotated[str, StringConstraints(max_length=63, pattern=NAME_PATTERN)] = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None
    uid: str | None = None

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not re.match(NAME_PATTERN, value):
            raise ValueError(
                f"{value!r} must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
                "letter), since the engine Service is named after it"
            )
        return value


class InferenceDeployment(BaseModel):
    """An InferenceDeployment as read from a manifest or the API server."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["kvfleet.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["InferenceDeployment"]
    metadata: ObjectMeta
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def served_name(self) -> str:
        return self.spec.served_name(self.metadata.name)


def iter_documents(path: Path) -> Iterator[tuple[int, Any]]:
    """(index, document) for each non-empty YAML document in a file ('-' is not supported)."""
    with path.open(encoding="utf-8") as handle:
        for index, doc in enumerate(yaml.safe_load_all(handle)):
            if doc is not None:
                yield index, doc


def is_inference_deployment(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == KIND and doc.get("apiVersion") == API_VERSION
