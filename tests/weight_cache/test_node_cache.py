"""The node cache: single-flight pulls across processes, leases, LRU eviction, hits."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvfleet.weight_cache import (
    ManifestError,
    NodeCacheFullError,
    NodeCacheSettings,
    PopulateSettings,
    PulledModel,
    PullSettings,
    S3Settings,
    S3Uri,
    fetch_manifest,
    make_client,
    populate,
    pull_model,
)
from kvfleet.weight_cache.leases import live_leases
from kvfleet.weight_cache.node_cache import NodeCache
from kvfleet.weight_cache.s3 import S3Client
from tests.conftest import pick_free_port
from tests.weight_cache.conftest import MiB, env_for_subprocess, tree_bytes, write_model

PULL = PullSettings(concurrency=2, part_size_bytes=MiB)
POP = PopulateSettings(concurrency=4, part_size_bytes=5 * MiB)

PULLER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from kvfleet.weight_cache import PullSettings, pull_model
    print("ready", flush=True)
    settings = PullSettings(concurrency=2, part_size_bytes=1 << 20)
    # No endpoint given: boto3's standard configuration (AWS_ENDPOINT_URL) picks the server.
    with pull_model(sys.argv[1], Path(sys.argv[2]), settings) as model:
        print(json.dumps({"hit": model.hit, "downloaded": model.result.downloaded_bytes if model.result else 0,
                          "digest": model.digest}), flush=True)
    """
)


def _populate(s3: S3Client, bucket: str, tmp_path: Path, name: str, size: int) -> tuple[str, Path]:
    src = write_model(tmp_path / f"src-{name}", {"model.safetensors": size, "config.json": 64}, seed=hash(name))
    uri = f"s3://{bucket}/{name}"
    populate(s3, src, uri, POP, model_id=name)
    return uri, src


@pytest.mark.slow
def test_two_concurrent_pullers_on_one_node_download_once(
    s3: S3Client, bucket: str, tmp_path: Path, s3_endpoint: str, credentials_dir: Path
) -> None:
    uri, src = _populate(s3, bucket, tmp_path, "shared", 6 * MiB)
    root = tmp_path / "node-cache"
    cache = NodeCache(root)
    digest = fetch_manifest(s3, S3Uri.parse(uri)).digest
    env = env_for_subprocess(s3_endpoint, credentials_dir)
    procs: list[subprocess.Popen[str]] = []
    try:
        # Hold the model's lock while both start, so both are sure to contend for it.
        with cache.model_lock(digest):
            for _ in range(2):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", PULLER, uri, str(root)],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            for proc in procs:
                assert proc.stdout is not None
                assert proc.stdout.readline().strip() == "ready"
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sorted(o["hit"] for o in outputs) == [False, True]
    assert sorted(o["downloaded"] for o in outputs) == [0, 6 * MiB + 64]
    assert {o["digest"] for o in outputs} == {digest}
    assert tree_bytes(root / "models" / digest) == tree_bytes(src)
    assert live_leases(root / "leases" / digest, remove_dead=True) == []  # both released on exit


def test_eviction_respects_in_use_leases(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    uris = {name: _populate(s3, bucket, tmp_path, name, MiB)[0] for name in ("a", "b", "c")}
    root = tmp_path / "node-cache"
    # Each model is 1 MiB + 64 bytes; room for two.
    settings = NodeCacheSettings(size_limit_bytes=2 * MiB + 200, lock_poll_s=0.01)
    ticks = itertools.count(1000)

    def pull(name: str) -> PulledModel:
        return pull_model(uris[name], root, PULL, node_cache_settings=settings, client=s3, clock=lambda: next(ticks))

    a = pull("a")  # oldest, but leased by this process for the whole test
    b = pull("b")
    b.release()
    c = pull("c")  # evicts b (idle), keeps a (in use) although a is older
    models = root / "models"
    assert (models / a.digest).is_dir() and (models / c.digest).is_dir()
    assert not (models / b.digest).exists()

    with pytest.raises(NodeCacheFullError, match="in use"):
        pull("b")  # a and c are both leased: nothing may go
    a.release()
    b2 = pull("b")
    assert b2.hit is False
    assert not (models / a.digest).exists() and (models / c.digest).is_dir()


def test_lease_of_a_dead_process_does_not_pin_a_model(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    uris = {name: _populate(s3, bucket, tmp_path, name, MiB)[0] for name in ("a", "b")}
    root = tmp_path / "node-cache"
    settings = NodeCacheSettings(size_limit_bytes=MiB + 200)
    a = pull_model(uris["a"], root, PULL, node_cache_settings=settings, client=s3)
    a.release()
    # A process that took a lease and died without releasing it (its lock died with it).
    take = "import sys; from pathlib import Path; from kvfleet.weight_cache.leases import create_lease; "
    take += "create_lease(Path(sys.argv[1]), sys.argv[2])"
    subprocess.run([sys.executable, "-c", take, str(root / "leases" / a.digest), a.digest], check=True)
    assert len(list((root / "leases" / a.digest).glob("*.lease"))) == 1
    b = pull_model(uris["b"], root, PULL, node_cache_settings=settings, client=s3)
    assert not a.path.exists() and b.path.is_dir()
    b.release()


def test_hit_checks_sizes_repairs_and_survives_s3_outage(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    uri, src = _populate(s3, bucket, tmp_path, "m", 2 * MiB)
    root = tmp_path / "node-cache"
    with pull_model(uri, root, PULL, client=s3) as first:
        assert not first.hit and tree_bytes(first.path) == tree_bytes(src)
    with pull_model(uri, root, PULL, client=s3) as again:
        assert again.hit and again.result is None
    # A truncated file in the cache is found on the next hit and pulled again.
    (first.path / "model.safetensors").write_bytes(b"torn")
    with pull_model(uri, root, PULL, client=s3) as repaired:
        assert not repaired.hit and tree_bytes(repaired.path) == tree_bytes(src)
    with pytest.raises(ManifestError, match="expected"):
        pull_model(uri, root, PULL, client=s3, expected_digest="0" * 64)

    # S3 down: a model pinned by digest and already on the node still starts.
    down = make_client(
        S3Settings(endpoint_url=f"http://127.0.0.1:{pick_free_port()}", region="us-east-1", request_attempts=1)
    )
    started = time.monotonic()
    with pull_model(uri, root, PULL, client=down, expected_digest=first.digest) as offline:
        assert offline.hit and offline.path == first.path
    assert time.monotonic() - started < 30


def _plant(path: Path, size: int) -> None:
    """Replace a cached file with one of the same size and other content (a new inode, as a co-tenant's
    write through another mount, or a careless copy, would give)."""
    planted = path.with_name(path.name + ".planted")
    planted.write_bytes(b"\x00" * size)
    planted.replace(path)


@pytest.mark.parametrize("verify", ["sha256", "stat"])
def test_a_planted_file_of_the_right_size_is_refused_and_fetched_again(
    s3: S3Client, bucket: str, tmp_path: Path, verify: str
) -> None:
    uri, src = _populate(s3, bucket, tmp_path, "m", 2 * MiB)
    root = tmp_path / "node-cache"
    settings = PULL.model_copy(update={"verify_on_hit": verify})
    with pull_model(uri, root, settings, client=s3) as first:
        assert not first.hit
    weights = first.path / "model.safetensors"
    _plant(weights, 2 * MiB)
    with pull_model(uri, root, settings, client=s3) as repaired:
        assert not repaired.hit
        assert repaired.check.reasons == (
            "model.safetensors: sha256 differs from the manifest's (a damaged or planted file)",
        )
        assert repaired.check.refused_count == 1 and repaired.check.good == {"config.json"}
        # Only the refused file came again; the one that hashed right was kept.
        assert repaired.result is not None and repaired.result.downloaded_bytes == 2 * MiB
        assert tree_bytes(repaired.path) == tree_bytes(src)
    with pull_model(uri, root, settings, client=s3) as again:
        assert again.hit and again.check.reasons == ()


def test_the_stat_mode_hashes_only_files_touched_since_they_were_verified(
    s3: S3Client, bucket: str, tmp_path: Path
) -> None:
    uri, src = _populate(s3, bucket, tmp_path, "m", 2 * MiB)
    root = tmp_path / "node-cache"
    stat_mode = PULL.model_copy(update={"verify_on_hit": "stat"})
    with pull_model(uri, root, stat_mode, client=s3) as first:
        pass
    with pull_model(uri, root, stat_mode, client=s3) as hit:
        assert hit.hit and hit.check.hashed_bytes == 0  # recorded at the verified download
    with pull_model(uri, root, PULL, client=s3) as full:
        assert full.hit and full.check.hashed_bytes == 2 * MiB + 64
    # Rewritten in place with its old size and mtime put back: ctime moves, so it is hashed and refused.
    weights = first.path / "model.safetensors"
    before = weights.stat()
    with weights.open("r+b") as f:
        f.write(b"\xff" * 16)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_mtime_ns == before.st_mtime_ns and weights.stat().st_size == before.st_size
    with pull_model(uri, root, stat_mode, client=s3) as repaired:
        assert not repaired.hit and repaired.check.hashed_bytes == 2 * MiB
        assert tree_bytes(repaired.path) == tree_bytes(src)


def test_a_symlink_in_place_of_a_cached_file_is_refused(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    uri, src = _populate(s3, bucket, tmp_path, "m", MiB)
    root = tmp_path / "node-cache"
    with pull_model(uri, root, PULL, client=s3) as first:
        pass
    outside = tmp_path / "elsewhere.safetensors"
    (first.path / "model.safetensors").replace(outside)  # right size, right content, but outside
    (first.path / "model.safetensors").symlink_to(outside)
    with pull_model(uri, root, PULL, client=s3) as repaired:
        assert repaired.check.reasons == ("model.safetensors: not a regular file inside the model's directory",)
        assert not (repaired.path / "model.safetensors").is_symlink()
        assert tree_bytes(repaired.path) == tree_bytes(src)
    assert outside.exists()  # the link's target was not touched


def test_with_s3_down_a_forged_copy_of_the_pinned_manifest_is_refused(
    s3: S3Client, bucket: str, tmp_path: Path
) -> None:
    uri, _ = _populate(s3, bucket, tmp_path, "m", MiB)
    root = tmp_path / "node-cache"
    with pull_model(uri, root, PULL, client=s3) as first:
        pass
    stored = root / "meta" / f"{first.digest}.manifest"
    doc = json.loads(stored.read_bytes())
    doc["files"][0]["sha256"] = "0" * 64
    stored.write_text(json.dumps(doc))
    down = make_client(
        S3Settings(endpoint_url=f"http://127.0.0.1:{pick_free_port()}", region="us-east-1", request_attempts=1)
    )
    with pytest.raises(ManifestError, match=r"node cache's manifest of .* hashes to .*; refusing it"):
        pull_model(uri, root, PULL, client=down, expected_digest=first.digest)


HOLD = """
import sys, time
from pathlib import Path
from kvfleet.weight_cache.leases import create_lease
create_lease(Path(sys.argv[1]), "d")
print("held", flush=True)
time.sleep(60)
"""


def test_a_lease_held_in_another_pid_namespace_counts(tmp_path: Path) -> None:
    """Pods on one node share the node cache but not their PID namespace: a pid in a lease meant
    nothing across them, and a live lease was deleted as dead. The lock holds across namespaces."""
    import shutil

    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode != 0
    ):
        pytest.skip("unshare --pid is not permitted here (needs CAP_SYS_ADMIN)")
    leases = tmp_path / "leases"
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c", HOLD, str(leases)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (lease,) = leases.glob("*.lease")
        assert json.loads(lease.read_text())["pid"] == 1  # pid 1 of its own namespace, not ours
        assert live_leases(leases, remove_dead=True) == [lease]
        assert lease.exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder (killed with its namespace a moment after unshare) is gone, and its lock with it.
    deadline = time.monotonic() + 10
    while live_leases(leases, remove_dead=True) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_leases(leases, remove_dead=True) == []
    assert not lease.exists()
