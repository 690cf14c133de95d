"""Weight-cache fixtures: a real S3 server (SeaweedFS, the session's ``seaweedfs`` fixture in
tests/conftest.py) on free loopback ports, a bucket per test, its credentials through a
mounted-Secret-style directory, and model builders. Faults a real server does not produce on
demand (a dropped connection on the n-th GET) are injected in the client by botocore's own event
hooks, against this same server; no test here needs moto."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from kvfleet.weight_cache import S3Settings, make_client
from kvfleet.weight_cache.s3 import S3Client
from kvfleet_testkit.seaweedfs import SeaweedS3

MiB = 1 << 20


@pytest.fixture(scope="session")
def s3_endpoint(seaweedfs: SeaweedS3) -> str:
    return seaweedfs.endpoint_url


@pytest.fixture(scope="session")
def credentials_dir(seaweedfs: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("aws-secret")
    (directory / "AWS_ACCESS_KEY_ID").write_text(seaweedfs.access_key + "\n")
    (directory / "AWS_SECRET_ACCESS_KEY").write_text(seaweedfs.secret_key + "\n")
    return directory


@pytest.fixture(scope="session")
def s3_settings(s3_endpoint: str, credentials_dir: Path) -> S3Settings:
    return S3Settings(endpoint_url=s3_endpoint, region="us-east-1", credentials_dir=credentials_dir)


@pytest.fixture
def s3(s3_settings: S3Settings) -> S3Client:
    return make_client(s3_settings, max_pool_connections=16)


@pytest.fixture
def bucket(s3: S3Client) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def write_model(root: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    """Random bytes for each ``path: size``; deterministic per (seed, path)."""
    import random

    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = random.Random(f"{seed}:{rel}")
        path.write_bytes(rng.randbytes(size))
    return root


# A small multi-file model: one file larger than the 1 MiB test part size (3.5 parts), an empty
# file, a nested tokenizer file, and a config.
SMALL_MODEL = {
    "model-00001-of-00002.safetensors": 3 * MiB + MiB // 2,
    "model-00002-of-00002.safetensors": 700 * 1024,
    "config.json": 512,
    "tokenizer/tokenizer.json": 4096,
    "generation_config.json": 0,
}


@pytest.fixture
def small_model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "src-model", SMALL_MODEL)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.relative_to(root).as_posix().startswith(".kvfleet")
    }


def env_for_subprocess(s3_endpoint: str, credentials_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["AWS_ENDPOINT_URL"] = s3_endpoint
    env["AWS_DEFAULT_REGION"] = "us-east-1"
    env["AWS_ACCESS_KEY_ID"] = (credentials_dir / "AWS_ACCESS_KEY_ID").read_text().strip()
    env["AWS_SECRET_ACCESS_KEY"] = (credentials_dir / "AWS_SECRET_ACCESS_KEY").read_text().strip()
    return env
