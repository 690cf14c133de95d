"""A pull into the node cache that fills an engine's folder as it goes (``pull_model(stream_link=)``),
on the real S3 server: the folder lists the model's files first, then shows each file only once its
sha256 matched, the small files before the shards; a shard whose bytes differ from the manifest
never appears there, and the files verified before it stay loadable. A watcher thread hashes every
file the moment it appears, so an unverified or partial file would be caught."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from kvfleet.weight_cache import ChecksumMismatchError, PullSettings, populate, pull_model
from kvfleet.weight_cache.manifest import Manifest
from kvfleet.weight_cache.s3 import S3Client
from kvfleet.weight_stream import LISTING, TMP_PREFIX
from tests.weight_cache.conftest import MiB, write_model

# Three shards of several parts each, and the small files an engine reads first.
SHARDED = {
    "model-00001-of-00003.safetensors": 3 * MiB,
    "model-00002-of-00003.safetensors": 3 * MiB,
    "model-00003-of-00003.safetensors": 2 * MiB,
    "model.safetensors.index.json": 300,
    "config.json": 200,
    "tokenizer.json": 5000,
}
SETTINGS = PullSettings(part_size_bytes=MiB, concurrency=2, stream_chunk_bytes=256 * 1024, retry_backoff_s=0)


class Watcher:
    """Polls the engine's folder while a pull runs; records the order files appear in and the
    sha256 each one had the moment it was first seen."""

    def __init__(self, link: Path) -> None:
        self.link = link
        self.seen: dict[str, str] = {}
        self.order: list[str] = []
        self.poll_of: dict[str, int] = {}  # the poll each name was first seen in
        self.polls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self._look()
            self.stop.wait(0.002)
        self._look()

    def _look(self) -> None:
        self.polls += 1
        if not self.link.exists():
            return
        for path in sorted(self.link.iterdir()):
            if path.name in self.seen or path.name.startswith(TMP_PREFIX) or not path.is_file():
                continue  # a name being written (never listed, never opened by an engine)
            self.order.append(path.name)
            self.poll_of[path.name] = self.polls
            self.seen[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def _manifest(s3: S3Client, bucket: str, prefix: str) -> Manifest:
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read()
    return Manifest.from_bytes(body)


def test_the_engines_folder_shows_only_verified_files_small_ones_first(
    s3: S3Client, bucket: str, tmp_path: Path
) -> None:
    src = write_model(tmp_path / "src", SHARDED)
    populate(s3, src, f"s3://{bucket}/m")
    manifest = _manifest(s3, bucket, "m")
    link = tmp_path / "engine" / "model"
    watcher = Watcher(link)
    try:
        pulled = pull_model(f"s3://{bucket}/m", tmp_path / "node", SETTINGS, client=s3, stream_link=link)
    finally:
        watcher.finish()
    pulled.release()
    expected = {e.path: e.sha256 for e in manifest.files}
    assert json.loads((link / LISTING).read_text())["files"] == [e.path for e in manifest.files]
    files = [n for n in watcher.order if n != LISTING]
    assert {n: watcher.seen[n] for n in files} == expected  # every file, each complete when first seen
    assert watcher.order[0] == LISTING
    weights = [n for n in files if n.endswith(".safetensors")]
    # The small files (fetched side by side, in any order among themselves) no later than any weight,
    # and the weights in the order a loader reads them (names seen in one poll count as together).
    small = [n for n in expected if not n.endswith(".safetensors")]
    polls = watcher.poll_of
    assert max(polls[n] for n in small) <= min(polls[n] for n in weights)
    assert [polls[n] for n in sorted(weights)] == sorted(polls[n] for n in weights)
    assert link.resolve() == (tmp_path / "node" / "streams" / pulled.digest)

    # A second start on this node: a hit, the same folder, the same files (no new links made).
    before = {p.name: p.stat().st_ino for p in link.iterdir() if p.name != LISTING}
    second_link = tmp_path / "engine2" / "model"
    again = pull_model(f"s3://{bucket}/m", tmp_path / "node", SETTINGS, client=s3, stream_link=second_link)
    again.release()
    assert again.hit and {p.name: p.stat().st_ino for p in second_link.iterdir() if p.name != LISTING} == before


def test_a_shard_that_does_not_match_the_manifest_never_reaches_the_engines_folder(
    s3: S3Client, bucket: str, tmp_path: Path
) -> None:
    src = write_model(tmp_path / "src", SHARDED)
    populate(s3, src, f"s3://{bucket}/m")
    bad = "model-00002-of-00003.safetensors"
    s3.put_object(Bucket=bucket, Key=f"m/{bad}", Body=b"\x01" * SHARDED[bad])  # same size, other bytes
    link = tmp_path / "engine" / "model"
    watcher = Watcher(link)
    try:
        with pytest.raises(ChecksumMismatchError, match=bad):
            pull_model(f"s3://{bucket}/m", tmp_path / "node", SETTINGS, client=s3, stream_link=link)
    finally:
        watcher.finish()
    expected = {e.path: e.sha256 for e in _manifest(s3, bucket, "m").files}
    assert bad not in watcher.seen and not (link / bad).exists()
    # What did show up was verified; the shard before the bad one is there for the engine to load.
    assert {n: h for n, h in watcher.seen.items() if n != LISTING} == {
        n: expected[n] for n in watcher.seen if n != LISTING
    }
    assert "model-00001-of-00003.safetensors" in watcher.seen
    assert not (tmp_path / "node" / "models").exists() or not any((tmp_path / "node" / "models").iterdir())


def test_a_file_damaged_in_the_node_cache_is_never_shown_to_the_next_engine(
    s3: S3Client, bucket: str, tmp_path: Path
) -> None:
    """The stream folder links the node cache's files, so damage to a cached file shows through the
    old link. The next streamed start checks the model first, drops the refused file's link before
    its engine sees the folder, and links the copy fetched again."""
    src = write_model(tmp_path / "src", SHARDED)
    populate(s3, src, f"s3://{bucket}/m")
    node = tmp_path / "node"
    first = pull_model(f"s3://{bucket}/m", node, SETTINGS, client=s3, stream_link=tmp_path / "e1" / "model")
    first.release()
    damaged = first.path / "model-00002-of-00003.safetensors"
    with damaged.open("r+b") as f:  # in place: the stream folder's link is this same inode
        f.write(b"\xff" * 64)

    link = tmp_path / "e2" / "model"
    watcher = Watcher(link)
    try:
        second = pull_model(f"s3://{bucket}/m", node, SETTINGS, client=s3, stream_link=link)
    finally:
        watcher.finish()
    second.release()
    assert not second.hit and second.check.refused_count == 1
    expected = {e.path: e.sha256 for e in _manifest(s3, bucket, "m").files}
    assert {n: h for n, h in watcher.seen.items() if n != LISTING} == expected  # every file, each verified
