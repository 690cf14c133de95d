"""populate and pull against a real S3 server (SeaweedFS; real HTTP, real boto3)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ConnectionClosedError

from kvfleet.weight_cache import (
    ChecksumMismatchError,
    DisallowedFileError,
    ManifestError,
    PopulateSettings,
    PullSettings,
    S3Settings,
    S3Uri,
    SourceUnavailableError,
    TransferError,
    UnsafePathError,
    fetch_manifest,
    make_client,
    populate,
    pull_to_dir,
)
from kvfleet.weight_cache.progress import CountingProgress, PullTracker
from kvfleet.weight_cache.s3 import S3Client
from kvfleet_testkit.seaweedfs import SeaweedS3
from tests.conftest import pick_free_port
from tests.weight_cache.conftest import SMALL_MODEL, MiB, tree_bytes, write_model

# 1 MiB parts keep "a file larger than the part size" small; 3 workers interleave files.
TEST_PULL = PullSettings(concurrency=3, part_size_bytes=MiB, retry_backoff_s=0.0)
TEST_POPULATE = PopulateSettings(concurrency=4, part_size_bytes=5 * MiB)


class _GetCounter:
    """Counts the GetObject calls the client makes (botocore's event hooks; no patching)."""

    def __init__(self, client: S3Client) -> None:
        self.ranges: list[str] = []
        client.meta.events.register("before-call.s3.GetObject", self._on_get)

    def _on_get(self, params: dict[str, object], **kwargs: object) -> None:
        headers = params.get("headers", {})
        assert isinstance(headers, dict)
        self.ranges.append(str(headers.get("Range", "")))


def test_round_trip_multi_file_model(s3: S3Client, bucket: str, small_model: Path, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/models/small"
    pushed = populate(s3, small_model, uri, TEST_POPULATE, model_id="org/small", revision="r1")
    assert pushed.uploaded_files == len(SMALL_MODEL) and pushed.manifest_written

    counter = _GetCounter(s3)
    progress = CountingProgress()
    result = pull_to_dir(s3, S3Uri.parse(uri), tmp_path / "dest", TEST_PULL, progress=progress)

    assert tree_bytes(tmp_path / "dest") == tree_bytes(small_model)
    assert not (tmp_path / "dest" / ".kvfleet-partial").exists()
    assert result.digest == pushed.digest
    assert result.downloaded_bytes == sum(SMALL_MODEL.values()) == progress.transferred_bytes
    assert sorted(progress.files_done) == sorted(SMALL_MODEL)
    # 3.5 MiB file -> 4 ranged GETs, 700 KiB -> 1, two small files -> 1 each, empty file -> 0; plus the manifest.
    ranged = [r for r in counter.ranges if r and r != "bytes=0-33554432"]
    assert len(ranged) == 4 + 1 + 1 + 1
    assert "bytes=3145728-3670015" in ranged  # the last, short part of the big file
    assert "pulled" in result.throughput_line() and "MB/s" in result.throughput_line()

    manifest = json.loads(s3.get_object(Bucket=bucket, Key="models/small/manifest.json")["Body"].read())
    assert manifest["modelId"] == "org/small" and manifest["revision"] == "r1"
    sizes = {f["path"]: f["sizeBytes"] for f in manifest["files"]}
    assert sizes == SMALL_MODEL


def test_populate_is_idempotent(s3: S3Client, bucket: str, small_model: Path) -> None:
    uri = f"s3://{bucket}/m"
    first = populate(s3, small_model, uri, TEST_POPULATE)
    again = populate(s3, small_model, uri, TEST_POPULATE)
    assert again.uploaded_files == 0 and again.skipped_files == len(SMALL_MODEL)
    assert not again.manifest_written and again.digest == first.digest
    (small_model / "config.json").write_text('{"changed": true}')
    third = populate(s3, small_model, uri, TEST_POPULATE)
    assert third.uploaded_files == 1 and third.manifest_written and third.digest != first.digest


def test_object_replaced_on_server_is_detected(
    s3: S3Client, bucket: str, small_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = f"s3://{bucket}/m"
    populate(s3, small_model, uri, TEST_POPULATE)
    # Same size, different bytes: only the sha256 can tell.
    key = "m/model-00002-of-00002.safetensors"
    s3.put_object(Bucket=bucket, Key=key, Body=b"\0" * SMALL_MODEL["model-00002-of-00002.safetensors"])
    counter = _GetCounter(s3)
    with caplog.at_level(logging.WARNING), pytest.raises(ChecksumMismatchError) as info:
        pull_to_dir(s3, S3Uri.parse(uri), tmp_path / "dest", TEST_PULL)
    assert info.value.path == "model-00002-of-00002.safetensors"
    assert "model-00002-of-00002.safetensors" in str(info.value) and "downloaded 2 times" in str(info.value)
    # Downloaded once per file attempt; the other files were finished and kept.
    assert sum(1 for r in counter.ranges if r == f"bytes=0-{700 * 1024 - 1}") == TEST_PULL.file_attempts
    assert (tmp_path / "dest" / "config.json").read_bytes() == (small_model / "config.json").read_bytes()
    assert not (tmp_path / "dest" / "model-00002-of-00002.safetensors").exists()
    assert "does not match" in caplog.text

    # A replacement with a different size is refused before any byte of it is fetched.
    s3.put_object(Bucket=bucket, Key=key, Body=b"short")
    with pytest.raises(Exception, match="replaced after populate"):
        pull_to_dir(s3, S3Uri.parse(uri), tmp_path / "dest2", TEST_PULL)


class _Interrupt(Exception):
    pass


class _StopAfter(CountingProgress):
    """Interrupts the pull (as Ctrl-C or a killed pod would) after some bytes arrived."""

    def __init__(self, stop_after_bytes: int) -> None:
        super().__init__()
        self.stop_after_bytes = stop_after_bytes

    def on_bytes(self, count: int) -> None:
        super().on_bytes(count)
        if self.transferred_bytes >= self.stop_after_bytes:
            raise _Interrupt


def test_interrupted_pull_resumes_without_refetching_finished_parts(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    src = write_model(tmp_path / "src", {"big.safetensors": 6 * MiB, "config.json": 100})
    uri = S3Uri.parse(f"s3://{bucket}/big")
    populate(s3, src, str(uri), TEST_POPULATE)
    dest = tmp_path / "dest"
    one_worker = PullSettings(concurrency=1, part_size_bytes=MiB)

    with pytest.raises(_Interrupt):
        # config.json (100 bytes) comes first (small files before weights), then parts 0-2 of big;
        # the first chunk of part 3 crosses the line.
        pull_to_dir(s3, uri, dest, one_worker, progress=_StopAfter(3 * MiB + 100 + 1))
    journal = next((dest / ".kvfleet-partial").glob("*.journal"))
    done_parts = [int(x) for x in journal.read_text().splitlines()[1:]]
    assert done_parts == [0, 1, 2]

    counter = _GetCounter(s3)
    tracker = PullTracker()
    result = pull_to_dir(s3, uri, dest, one_worker, progress=tracker)
    assert tree_bytes(dest) == tree_bytes(src)
    # What a progress reader sees: every byte in place, only the missing ones moved.
    report = tracker.report()
    assert report is not None and report.percent == 100
    # config.json came whole in the first pull (small files first): it is in place, not fetched again.
    assert (report.done_bytes, report.downloaded_bytes) == (6 * MiB + 100, 3 * MiB)
    big_ranges = [r for r in counter.ranges if r.startswith("bytes=") and r != "bytes=0-33554432" and r != "bytes=0-99"]
    assert big_ranges == [f"bytes={i * MiB}-{(i + 1) * MiB - 1}" for i in (3, 4, 5)]
    assert result.downloaded_bytes == 3 * MiB and result.reused_bytes == 3 * MiB + 100

    # A third pull finds every file in place (rehashed locally) and downloads nothing.
    counter.ranges.clear()
    result = pull_to_dir(s3, uri, dest, one_worker)
    assert result.downloaded_bytes == 0 and result.files_reused == 2
    assert counter.ranges == ["bytes=0-33554432"]  # the manifest only


def test_resume_discards_partial_data_when_the_object_changed(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    src = write_model(tmp_path / "src", {"big.safetensors": 4 * MiB})
    uri = S3Uri.parse(f"s3://{bucket}/big")
    populate(s3, src, str(uri), TEST_POPULATE)
    dest = tmp_path / "dest"
    one_worker = PullSettings(concurrency=1, part_size_bytes=MiB)
    with pytest.raises(_Interrupt):
        pull_to_dir(s3, uri, dest, one_worker, progress=_StopAfter(2 * MiB))
    # Re-upload the same bytes as a multipart upload: a new ETag, so the journal's parts no longer count.
    multipart = TransferConfig(multipart_threshold=MiB, multipart_chunksize=MiB)
    s3.upload_file(str(src / "big.safetensors"), bucket, "big/big.safetensors", Config=multipart)
    result = pull_to_dir(s3, uri, dest, one_worker)
    assert result.downloaded_bytes == 4 * MiB and result.reused_bytes == 0
    assert tree_bytes(dest) == tree_bytes(src)


def _put_manifest(s3: S3Client, bucket: str, prefix: str, files: list[dict[str, object]]) -> None:
    body = json.dumps({"schema": "kvfleet.io/model-manifest/v1", "modelId": "x", "files": files}).encode()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/manifest.json", Body=body)


def test_path_traversal_keys_are_refused(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    _put_manifest(s3, bucket, "evil", [{"path": "../../escape.json", "sizeBytes": 2, "sha256": "a" * 64}])
    s3.put_object(Bucket=bucket, Key="escape.json", Body=b"{}")
    with pytest.raises(ManifestError, match=r"'\.\.'"):
        pull_to_dir(s3, S3Uri.parse(f"s3://{bucket}/evil"), tmp_path / "dest", TEST_PULL)
    assert not (tmp_path / "escape.json").exists()

    # A symlink planted in DEST does not lead a write outside it.
    dest = tmp_path / "dest2"
    dest.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (dest / "sub").symlink_to(tmp_path / "elsewhere")
    _put_manifest(s3, bucket, "linked", [{"path": "sub/a.json", "sizeBytes": 2, "sha256": "a" * 64}])
    with pytest.raises(UnsafePathError, match="outside"):
        pull_to_dir(s3, S3Uri.parse(f"s3://{bucket}/linked"), dest, TEST_PULL)
    assert list((tmp_path / "elsewhere").iterdir()) == []

    with pytest.raises(ValueError, match=r"'\.\.'"):
        populate(s3, tmp_path, f"s3://{bucket}/a/../b", TEST_POPULATE)


def test_pickle_weights_are_refused_unless_allowed(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    src = write_model(tmp_path / "src", {"pytorch_model.bin": 1000, "config.json": 10})
    with pytest.raises(DisallowedFileError, match=r"pytorch_model\.bin"):
        populate(s3, src, f"s3://{bucket}/p", TEST_POPULATE)
    populate(s3, src, f"s3://{bucket}/p", TEST_POPULATE.model_copy(update={"allow_pickle": True}))
    with pytest.raises(DisallowedFileError, match=r"pytorch_model\.bin"):
        pull_to_dir(s3, S3Uri.parse(f"s3://{bucket}/p"), tmp_path / "dest", TEST_PULL)
    assert not (tmp_path / "dest" / "config.json").exists()  # refused before downloading anything
    allowed = TEST_PULL.model_copy(update={"allow_pickle": True})
    pull_to_dir(s3, S3Uri.parse(f"s3://{bucket}/p"), tmp_path / "dest", allowed)
    assert tree_bytes(tmp_path / "dest") == tree_bytes(src)


def test_missing_manifest_is_a_clear_error(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="populate"):
        fetch_manifest(s3, S3Uri.parse(f"s3://{bucket}/nothing"))


def test_hf_source_unreachable_fails_clearly(s3: S3Client, bucket: str) -> None:
    closed = f"http://127.0.0.1:{pick_free_port()}"
    with pytest.raises(SourceUnavailableError, match=r"hf://org/name@main: cannot download from http://127\.0\.0\.1"):
        populate(s3, "hf://org/name@main", f"s3://{bucket}/hf", TEST_POPULATE, hf_endpoint=closed)
    with pytest.raises(ValueError, match="repo id"):
        populate(s3, "hf://../etc@main", f"s3://{bucket}/hf", TEST_POPULATE)


def test_credentials_come_from_the_mounted_directory_and_are_not_shown(
    s3: S3Client, s3_settings: S3Settings, seaweedfs: SeaweedS3, caplog: pytest.LogCaptureFixture
) -> None:
    creds = s3._request_signer._credentials  # the signer boto3 built from the mounted files
    assert creds.access_key == seaweedfs.access_key
    s3.list_buckets()  # the server accepts them
    assert seaweedfs.secret_key not in repr(s3_settings) and seaweedfs.secret_key not in caplog.text


class _FlakyNetwork:
    """Drops the connection of some GETs (botocore's before-send hook: an injected network fault)."""

    def __init__(self, client: S3Client, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        client.meta.events.register("before-send.s3.GetObject", self._on_send)

    def _on_send(self, request: object, **kwargs: object) -> None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionClosedError(endpoint_url="http://127.0.0.1/flaky")


def test_dropped_connections_are_retried_then_fail_naming_the_file(
    s3_settings: S3Settings, bucket: str, small_model: Path, tmp_path: Path
) -> None:
    # One attempt per request in botocore, so the failures reach kvfleet's own retry of the part.
    client = make_client(s3_settings.model_copy(update={"request_attempts": 1}))
    uri = f"s3://{bucket}/m"
    populate(client, small_model, uri, TEST_POPULATE)
    manifest = fetch_manifest(client, S3Uri.parse(uri))
    one_at_a_time = TEST_PULL.model_copy(update={"concurrency": 1, "part_attempts": 3})
    flaky = _FlakyNetwork(client, failures=2)
    result = pull_to_dir(client, S3Uri.parse(uri), tmp_path / "ok", one_at_a_time, fetched=manifest)
    assert tree_bytes(tmp_path / "ok") == tree_bytes(small_model)
    assert result.downloaded_bytes == sum(SMALL_MODEL.values())

    flaky.failures = 1000
    with pytest.raises(TransferError, match=r"failed after 3 attempts") as info:
        pull_to_dir(client, S3Uri.parse(uri), tmp_path / "bad", one_at_a_time, fetched=manifest)
    assert info.value.path in SMALL_MODEL


def test_byte_identical_files_are_each_pulled(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    """Two files with the same content (a tokenizer copied under two names, a tied-weight shard)
    shared one partial file: the first rename took it and the second raised FileNotFoundError."""
    src = tmp_path / "src"
    src.mkdir()
    same = bytes(range(256)) * 9000  # 2.2 MiB: several ranged parts each
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "a.safetensors").write_bytes(same)
    (src / "b.safetensors").write_bytes(same)
    uri = f"s3://{bucket}/twins"
    populate(s3, src, uri, TEST_POPULATE)
    pull_to_dir(s3, S3Uri.parse(uri), tmp_path / "dest", TEST_PULL)
    assert tree_bytes(tmp_path / "dest") == tree_bytes(src)


@pytest.mark.parametrize(
    "durability",
    [
        {"fsync": True, "start_writeback": True},
        {"fsync": True, "start_writeback": False},
        {"fsync": False},
    ],
    ids=["fsync-writeback-as-chunks-land", "fsync-at-the-end-only", "no-fsync"],
)
def test_every_durability_policy_places_the_same_verified_bytes(
    s3: S3Client, bucket: str, small_model: Path, tmp_path: Path, durability: dict[str, bool]
) -> None:
    uri = f"s3://{bucket}/models/small"
    populate(s3, small_model, uri, TEST_POPULATE)
    settings = TEST_PULL.model_copy(update=durability)
    pull_to_dir(s3, S3Uri.parse(uri), tmp_path / "dest", settings)
    assert tree_bytes(tmp_path / "dest") == tree_bytes(small_model)
    assert not (tmp_path / "dest" / ".kvfleet-partial").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range(2) is Linux's")
def test_sync_file_range_comes_from_libc_on_linux_and_reports_errors(tmp_path: Path) -> None:
    """CPython's os has no sync_file_range: the pull reaches libc's through ctypes, or its early
    writeback would silently never run (as it did before)."""
    from kvfleet.weight_cache.partial_file import _SYNC_FILE_RANGE, _SYNC_FILE_RANGE_WRITE

    assert _SYNC_FILE_RANGE is not None
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * MiB, 0)
        _SYNC_FILE_RANGE(fd, 0, MiB, _SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="Bad file descriptor"):
        _SYNC_FILE_RANGE(fd, 0, MiB, _SYNC_FILE_RANGE_WRITE)
