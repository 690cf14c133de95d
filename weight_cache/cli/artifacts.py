"""``kvfleet artifacts``: print an engine-artifact fingerprint, make a signing key, and push or
pull a signed artifact keyed by its fingerprint."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from kvfleet.cli_options import format_data, output_format
from kvfleet.weight_cache.cli.common import F, friendly_errors, s3_options, s3_settings


def _fingerprint_options(func: F) -> F:
    options = [
        click.option("--engine-name", required=True, help="e.g. vllm"),
        click.option("--engine-version", required=True, help="e.g. 0.8.5"),
        click.option("--model-digest", required=True, help="The model's manifest sha256 (64 hex digits)."),
        click.option("--tensor-parallel-size", "--tp", "tp", type=int, default=1, show_default=True),
        click.option("--dtype", default="auto", show_default=True),
        click.option("--engine-arg", "engine_args", multiple=True, help="Engine command-line argument (repeatable)."),
        click.option("--gpu-product", help="Override the detected GPU product (default: CUDA device 0, or cpu)."),
        click.option("--cuda-version", help="Override the detected CUDA version."),
        click.option("--driver-version", help="Override the detected driver version."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _build_fingerprint(
    engine_name: str,
    engine_version: str,
    model_digest: str,
    tp: int,
    dtype: str,
    engine_args: tuple[str, ...],
    gpu_product: str | None,
    cuda_version: str | None,
    driver_version: str | None,
) -> Any:
    from kvfleet.weight_cache.fingerprint import Accelerator, detect_accelerator, fingerprint

    found = detect_accelerator() if gpu_product is None else Accelerator(gpu_product, None, None, 1)
    accelerator = Accelerator(
        gpu_product=gpu_product or found.gpu_product,
        cuda_version=cuda_version or found.cuda_version,
        driver_version=driver_version or found.driver_version,
        device_count=found.device_count,
    )
    return fingerprint(
        engine_name=engine_name,
        engine_version=engine_version,
        model_digest=model_digest.removeprefix("sha256:"),
        accelerator=accelerator,
        tensor_parallel_size=tp,
        dtype=dtype,
        engine_args=engine_args,
    )


@click.group()
def artifacts() -> None:
    """Push and pull prebuilt engine artifacts (compile caches, CUDA graphs) keyed by fingerprint."""


@artifacts.command(name="fingerprint")
@_fingerprint_options
@output_format(default="text", human="text")
@friendly_errors
def show_fingerprint(output: str, **kwargs: Any) -> None:
    """Print the fingerprint key and the fields it covers (-o json|yaml: one object with both)."""
    fp = _build_fingerprint(**kwargs)
    if output != "text":
        click.echo(format_data({"key": fp.key, "fields": fp.to_wire()}, output), nl=False)
        return
    click.echo(fp.key)
    click.echo(json.dumps(fp.to_wire(), indent=2, sort_keys=True))


@artifacts.command(name="keygen")
@click.argument("private_key", type=click.Path(dir_okay=False, path_type=Path))
@friendly_errors
def keygen(private_key: Path) -> None:
    """Write a new Ed25519 signing key to PRIVATE_KEY (0600, never overwritten) and print its
    public key: the chart's artifacts.publicKeys. Keep the private key in a Secret that only the
    trusted writer (a build Job, the platform team) mounts, never engine pods."""
    from kvfleet.weight_cache.signing import generate_key_pair, public_pem

    signer = generate_key_pair(private_key)
    click.echo(public_pem(signer.public_key()), nl=False)
    click.echo(f"# key id {signer.key_id}; private key in {private_key}", err=True)


@artifacts.command(name="push")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest")
@click.option(
    "--signing-key",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Ed25519 private key (PEM) that signs the artifact; engine pods load only artifacts signed "
    "by a key they trust.",
)
@click.option("--overwrite", is_flag=True, help="Replace an artifact already stored and signed by this key.")
@_fingerprint_options
@s3_options
@friendly_errors
def push(
    directory: Path,
    dest: str,
    signing_key: Path,
    overwrite: bool,
    endpoint_url: str | None,
    region: str | None,
    credentials_dir: Path | None,
    **kwargs: Any,
) -> None:
    """Tar DIRECTORY, store it under DEST (s3://bucket/prefix) keyed by the fingerprint, and sign it."""
    from kvfleet.weight_cache.artifacts import push_artifacts
    from kvfleet.weight_cache.s3 import make_client
    from kvfleet.weight_cache.signing import ArtifactSigner

    signer = ArtifactSigner.from_file(signing_key)
    fp = _build_fingerprint(**kwargs)
    client = make_client(s3_settings(endpoint_url, region, credentials_dir))
    result = push_artifacts(client, directory, dest, fp, signer=signer, overwrite=overwrite)
    state = "already stored" if result.skipped else f"stored {result.size_bytes} bytes"
    click.echo(f"artifact {result.key}: {state} (sha256 {result.sha256}, signed by {result.key_id})")


@artifacts.command(name="pull")
@click.argument("source")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--fail-on-miss", is_flag=True, help="Exit 3 on a miss (default: a miss is not an error).")
@click.option(
    "--trusted-keys",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="PEM file of the Ed25519 public keys whose signatures are accepted.",
)
@_fingerprint_options
@s3_options
@friendly_errors
def pull_cmd(
    source: str,
    directory: Path,
    fail_on_miss: bool,
    trusted_keys: Path,
    endpoint_url: str | None,
    region: str | None,
    credentials_dir: Path | None,
    **kwargs: Any,
) -> None:
    """Restore the artifact for this fingerprint from SOURCE into DIRECTORY (absent or empty), if a
    trusted key signed it and its bytes match."""
    from kvfleet.weight_cache.artifacts import pull_artifacts
    from kvfleet.weight_cache.s3 import make_client
    from kvfleet.weight_cache.signing import ArtifactTrust

    trust = ArtifactTrust.from_file(trusted_keys)
    fp = _build_fingerprint(**kwargs)
    client = make_client(s3_settings(endpoint_url, region, credentials_dir))
    result = pull_artifacts(client, source, fp, directory, trust=trust)
    if result.hit:
        click.echo(f"hit: artifact {result.key} restored into {directory} ({result.size_bytes} bytes)")
        return
    click.echo(f"miss: artifact {result.key}: {result.reason}")
    if result.warning:
        click.echo(f"warning: artifact {result.key} ignored: {result.reason}", err=True)
    if fail_on_miss:
        sys.exit(3)
