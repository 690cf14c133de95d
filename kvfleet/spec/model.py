"""``spec.model``: where the weights come from (a URI of a known scheme), the name clients ask
for, and the weight format, with pickle refused unless the spec consents to it."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from kvfleet.contracts import MODEL_URI_PATTERN, MODEL_URI_SCHEMES
from kvfleet.spec.base import BUCKET_PATTERN, ApiModel, cross_field_error


class ModelSource(ApiModel):
    """Where the model's weights come from and the name clients ask for."""

    uri: Annotated[str, StringConstraints(max_length=1024)] = Field(
        description=(
            "Location of the model in Hugging Face layout: s3://bucket/prefix, hf://org/name, "
            "pvc://claim/path or file:///absolute/path (file:// relative paths are for local mode)."
        ),
    )
    revision: Annotated[str, StringConstraints(max_length=128)] | None = Field(
        default=None, description="Revision (git commit, tag or branch) for hf:// models."
    )
    served_name: Annotated[str, StringConstraints(max_length=253, pattern=r"^[A-Za-z0-9._/:-]+$")] | None = Field(
        default=None,
        description="Model name clients send in the OpenAI `model` field; defaults to metadata.name.",
    )
    format: Literal["safetensors", "pickle"] = Field(
        default="safetensors",
        description="Weight format. 'pickle' (.bin/.pt) runs code on load and needs allowPickle: true.",
    )
    allow_pickle: bool = Field(
        default=False,
        description="Accept pickle-based checkpoints. Unpickling can execute arbitrary code; leave false.",
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if not re.match(MODEL_URI_PATTERN, value):
            scheme = value.split("://", 1)[0] if "://" in value else "(none)"
            raise ValueError(
                f"unknown URI scheme {scheme!r}; use one of " + ", ".join(f"{s}://" for s in MODEL_URI_SCHEMES)
            )
        if value.startswith("s3://"):
            bucket = value[len("s3://") :].split("/", 1)[0]
            if not re.match(BUCKET_PATTERN, bucket):
                raise ValueError(f"bucket name {bucket!r} is not a valid S3 bucket name")
        if ".." in value.split("://", 1)[1].split("/"):
            raise ValueError("must not contain '..' path segments")
        return value

    @model_validator(mode="after")
    def _pickle_needs_consent(self) -> ModelSource:
        if self.format == "pickle" and not self.allow_pickle:
            raise cross_field_error(
                "format",
                "format 'pickle' loads weights by unpickling, which can run arbitrary code; "
                "convert the model to safetensors or set model.allowPickle: true",
            )
        return self
