"""``spec.cache``: the same-datacenter weight cache (an S3-compatible bucket and prefix, its
credentials by Secret reference), the node cache of pulled weights, and where engine artifacts live.

Key prefixes are checked to stay under themselves, and artifacts need a bucket to live in."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from kvfleet.spec.base import (
    BUCKET_PATTERN,
    ApiModel,
    Quantity,
    check_key_prefix,
    cross_field_error,
    quantity_as_string,
)
from kvfleet.spec.identity import NAME_PATTERN


class NodeCacheSpec(ApiModel):
    """Node-level cache of pulled weights, shared by the replicas on one node."""

    type: Literal["hostPath", "emptyDir"] = Field(
        default="emptyDir", description="hostPath survives pod restarts on the node; emptyDir does not."
    )
    host_path: Annotated[str, StringConstraints(max_length=1024, pattern=r"^/.*$")] | None = Field(
        default=None, description="Absolute directory on the node (type hostPath)."
    )
    size_limit: Quantity | None = Field(default=None, description="Size bound; least recently used models go first.")
    verify_on_hit: Literal["sha256", "stat"] = Field(
        default="sha256",
        description="What a cached model must pass before it is loaded: sha256 hashes every file against the "
        "manifest (about 1 s per GB on one core); stat hashes only files changed since they were verified "
        "(milliseconds; enough within the namespace's own cache directory, see docs/weight_cache.md).",
    )

    @field_validator("size_limit", mode="before")
    @classmethod
    def _norm(cls, value: Any) -> Any:
        return quantity_as_string(value)

    @field_validator("host_path")
    @classmethod
    def _no_dotdot(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("/"):
            raise ValueError("must not contain '..' path segments")
        return value

    @model_validator(mode="after")
    def _host_path_set(self) -> NodeCacheSpec:
        if self.type == "hostPath" and self.host_path is None:
            raise cross_field_error("hostPath", "type hostPath needs hostPath (an absolute directory on the node)")
        if self.type == "emptyDir" and self.host_path is not None:
            raise cross_field_error("hostPath", "hostPath is only used with type: hostPath")
        return self


class ArtifactsSpec(ApiModel):
    """Prebuilt engine artifacts (compile caches, CUDA graphs), fingerprinted, in the weight cache bucket."""

    enabled: bool = Field(default=False, description="Pull artifacts before start; push them after a miss.")
    prefix: Annotated[str, StringConstraints(max_length=512)] = Field(
        default="artifacts/", description="Key prefix for artifacts inside cache.bucket."
    )

    @field_validator("prefix")
    @classmethod
    def _prefix_safe(cls, value: str) -> str | None:
        return check_key_prefix(value)


class CacheSpec(ApiModel):
    """Same-datacenter weight cache (S3-compatible), node cache and engine artifacts."""

    s3_endpoint: Annotated[str, StringConstraints(max_length=512, pattern=r"^https?://[^\s]+$")] | None = Field(
        default=None, description="S3-compatible endpoint URL; default is boto3's standard configuration."
    )
    bucket: Annotated[str, StringConstraints(pattern=BUCKET_PATTERN)] | None = Field(
        default=None, description="Bucket of the weight cache."
    )
    prefix: Annotated[str, StringConstraints(max_length=512)] = Field(
        default="models/", description="Key prefix under which models are cached."
    )
    region: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="S3 region, if the endpoint needs one."
    )
    credentials_secret: Annotated[str, StringConstraints(max_length=253, pattern=NAME_PATTERN)] | None = Field(
        default=None,
        description="Secret (same namespace) with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "
        "mounted, never copied into the spec.",
    )
    node_cache: NodeCacheSpec = Field(default_factory=NodeCacheSpec, description="Node-level cache.")
    artifacts: ArtifactsSpec = Field(default_factory=ArtifactsSpec, description="Engine artifacts.")

    @field_validator("bucket", mode="before")
    @classmethod
    def _bucket_message(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.match(BUCKET_PATTERN, value):
            raise ValueError(f"{value!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, '.' or '-')")
        return value

    @field_validator("prefix")
    @classmethod
    def _prefix_safe(cls, value: str) -> str | None:
        return check_key_prefix(value)

    @model_validator(mode="after")
    def _artifacts_need_bucket(self) -> CacheSpec:
        if self.artifacts.enabled and self.bucket is None:
            raise cross_field_error("bucket", "artifacts.enabled needs cache.bucket to store artifacts in")
        return self
