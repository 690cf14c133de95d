"""``kvfleet cache`` and ``kvfleet artifacts`` end to end against a real S3 server (SeaweedFS)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfleet.cli import cli
from tests.weight_cache.conftest import SMALL_MODEL, tree_bytes


@pytest.fixture
def runner(s3_endpoint: str, credentials_dir: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    # boto3's standard configuration: the endpoint from AWS_ENDPOINT_URL, keys from the environment.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", (credentials_dir / "AWS_ACCESS_KEY_ID").read_text().strip())
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", (credentials_dir / "AWS_SECRET_ACCESS_KEY").read_text().strip())
    return CliRunner()


def test_cache_populate_then_pull(
    runner: CliRunner, bucket: str, small_model: Path, tmp_path: Path, credentials_dir: Path
) -> None:
    secret = (credentials_dir / "AWS_SECRET_ACCESS_KEY").read_text().strip()
    uri = f"s3://{bucket}/models/small"
    out = runner.invoke(cli, ["cache", "populate", str(small_model), uri, "--part-size-mib", "5", "--quiet"])
    assert out.exit_code == 0, out.output
    assert f"{len(SMALL_MODEL)} files uploaded" in out.output and "MB/s" in out.output
    digest = out.output.split("sha256:")[1].split()[0]

    dest = tmp_path / "dest"
    out = runner.invoke(cli, ["cache", "pull", uri, str(dest), "--part-size-mib", "1", "--expected-digest", digest])
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith("pulled ") and "/s" in out.output and digest in out.output
    assert tree_bytes(dest) == tree_bytes(small_model)
    assert secret not in out.output

    root = tmp_path / "node"
    for expected in ("pulled", "node cache hit"):
        out = runner.invoke(cli, ["cache", "pull", uri, "--node-cache", str(root), "--quiet"])
        assert out.exit_code == 0, out.output
        assert out.stdout.startswith(expected) and str(root / "models" / digest) in out.output


def test_cache_errors_are_one_clear_line(runner: CliRunner, bucket: str, tmp_path: Path) -> None:
    out = runner.invoke(cli, ["cache", "pull", f"s3://{bucket}/none", str(tmp_path / "d"), "--concurrency", "0"])
    assert out.exit_code == 2 and "concurrency" in out.output
    out = runner.invoke(cli, ["cache", "pull", f"s3://{bucket}/none", str(tmp_path / "d"), "--quiet"])
    assert out.exit_code == 1 and "error:" in out.output and "populate" in out.output
    out = runner.invoke(cli, ["cache", "pull", f"s3://{bucket}/none"])
    assert out.exit_code == 2 and "DEST or --node-cache" in out.output
    out = runner.invoke(cli, ["cache", "populate", str(tmp_path), "s3://UPPER/x"])
    assert out.exit_code == 1 and "not a valid S3 bucket name" in out.output


def test_artifacts_keygen_push_pull_and_miss(runner: CliRunner, bucket: str, tmp_path: Path) -> None:
    src = tmp_path / "compile-cache"
    (src / "rank_0").mkdir(parents=True)
    (src / "rank_0" / "graph.bin").write_bytes(b"\1" * 1000)
    key = tmp_path / "signing.pem"
    out = runner.invoke(cli, ["artifacts", "keygen", str(key)])
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith("-----BEGIN PUBLIC KEY-----") and "PRIVATE" not in out.stdout
    assert key.stat().st_mode & 0o777 == 0o600
    (tmp_path / "trusted.pem").write_text(out.stdout)
    trusted = ["--trusted-keys", str(tmp_path / "trusted.pem")]
    assert runner.invoke(cli, ["artifacts", "keygen", str(key)]).exit_code == 1  # never overwritten

    fp = ["--engine-name", "vllm", "--engine-version", "0.8.0", "--model-digest", "d" * 64, "--gpu-product", "H100"]
    where = f"s3://{bucket}/artifacts"
    out = runner.invoke(cli, ["artifacts", "push", str(src), where, *fp, "--engine-arg=--max-model-len=4096"])
    assert out.exit_code == 2 and "--signing-key" in out.output  # no unsigned push
    push = ["artifacts", "push", str(src), where, *fp, "--engine-arg=--max-model-len=4096", "--signing-key", str(key)]
    out = runner.invoke(cli, push)
    assert out.exit_code == 0, out.output
    assert "stored" in out.output and "signed by ed25519:" in out.output

    out = runner.invoke(
        cli, ["artifacts", "pull", where, str(tmp_path / "hit"), *fp, *trusted, "--engine-arg=--max-model-len=4096"]
    )
    assert out.exit_code == 0 and out.stdout.startswith("hit:"), out.output
    assert tree_bytes(tmp_path / "hit") == tree_bytes(src)

    out = runner.invoke(cli, ["artifacts", "pull", where, str(tmp_path / "miss"), *fp, *trusted, "--tp", "2"])
    assert out.exit_code == 0 and out.stdout.startswith("miss:") and "no artifact" in out.output
    out = runner.invoke(cli, ["artifacts", "pull", where, str(tmp_path / "miss"), *fp, *trusted, "--fail-on-miss"])
    assert out.exit_code == 3

    out = runner.invoke(cli, ["artifacts", "fingerprint", *fp, "--model-digest", "nothex"])
    assert out.exit_code == 2 and "model_digest" in out.output
