"""Pure parts of the weight cache, checked with hand-computable numbers: manifests and digests,
path and file-type rules, part planning, backoff, eviction and fingerprints."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from kvfleet.weight_cache import DisallowedFileError, Manifest, ManifestError, PullSettings, UnsafePathError
from kvfleet.weight_cache.download import space_shortfall_bytes
from kvfleet.weight_cache.eviction import CacheEntry, plan_eviction
from kvfleet.weight_cache.fingerprint import (
    Accelerator,
    compile_relevant_args,
    detect_accelerator,
    fingerprint,
    read_driver_version,
)
from kvfleet.weight_cache.manifest import build_manifest
from kvfleet.weight_cache.parts import backoff_s, plan_parts
from kvfleet.weight_cache.s3 import S3Uri
from kvfleet.weight_cache.safety import check_file_allowed, check_relative_path, classify, resolve_inside

SHA_A = "a" * 64


def _manifest(*paths: str) -> Manifest:
    return Manifest.model_validate(
        {"modelId": "m", "files": [{"path": p, "sizeBytes": 1, "sha256": SHA_A} for p in paths]}
    )


def test_manifest_digest_is_sha256_of_canonical_bytes() -> None:
    m = _manifest("b.safetensors", "a.json")
    raw = m.to_bytes()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    assert m.digest == hashlib.sha256(raw).hexdigest()
    assert Manifest.from_bytes(raw) == m
    assert Manifest.from_bytes(raw).digest == m.digest


@pytest.mark.parametrize(
    ("paths", "needle"),
    [
        (("../evil.json",), "'..'"),
        (("/etc/passwd.json",), "relative"),
        (("a//b.json",), "empty"),
        (("a\\b.json",), "backslash"),
        (("x.json", "x.json"), "listed twice"),
        (("x", "x/y.json"), "directory"),
        ((".kvfleet-partial/x.json",), "reserved"),
    ],
)
def test_manifest_rejects_unsafe_paths(paths: tuple[str, ...], needle: str) -> None:
    raw = json.dumps(
        {
            "schema": "kvfleet.io/model-manifest/v1",
            "modelId": "m",
            "files": [{"path": p, "sizeBytes": 1, "sha256": SHA_A} for p in paths],
        }
    ).encode()
    with pytest.raises(ManifestError, match=needle):
        Manifest.from_bytes(raw)


def test_manifest_rejects_bad_fields_naming_them() -> None:
    raw = (
        b'{"schema":"kvfleet.io/model-manifest/v1","modelId":"m",'
        b'"files":[{"path":"a.json","sizeBytes":-1,"sha256":"zz"}]}'
    )
    with pytest.raises(ManifestError) as info:
        Manifest.from_bytes(raw)
    assert "files.0.sizeBytes" in str(info.value) and "files.0.sha256" in str(info.value)
    with pytest.raises(ManifestError, match="unknown manifest schema"):
        Manifest.from_bytes(b'{"schema":"other/v9","modelId":"m","files":[]}')


def test_file_type_policy() -> None:
    assert classify("model-00001.safetensors") == "allowed"
    assert classify("tokenizer.model") == "allowed"
    assert classify("LICENSE") == "allowed"
    assert classify("pytorch_model.bin") == "pickle"
    assert classify("consolidated.00.pth") == "pickle"
    assert classify("modeling_custom.py") == "other"
    with pytest.raises(DisallowedFileError, match="pickle"):
        check_file_allowed("pytorch_model.bin", allow_pickle=False)
    check_file_allowed("pytorch_model.bin", allow_pickle=True)
    with pytest.raises(DisallowedFileError, match=r"modeling_custom\.py"):
        check_file_allowed("modeling_custom.py", allow_pickle=True)


def test_resolve_inside_refuses_symlink_escape(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (dest / "sub").symlink_to(outside)
    assert resolve_inside(dest, "a/b.json") == dest.resolve() / "a" / "b.json"
    with pytest.raises(UnsafePathError, match="outside"):
        resolve_inside(dest, "sub/x.safetensors")
    with pytest.raises(UnsafePathError):
        check_relative_path("a/../b")


def test_s3_uri_parsing() -> None:
    assert S3Uri.parse("s3://bucket-1/models/llama/") == S3Uri("bucket-1", "models/llama")
    assert S3Uri.parse("s3://bucket-1").key("a.json") == "a.json"
    assert S3Uri.parse("s3://bucket-1/p").key("d/a.json") == "p/d/a.json"
    for bad in ("http://b/x", "s3://Bad_Bucket/x", "s3://bucket/../x", "s3://bucket/a//b"):
        with pytest.raises(ValueError):
            S3Uri.parse(bad)


def test_plan_parts_covers_the_file_exactly() -> None:
    parts = plan_parts(10, 4)
    assert [(p.start, p.length) for p in parts] == [(0, 4), (4, 4), (8, 2)]
    assert parts[2].http_range == "bytes=8-9"
    assert plan_parts(0, 4) == ()
    assert len(plan_parts(8, 4)) == 2


def test_backoff_doubles_and_caps() -> None:
    s = PullSettings(retry_backoff_s=0.5, retry_backoff_max_s=3)
    assert [backoff_s(a, s) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]


def test_pull_settings_validation_names_fields() -> None:
    with pytest.raises(ValidationError, match="retry_backoff_max_s"):
        PullSettings(retry_backoff_s=5, retry_backoff_max_s=1)
    with pytest.raises(ValidationError, match="concurrency"):
        PullSettings(concurrency=0)
    with pytest.raises(ValidationError, match="part_size_bytes"):
        PullSettings(part_size_bytes=10)


def _entry(d: str, size: int, used: float, in_use: bool = False, busy: bool = False) -> CacheEntry:
    return CacheEntry(digest=d, size_bytes=size, last_used_s=used, in_use=in_use, busy=busy)


def test_eviction_picks_least_recently_used_idle_models() -> None:
    entries = [_entry("a", 40, 1.0, in_use=True), _entry("b", 30, 2.0), _entry("c", 20, 3.0), _entry("d", 10, 0.5)]
    # 100 used + 25 needed, limit 100: evict 25+ idle bytes oldest first: d (10), then b (30).
    plan = plan_eviction(entries, need_bytes=25, limit_bytes=100)
    assert plan.fits and plan.evict == ("d", "b")
    assert plan_eviction(entries, need_bytes=0, limit_bytes=100).evict == ()
    # Only a (in use) and c (busy pulling) left: 60 bytes pinned, 50 more cannot fit in 100.
    pinned = [_entry("a", 40, 1.0, in_use=True), _entry("c", 20, 3.0, busy=True)]
    plan = plan_eviction(pinned, need_bytes=50, limit_bytes=100)
    assert not plan.fits and plan.evict == () and "in use" in plan.reason
    assert plan_eviction(entries, need_bytes=500, limit_bytes=None).fits


def test_compile_flags_are_normalised() -> None:
    assert compile_relevant_args(["--max-model-len", "4096", "--port", "8000", "--enforce-eager", "-O3"]) == (
        "--enforce-eager",
        "--max-model-len=4096",
        "-O=3",
    )
    assert compile_relevant_args(["--max-model-len=4096"]) == compile_relevant_args(["--max-model-len", "4096"])


def test_fingerprint_changes_with_every_field() -> None:
    acc = Accelerator(gpu_product="NVIDIA-H100-80GB-HBM3", cuda_version="12.4", driver_version="550.54", device_count=1)
    base = dict(
        engine_name="vllm",
        engine_version="0.8.0",
        model_digest=SHA_A,
        accelerator=acc,
        tensor_parallel_size=1,
        dtype="bfloat16",
        engine_args=["--max-model-len", "4096"],
    )
    key = fingerprint(**base).key  # type: ignore[arg-type]
    assert key == fingerprint(**{**base, "engine_args": ["--max-model-len=4096", "--port=1"]}).key  # type: ignore[arg-type]
    variants = [
        {"engine_version": "0.8.1"},
        {"model_digest": "b" * 64},
        {"accelerator": Accelerator("NVIDIA-A100", "12.4", "550.54", 1)},
        {"accelerator": Accelerator("NVIDIA-H100-80GB-HBM3", "12.1", "550.54", 1)},
        {"accelerator": Accelerator("NVIDIA-H100-80GB-HBM3", "12.4", "535.1", 1)},
        {"accelerator": Accelerator("NVIDIA-H100-80GB-HBM3", "12.4", "550.54", 1, capability="sm_90")},
        {"torch_version": "2.12.0"},
        {"tensor_parallel_size": 2},
        {"dtype": "float16"},
        {"engine_args": ["--max-model-len", "8192"]},
    ]
    keys = {fingerprint(**{**base, **v}).key for v in variants}  # type: ignore[arg-type]
    assert len(keys) == len(variants) and key not in keys


def test_detect_accelerator_on_this_machine_and_with_cuda(tmp_path: Path) -> None:
    import torch

    found = detect_accelerator()
    if not torch.cuda.is_available():
        assert found == Accelerator(gpu_product="cpu", cuda_version=None, driver_version=None, device_count=0)
    # The CUDA path, with torch's cuda API stood in by an object (no GPU on CI machines).
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 2, get_device_name=lambda i: "NVIDIA H100")
    fake_torch = SimpleNamespace(cuda=cuda, version=SimpleNamespace(cuda="12.4"))
    assert detect_accelerator(fake_torch, driver) == Accelerator("NVIDIA-H100", "12.4", "550.54.15", 2)  # type: ignore[arg-type]
    assert read_driver_version(tmp_path / "missing") is None


def test_build_manifest_refuses_pickle_and_symlinks(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "m" / ".gitattributes").write_text("skip me")
    manifest = build_manifest(tmp_path / "m", model_id="m", revision=None, allow_pickle=False)
    assert [(f.path, f.size_bytes) for f in manifest.files] == [("a.safetensors", 10)]
    assert manifest.files[0].sha256 == hashlib.sha256(b"x" * 10).hexdigest()
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(DisallowedFileError, match=r"pytorch_model\.bin"):
        build_manifest(tmp_path / "m", model_id="m", revision=None, allow_pickle=False)
    excluded = build_manifest(tmp_path / "m", model_id="m", revision=None, allow_pickle=False, exclude=["*.bin"])
    assert len(excluded.files) == 1
    (tmp_path / "m" / "pytorch_model.bin").unlink()
    (tmp_path / "m" / "link.json").symlink_to("/etc/hostname")
    with pytest.raises(UnsafePathError, match="symlink"):
        build_manifest(tmp_path / "m", model_id="m", revision=None, allow_pickle=False)


def test_cache_location_from_the_deployment_spec() -> None:
    from kvfleet.spec import CacheSpec
    from kvfleet.weight_cache.s3 import cache_uri_for, settings_for_cache_spec

    cache = CacheSpec.model_validate({"bucket": "weights", "s3Endpoint": "http://minio.cache:9000", "region": "eu-1"})
    assert cache_uri_for("hf://meta-llama/Llama-3.1-8B", "abc123", cache) == (
        "s3://weights/models/hf/meta-llama/Llama-3.1-8B/abc123"
    )
    assert cache_uri_for("hf://org/name@v2", None, cache) == "s3://weights/models/hf/org/name/v2"
    assert cache_uri_for("s3://other/m", None, cache) == "s3://other/m"
    no_prefix = CacheSpec.model_validate({"bucket": "weights", "prefix": ""})
    assert cache_uri_for("hf://org/name", None, no_prefix) == "s3://weights/hf/org/name/main"
    with pytest.raises(ValueError, match=r"cache\.bucket"):
        cache_uri_for("hf://org/name", None, CacheSpec())
    settings = settings_for_cache_spec(cache, Path("/var/run/secrets/s3"))
    assert (settings.endpoint_url, settings.region) == ("http://minio.cache:9000", "eu-1")
    assert settings_for_cache_spec(CacheSpec()).endpoint_url is None  # boto3's standard configuration decides


def test_space_shortfall_is_what_the_disk_lacks() -> None:
    assert space_shortfall_bytes(need_bytes=100, free_bytes=250) == 0
    assert space_shortfall_bytes(need_bytes=250, free_bytes=250) == 0  # exactly fits
    assert space_shortfall_bytes(need_bytes=300, free_bytes=250) == 50
    assert space_shortfall_bytes(need_bytes=-10, free_bytes=0) == 0  # partial files already hold more than is left


def test_files_are_fetched_in_the_order_an_engine_reads_them() -> None:
    """The small files first (an engine reads config and tokenizer before any weight), then the
    weights in name order (the order loaders read shards in)."""
    from kvfleet.weight_cache.parts import fetch_rank

    paths = [
        "model-00002-of-00002.safetensors",
        "tokenizer.json",
        "model-00001-of-00002.safetensors",
        "config.json",
        "model.safetensors.index.json",
    ]
    assert sorted(paths, key=fetch_rank) == [
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
