"""Faults on the real S3 server (SeaweedFS): a loopback TCP proxy in front of it
(kvfleet_testkit.fault_proxy) resets connections mid-body, stalls them, or answers 503 SlowDown in
the server's place; the disk fills up (a small tmpfs in a private mount namespace). The pull retries
within its bounds, resumes from its journal, and leaves nothing partial behind when it cannot fit."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.weight_cache import (
    NodeCacheSettings,
    PopulateSettings,
    PullSettings,
    PullStoppedError,
    S3Settings,
    S3Uri,
    TransferError,
    fetch_manifest,
    make_client,
    populate,
    pull_model,
    pull_to_dir,
)
from kvfleet.weight_cache.progress import NullProgress
from kvfleet.weight_cache.s3 import S3Client
from kvfleet_testkit.fault_proxy import FaultProxy, fault_proxy
from tests.weight_cache.conftest import SMALL_MODEL, MiB, tree_bytes

# One ranged GET at a time, 1 MiB parts: the order of parts (and so what the journal holds when
# the server goes away) is the file order.
ONE_AT_A_TIME = PullSettings(concurrency=1, part_size_bytes=MiB, retry_backoff_s=0.0, part_attempts=3)
POPULATE = PopulateSettings(concurrency=4, part_size_bytes=5 * MiB)


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    with fault_proxy(s3_endpoint) as p:
        yield p


def _through(proxy: FaultProxy, s3_settings: S3Settings, read_timeout_s: float = 60.0) -> S3Client:
    # One attempt per request in botocore: every fault reaches kvfleet's own retry of the part.
    return make_client(
        s3_settings.model_copy(
            update={"endpoint_url": proxy.url, "request_attempts": 1, "read_timeout_s": read_timeout_s}
        )
    )


@pytest.fixture
def populated(s3: S3Client, bucket: str, small_model: Path) -> str:
    uri = f"s3://{bucket}/m"
    populate(s3, small_model, uri, POPULATE)
    return uri


def test_connection_resets_mid_body_are_retried(
    proxy: FaultProxy,
    s3: S3Client,
    s3_settings: S3Settings,
    populated: str,
    small_model: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = _through(proxy, s3_settings)
    uri = S3Uri.parse(populated)
    fetched = fetch_manifest(s3, uri)  # directly: the proxied client's first connection is the pull's
    proxy.arm("reset", connections=2, after_bytes=300 * 1024)  # RST 300 KiB into a body, twice
    with caplog.at_level(logging.WARNING, logger="kvfleet.weight_cache.download"):
        pull_to_dir(client, uri, tmp_path / "dest", ONE_AT_A_TIME, fetched=fetched)
    assert proxy.faults_injected == 2
    assert tree_bytes(tmp_path / "dest") == tree_bytes(small_model)
    # Each cut part was retried (kvfleet's own retry: botocore does not retry a body cut mid-stream).
    retries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retrying ")]
    assert len(retries) == 2, retries


def test_a_stalled_body_times_out_and_is_retried(
    proxy: FaultProxy, s3: S3Client, s3_settings: S3Settings, populated: str, small_model: Path, tmp_path: Path
) -> None:
    client = _through(proxy, s3_settings, read_timeout_s=1.0)
    uri = S3Uri.parse(populated)
    fetched = fetch_manifest(s3, uri)
    proxy.arm("stall", connections=1, after_bytes=200 * 1024, stall_s=30.0)
    started = time.monotonic()
    pull_to_dir(client, uri, tmp_path / "dest", ONE_AT_A_TIME, fetched=fetched)
    assert proxy.faults_injected == 1
    assert tree_bytes(tmp_path / "dest") == tree_bytes(small_model)
    # The read timeout (1 s) ended the stall, not the proxy's 30 s.
    assert time.monotonic() - started < 20


def test_slowdown_is_retried_within_bounds_then_fails_naming_the_file(
    proxy: FaultProxy, s3: S3Client, s3_settings: S3Settings, populated: str, small_model: Path, tmp_path: Path
) -> None:
    # botocore's standard retry mode (3 attempts here) retries 503 SlowDown on every request.
    client = make_client(s3_settings.model_copy(update={"endpoint_url": proxy.url, "request_attempts": 3}))
    uri = S3Uri.parse(populated)
    fetched = fetch_manifest(s3, uri)
    proxy.arm("slowdown", connections=2)  # 503 SlowDown on the next two connections
    pull_to_dir(client, uri, tmp_path / "ok", ONE_AT_A_TIME, fetched=fetched)
    assert proxy.faults_injected == 2
    assert tree_bytes(tmp_path / "ok") == tree_bytes(small_model)

    proxy.arm("slowdown", connections=10_000)  # the server keeps refusing: the pull gives up, bounded
    client = make_client(s3_settings.model_copy(update={"endpoint_url": proxy.url, "request_attempts": 3}))
    started = time.monotonic()
    with pytest.raises(TransferError, match=r"503|SlowDown") as info:
        pull_to_dir(client, uri, tmp_path / "bad", ONE_AT_A_TIME, fetched=fetched)
    assert info.value.path in SMALL_MODEL
    assert time.monotonic() - started < 60


def test_a_pull_cut_off_mid_model_resumes_from_its_journal(
    proxy: FaultProxy, s3: S3Client, s3_settings: S3Settings, populated: str, small_model: Path, tmp_path: Path
) -> None:
    client = _through(proxy, s3_settings, read_timeout_s=5.0)
    uri = S3Uri.parse(populated)
    fetched = fetch_manifest(s3, uri)  # directly: the proxied client's first connection is the pull's
    dest = tmp_path / "dest"
    # The server goes away 2.5 MiB into the pull (every connection reset from then on).
    proxy.arm_budget(int(2.5 * MiB))
    with pytest.raises(TransferError, match="failed after 3 attempts"):
        pull_to_dir(client, uri, dest, ONE_AT_A_TIME, fetched=fetched)
    journals = list((dest / ".kvfleet-partial").glob("*.journal"))
    assert journals, "the cut-off pull kept its journal"
    done_parts = sum(len(j.read_text().splitlines()) - 1 for j in journals)
    assert done_parts >= 1

    proxy.disarm()
    result = pull_to_dir(client, uri, dest, ONE_AT_A_TIME, fetched=fetched)
    assert tree_bytes(dest) == tree_bytes(small_model)
    # What the journal held (and the file finished before the cut, if any) was not fetched again.
    assert result.reused_bytes >= done_parts * MiB
    assert result.downloaded_bytes <= sum(SMALL_MODEL.values()) - done_parts * MiB


class StopAfter(NullProgress):
    """Sets ``stop`` once ``after_bytes`` have landed: a caller that gives the pull up mid-model."""

    def __init__(self, stop: threading.Event, after_bytes: int) -> None:
        self.stop, self.after_bytes, self.seen = stop, after_bytes, 0

    def on_bytes(self, count: int) -> None:
        self.seen += count
        if self.seen >= self.after_bytes:
            self.stop.set()


def test_a_stopped_pull_ends_within_a_chunk_keeps_nothing_loadable_and_resumes(
    s3: S3Client, populated: str, small_model: Path, tmp_path: Path
) -> None:
    """``pull_model(stop=)`` (the launcher's, when the engine it streams to exits): the workers end
    at their next chunk, nothing enters models/, and the journal lets the next pull resume."""
    stop = threading.Event()
    settings = ONE_AT_A_TIME.model_copy(update={"stream_chunk_bytes": 64 * 1024})
    progress = StopAfter(stop, after_bytes=int(1.5 * MiB))
    root = tmp_path / "node"
    with pytest.raises(PullStoppedError, match="the pull was stopped"):
        pull_model(populated, root, settings, client=s3, progress=progress, stop=stop)
    # Stopped at the next chunk: at most one more chunk after the byte count that set it.
    assert progress.seen <= int(1.5 * MiB) + 64 * 1024
    assert not any((root / "models").iterdir())
    journals = list((root / "staging").rglob("*.journal"))
    done_parts = sum(len(j.read_text().splitlines()) - 1 for j in journals)
    assert done_parts >= 1, "the stopped pull kept its journal"

    with pull_model(populated, root, settings, client=s3) as again:
        assert again.result is not None
        assert again.result.reused_bytes >= done_parts * MiB
        assert again.result.downloaded_bytes <= sum(SMALL_MODEL.values()) - done_parts * MiB
        assert tree_bytes(again.path) == tree_bytes(small_model)


HOLD_LOCK_SCRIPT = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


def test_a_pull_waiting_for_another_pods_lock_stops_within_a_poll(s3: S3Client, populated: str, tmp_path: Path) -> None:
    """Another process (another pod on the node) holds the model's lock, pulling it; this pull waits
    up to lock_timeout_s, but its engine exited: ``stop`` ends the wait within one lock poll, and
    nothing is written."""
    root = tmp_path / "node"
    digest = fetch_manifest(s3, S3Uri.parse(populated)).digest
    (root / "locks").mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK_SCRIPT, str(root / "locks" / f"{digest}.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        stop = threading.Event()
        outcome: list[BaseException] = []

        def pull() -> None:
            try:
                pull_model(populated, root, ONE_AT_A_TIME, client=s3, stop=stop).release()
            except BaseException as e:  # the test thread reads it below
                outcome.append(e)

        worker = threading.Thread(target=pull)
        worker.start()
        time.sleep(1.0)
        assert worker.is_alive(), f"the pull should still wait for the lock: {outcome}"
        stopped_at = time.monotonic()
        stop.set()
        worker.join(timeout=10)
        waited = time.monotonic() - stopped_at
        assert not worker.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], PullStoppedError), outcome
        assert "stopped while another process held it" in str(outcome[0])
        assert waited < 2 * NodeCacheSettings().lock_poll_s + 0.5, waited
        assert not any((root / "models").iterdir()) and not any((root / "staging").iterdir())
    finally:
        holder.kill()
        holder.wait()


FULL_DISK_SCRIPT = """
import json, os, shutil, sys
from pathlib import Path
from kvfleet.weight_cache import DiskFullError, PullSettings, S3Settings, pull_model
from kvfleet.weight_cache.progress import NullProgress
from kvfleet.weight_cache.settings import MiB

root, mode = Path(sys.argv[1]), sys.argv[5]
settings = S3Settings(endpoint_url=sys.argv[2], region="us-east-1", credentials_dir=Path(sys.argv[3]))


class FillWhenBytesFlow(NullProgress):
    # Another tenant of the disk takes every free byte once the pull has started writing.
    def __init__(self):
        self.filled = False

    def on_bytes(self, count):
        if not self.filled:
            self.filled = True
            with (root / "other-tenant").open("wb") as f:
                try:
                    while True:
                        f.write(b"x" * (64 * 1024))
                except OSError:
                    pass


error = None
progress = FillWhenBytesFlow() if mode == "fill-during" else None
try:
    pull_model(sys.argv[4], root, PullSettings(part_size_bytes=MiB, concurrency=2), s3=settings, progress=progress)
except DiskFullError as e:
    error = str(e)
files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
print(json.dumps({"error": error, "files": files}))
"""


@pytest.mark.parametrize(
    ("mode", "size", "cause"),
    [("too-small", "3m", "checked before the download"), ("fill-during", "16m", "No space left on device")],
)
def test_a_full_disk_fails_clearly_and_leaves_no_partial_file(
    s3_endpoint: str, credentials_dir: Path, populated: str, tmp_path: Path, mode: str, size: str, cause: str
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs in a private mount namespace")
    root = tmp_path / "node-cache"
    root.mkdir()
    # A small tmpfs (the model is 4.2 MB) in a mount namespace of the pull's own: the host is untouched.
    mount = f"mount -t tmpfs -o size={size} kvfleet-full-disk {root}"
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    command += [f'{mount} && exec "$0" -c "$1" "$2" "$3" "$4" "$5" "$6"', sys.executable, FULL_DISK_SCRIPT]
    command += [str(root), s3_endpoint, str(credentials_dir), populated, mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0 and "mount" in done.stderr and "permission" in done.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["error"] is not None, report
    assert "no space left for the model" in report["error"] and cause in report["error"], report["error"]
    # Only the cache's bookkeeping (metadata, locks) and the other tenant's file are left: no model
    # file, no partial file, no journal.
    left = [f for f in report["files"] if not f.startswith(("meta/", "locks/")) and f != "other-tenant"]
    assert left == [], report["files"]
