"""S3 locations and clients. boto3 is configured through its standard chain (environment, shared
config, ``AWS_ENDPOINT_URL``); explicit settings override it. Secrets are read from a mounted
directory only when asked, handed to boto3, and never logged or put in a repr."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from kvfleet.weight_cache.errors import InvalidLocationError, UnsafePathError
from kvfleet.weight_cache.safety import check_key_prefix, check_relative_path
from kvfleet.weight_cache.settings import S3Settings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from kvfleet.spec import CacheSpec
else:
    S3Client = Any

BUCKET_PATTERN = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
CREDENTIAL_FILES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


@dataclass(frozen=True)
class S3Uri:
    """``s3://bucket/prefix``; the prefix has no leading or trailing '/'."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Uri:
        if not uri.startswith("s3://"):
            raise InvalidLocationError(f"{uri!r}: expected s3://bucket/prefix")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not BUCKET_PATTERN.match(bucket):
            raise InvalidLocationError(f"{uri!r}: {bucket!r} is not a valid S3 bucket name")
        prefix = prefix.strip("/")
        try:
            check_key_prefix(prefix)
        except UnsafePathError as e:
            raise InvalidLocationError(f"{uri!r}: {e}") from e
        return cls(bucket=bucket, prefix=prefix)

    def key(self, relative: str) -> str:
        check_relative_path(relative)
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def read_credentials_dir(directory: Path) -> dict[str, str]:
    """boto3 keyword arguments from a mounted Secret (one file per key, as Kubernetes mounts it)."""
    values: dict[str, str] = {}
    for name in CREDENTIAL_FILES:
        path = directory / name
        if path.is_file():
            values[name.lower()] = path.read_text().strip()
    missing = [n for n in CREDENTIAL_FILES[:2] if n.lower() not in values]
    if missing:
        # Name the missing files, never the values.
        raise InvalidLocationError(f"{directory}: credentials directory lacks {', '.join(missing)}")
    return values


def make_client(settings: S3Settings, *, max_pool_connections: int = 10) -> S3Client:
    """An S3 client. ``max_pool_connections`` should match the transfer concurrency: a smaller pool
    makes threads queue for connections, which shows up as lost throughput, not as an error."""
    creds: dict[str, str] = {}
    if settings.credentials_dir is not None:
        creds = read_credentials_dir(settings.credentials_dir)
    session = boto3.session.Session(
        aws_access_key_id=creds.get("aws_access_key_id"),
        aws_secret_access_key=creds.get("aws_secret_access_key"),
        aws_session_token=creds.get("aws_session_token"),
    )
    config = Config(
        max_pool_connections=max_pool_connections,
        connect_timeout=settings.connect_timeout_s,
        read_timeout=settings.read_timeout_s,
        retries={"mode": "standard", "max_attempts": settings.request_attempts},
    )
    client: S3Client = session.client(
        "s3", endpoint_url=settings.endpoint_url, region_name=settings.region, config=config
    )
    return client


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def is_not_found(error: ClientError) -> bool:
    return error_code(error) in NOT_FOUND_CODES


def get_bytes(client: S3Client, bucket: str, key: str, max_bytes: int) -> bytes | None:
    """A small object's bytes, or None when it does not exist; bounded so a wrong key cannot OOM us."""
    try:
        response = client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{max_bytes}")
    except ClientError as e:
        if is_not_found(e):
            return None
        if error_code(e) == "InvalidRange":  # an empty object has no byte 0
            return b""
        raise
    data = response["Body"].read()
    if len(data) > max_bytes:
        raise InvalidLocationError(f"s3://{bucket}/{key}: larger than the {max_bytes} bytes accepted")
    return data


def settings_for_cache_spec(cache: CacheSpec, credentials_dir: Path | None = None) -> S3Settings:
    """S3 settings from an InferenceDeployment's ``spec.cache``: ``s3Endpoint`` overrides boto3's
    standard configuration; the credentials Secret is mounted (its directory given here), never read
    from the spec."""
    return S3Settings(endpoint_url=cache.s3_endpoint, region=cache.region, credentials_dir=credentials_dir)


def cache_uri_for(model_uri: str, revision: str | None, cache: CacheSpec) -> str:
    """Where a model lives in the weight cache: an s3:// model is its own location; an hf:// model
    is cached at ``s3://<cache.bucket>/<cache.prefix>hf/<org>/<name>/<revision or main>``."""
    if model_uri.startswith("s3://"):
        return model_uri
    if not model_uri.startswith("hf://"):
        raise InvalidLocationError(f"{model_uri!r}: only s3:// and hf:// models go through the weight cache")
    if cache.bucket is None:
        raise InvalidLocationError(f"{model_uri!r}: hf:// models need cache.bucket to be cached")
    repo, _, pinned = model_uri[len("hf://") :].partition("@")
    rev = revision or pinned or "main"
    uri = f"s3://{cache.bucket}/{cache.prefix.strip('/')}/hf/{repo.strip('/')}/{rev}".replace("//hf/", "/hf/")
    S3Uri.parse(uri)  # validates bucket and segments
    return uri
