"""SeaweedFS (``weed server -s3``), a real S3-protocol server, on free loopback ports with a data
directory of its own and static credentials, for the tests and benchmarks that need S3.

The binary comes from ``KVFLEET_WEED`` when set, else from the checkout's
``tools/seaweedfs/build.sh`` (built from Go modules into ``~/.cache/kvfleet/seaweedfs/`` once,
then found in milliseconds). ``weed server -s3`` (master, volume server, filer and S3 gateway in
one process) rather than ``weed mini``: mini also starts WebDAV, the admin UI and its workers,
which S3 clients never use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvfleet.free_port import pick_free_port
from kvfleet_testkit.processes import stop_process

WEED_ENV = "KVFLEET_WEED"
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "seaweedfs" / "build.sh"
# A cold build on 2 shared cores takes minutes; past 40 something is wrong.
BUILD_TIMEOUT_S = 2400.0
# Master, volume server, filer and gateway start in a few seconds on 2 shared cores; the first
# write waits for the volume server's first heartbeat and the volumes the master grows.
READY_TIMEOUT_S = 90.0
REGION = "us-east-1"


class SeaweedError(RuntimeError):
    """The server could not be built, started or reached; the message says why."""


@dataclass(frozen=True)
class SeaweedS3:
    """A running server: where it answers S3 and the credentials it accepts."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    pid: int
    data_dir: Path
    log_path: Path
    metrics_url: str = ""  # Prometheus text: per-bucket request counts and bytes sent

    def env(self) -> dict[str, str]:
        """boto3's standard variables for a subprocess that should talk to this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }


def weed_binary() -> Path:
    """The ``weed`` binary, building it when needed; raises ``SeaweedError`` with the reason."""
    given = os.environ.get(WEED_ENV)
    if given:
        if not os.access(given, os.X_OK):
            raise SeaweedError(f"{WEED_ENV}={given} is not an executable file")
        return Path(given)
    if not BUILD_SCRIPT.exists():
        raise SeaweedError(f"set {WEED_ENV} to a weed binary, or run from a source checkout (tools/seaweedfs/build.sh)")
    if shutil.which("go") is None:
        raise SeaweedError(f"building SeaweedFS needs Go >= 1.26.6 on PATH (or set {WEED_ENV})")
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise SeaweedError(f"tools/seaweedfs/build.sh failed (exit {result.returncode}): {result.stderr[-2000:]}")
    path = Path(result.stdout.strip().splitlines()[-1])
    if not os.access(path, os.X_OK):
        raise SeaweedError(f"tools/seaweedfs/build.sh finished but {path} is not executable")
    return path


def _s3_identities(access_key: str, secret_key: str) -> dict[str, object]:
    """One identity with every S3 action (SeaweedFS's static ``-s3.config`` format)."""
    return {
        "identities": [
            {
                "name": "kvfleet",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }


def weed_command(weed: Path, data_dir: Path, config: Path, ports: dict[str, int]) -> list[str]:
    """``weed server -s3`` on loopback only, every port given (no fixed well-known port is used),
    no telemetry, no Iceberg/Lance catalogs."""
    return [
        str(weed),
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data_dir}",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        "-master.telemetry=false",
        # Every bucket is a collection with volumes of its own, and the master grows several at a
        # bucket's first write: a test suite makes hundreds of buckets. Volumes are sparse files
        # (no preallocation), so a high count costs no disk; 512 MB each holds a benchmark model.
        "-master.volumeSizeLimitMB=512",
        "-volume.max=2000",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        "-filer",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        f"-filer.localSocket={data_dir / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config}",
        f"-metricsPort={ports['metrics']}",
    ]


def _wait_ready(server: SeaweedS3, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Ready means a round trip through every component: create a bucket, write an object (the
    master must have writable volumes), read it back, delete both."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
    )
    bucket = f"ready-{uuid.uuid4().hex[:12]}"
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SeaweedError(f"weed exited with {proc.returncode}; see {server.log_path}")
        try:
            client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="probe", Body=b"ready")
            if client.get_object(Bucket=bucket, Key="probe")["Body"].read() != b"ready":
                raise SeaweedError("the probe object read back differently")
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
            return
        except SeaweedError:
            raise
        except Exception as e:  # not up yet: connection refused, no writable volume, bucket exists...
            last = e
            time.sleep(0.2)
    raise SeaweedError(f"weed was not ready within {timeout_s:.0f} s (last error: {last}); see {server.log_path}")


@contextmanager
def seaweedfs_s3_server(
    data_dir: Path | None = None,
    *,
    access_key: str = "kvfleet-test",
    secret_key: str = "kvfleet-test-secret",
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[SeaweedS3]:
    """Start ``weed server -s3`` and wait until it stores and serves an object; yields the server
    and stops it (SIGTERM, then SIGKILL) by its PID on the way out. ``data_dir`` defaults to a
    temporary directory removed afterwards."""
    weed = weed_binary()
    own_dir = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="kvfleet-seaweed-")) if data_dir is None else data_dir
    root.mkdir(parents=True, exist_ok=True)
    config = root / "s3.json"
    config.write_text(json.dumps(_s3_identities(access_key, secret_key)))
    config.chmod(0o600)
    names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc", "metrics")
    ports: dict[str, int] = {}
    for name in names:  # distinct even if the kernel hands a port back twice
        port = pick_free_port()
        while port in ports.values():
            port = pick_free_port()
        ports[name] = port
    log_path = root / "weed.log"
    data = root / "data"
    data.mkdir(exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            weed_command(weed, data, config, ports),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=root,
        )
    server = SeaweedS3(
        endpoint_url=f"http://127.0.0.1:{ports['s3']}",
        access_key=access_key,
        secret_key=secret_key,
        region=REGION,
        pid=proc.pid,
        data_dir=root,
        log_path=log_path,
        metrics_url=f"http://127.0.0.1:{ports['metrics']}/metrics",
    )
    try:
        _wait_ready(server, proc, ready_timeout_s)
        yield server
    finally:
        stop_process(proc, grace_s=5.0)  # its data is thrown away: no need to wait long for a clean stop
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
