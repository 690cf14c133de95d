"""Fixtures of the launcher tests: the real S3 server (SeaweedFS, the session's ``seaweedfs`` fixture
in tests/conftest.py), a bucket holding a populated tiny model, and a launcher process that never
outlives its test. No launcher test needs moto: the faults the pull must survive are tested on the
same server in tests/weight_cache/test_faults_real.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfleet.weight_cache import S3Settings, make_client, populate
from kvfleet.weight_cache.s3 import S3Client
from kvfleet_testkit.processes import console_script
from kvfleet_testkit.seaweedfs import SeaweedS3
from tests.conftest import pick_free_port


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tiny local model folder (config and one safetensors file) for launches without S3."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 128)
    return path


@pytest.fixture(scope="module")
def s3_client(seaweedfs: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> S3Client:
    creds = tmp_path_factory.mktemp("aws")
    (creds / "AWS_ACCESS_KEY_ID").write_text(seaweedfs.access_key)
    (creds / "AWS_SECRET_ACCESS_KEY").write_text(seaweedfs.secret_key)
    return make_client(S3Settings(endpoint_url=seaweedfs.endpoint_url, region=seaweedfs.region, credentials_dir=creds))


@dataclass(frozen=True)
class PopulatedModel:
    bucket: str
    uri: str
    local: Path


@pytest.fixture(scope="module")
def populated_model(s3_client: S3Client, tmp_path_factory: pytest.TempPathFactory) -> PopulatedModel:
    """A ~64 MB random-weight model in the bucket: big enough that a pull takes measurable time."""
    from kvfleet.engine.tiny_model import make_tiny_model

    local = make_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=4, hidden=512, vocab=4096, heads=8, kv_heads=4
    )
    bucket = f"cache-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/models/tiny"
    populate(s3_client, local, uri)
    return PopulatedModel(bucket=bucket, uri=uri, local=local)


def launcher_env(server: SeaweedS3, node_cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(server.env())
    env.update(
        {
            "KVFLEET_NODE_CACHE": str(node_cache),
            # Two cores shared by the whole suite: one torch thread keeps the engine from starving it.
            "OMP_NUM_THREADS": "1",
        }
    )
    return env


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class LauncherProcess:
    """``kvfleet engine launch`` as the pod runs it, on free loopback ports."""

    def __init__(
        self, spec: dict[str, Any], workdir: Path, env: dict[str, str], extra_args: tuple[str, ...] = ()
    ) -> None:
        self.engine_port, self.metrics_port = pick_free_port(), pick_free_port()
        spec_path = workdir / f"spec-{self.metrics_port}.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = workdir / f"launcher-{self.metrics_port}.log"
        self._log = self.log_path.open("wb")
        argv = [console_script("kvfleet"), "engine", "launch", "--spec", str(spec_path), "--metrics-host", "127.0.0.1"]
        argv += ["--metrics-port", str(self.metrics_port), "--engine-port", str(self.engine_port), *extra_args]
        self.process = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.engine_pids: set[int] = set()

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def remember_children(self) -> None:
        self.engine_pids.update(_children(self.process.pid))

    def stop(self, timeout_s: float = 60.0) -> int:
        self.remember_children()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            self.close()

    def close(self) -> None:
        """Never leave a launcher or its engine behind, whatever the test did."""
        self.remember_children()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        for pid in self.engine_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()


@pytest.fixture
def launchers() -> Iterator[list[LauncherProcess]]:
    started: list[LauncherProcess] = []
    yield started
    for launcher in started:
        launcher.close()


def wait_until(predicate: Any, timeout_s: float, what: str, launcher: LauncherProcess | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if launcher is not None:
            launcher.remember_children()
            if launcher.process.poll() is not None:
                raise AssertionError(f"launcher exited with {launcher.process.returncode}: {launcher.log[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f": {launcher.log[-3000:]}" if launcher else ""))
