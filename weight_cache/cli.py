"""``kvfleet cache`` and ``kvfleet artifacts``: a thin command-line layer over the Python API.
Errors from the weight cache print as one line naming the file or field and exit 1; invalid
settings exit 2."""

from __future__ import annotations

import functools
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from kvfleet.cli_options import format_data, output_format
from kvfleet.weight_cache.errors import WeightCacheError
from kvfleet.weight_cache.settings import GiB, MiB, NodeCacheSettings, PopulateSettings, PullSettings, S3Settings

F = TypeVar("F", bound=Callable[..., Any])


class RichProgress:
    """A bytes/s progress bar on stderr (stdout keeps the result lines for scripts)."""

    def __init__(self, description: str) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
            redirect_stdout=False,
        )
        self._description = description
        self._task: TaskID | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        with self._lock:
            self._task = self._progress.add_task(self._description, total=total_bytes, completed=done_bytes)

    def on_bytes(self, count: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, count)

    def on_resumed(self, count: int) -> None:
        self.on_bytes(count)

    def on_file_done(self, path: str, size_bytes: int) -> None:
        pass


def _friendly_errors(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ValidationError as e:
            for err in e.errors():
                where = ".".join(str(p) for p in err["loc"]) or "settings"
                click.echo(f"error: {where}: {err['msg']}", err=True)
            sys.exit(2)
        except WeightCacheError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def _s3_options(func: F) -> F:
    func = click.option(
        "--credentials-dir",
        type=click.Path(file_okay=False, path_type=Path),
        help="Mounted Secret directory with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY files "
        "(default: boto3's standard chain).",
    )(func)
    func = click.option("--region", help="S3 region (default: boto3's standard configuration).")(func)
    func = click.option(
        "--endpoint-url", help="S3 endpoint; overrides AWS_ENDPOINT_URL and boto3's configuration files."
    )(func)
    return func


def _s3_settings(endpoint_url: str | None, region: str | None, credentials_dir: Path | None) -> S3Settings:
    return S3Settings(endpoint_url=endpoint_url, region=region, credentials_dir=credentials_dir)


@click.group()
def cache() -> None:
    """Populate and pull models through the same-datacenter S3 weight cache."""


@cache.command()
@click.argument("source")
@click.argument("dest")
@click.option("--model-id", help="Model id recorded in the manifest (default: repo id or directory name).")
@click.option("--revision", help="Revision recorded in the manifest (hf:// sources record the resolved commit).")
@click.option("--concurrency", type=int, default=PopulateSettings().concurrency, show_default=True)
@click.option(
    "--part-size-mib", type=int, default=PopulateSettings().part_size_bytes // MiB, show_default=True, help="MiB."
)
@click.option("--allow-pickle", is_flag=True, help="Upload pickle-based weights (.bin/.pt/.pth); unsafe to load.")
@click.option("--exclude", multiple=True, help="Glob of relative paths to leave out (repeatable).")
@click.option("--hf-endpoint", help="Hugging Face endpoint for hf:// sources (default: HF_ENDPOINT or the hub).")
@click.option("--hf-token-file", type=click.Path(dir_okay=False, path_type=Path), help="File holding a hub token.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_s3_options
@_friendly_errors
def populate(
    source: str,
    dest: str,
    model_id: str | None,
    revision: str | None,
    concurrency: int,
    part_size_mib: int,
    allow_pickle: bool,
    exclude: tuple[str, ...],
    hf_endpoint: str | None,
    hf_token_file: Path | None,
    quiet: bool,
    endpoint_url: str | None,
    region: str | None,
    credentials_dir: Path | None,
) -> None:
    """Upload SOURCE (a directory or hf://org/name@revision) and its manifest to DEST (s3://bucket/prefix)."""
    from kvfleet.weight_cache.populate import populate as run_populate
    from kvfleet.weight_cache.progress import NullProgress, TransferProgress
    from kvfleet.weight_cache.s3 import make_client

    settings = PopulateSettings(
        concurrency=concurrency, part_size_bytes=part_size_mib * MiB, allow_pickle=allow_pickle, exclude=exclude
    )
    client = make_client(_s3_settings(endpoint_url, region, credentials_dir), max_pool_connections=concurrency)
    bar = RichProgress("upload")
    progress: TransferProgress = NullProgress() if quiet else bar
    with bar if not quiet else _nothing():
        result = run_populate(
            client,
            source,
            dest,
            settings,
            progress=progress,
            model_id=model_id,
            revision=revision,
            hf_endpoint=hf_endpoint,
            hf_token_file=hf_token_file,
        )
    click.echo(result.throughput_line())
    click.echo(f"model digest sha256:{result.digest} ({result.uri})")


@cache.command()
@click.argument("source")
@click.argument("dest", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--node-cache",
    type=click.Path(file_okay=False, path_type=Path),
    help="Pull into this node cache (keyed by digest) instead of DEST; prints the model's path.",
)
@click.option("--size-limit-gib", type=float, help="Node cache size bound; idle models are evicted LRU first.")
@click.option("--expected-digest", help="Fail unless the manifest's sha256 is this (pins the model).")
@click.option("--concurrency", type=int, default=PullSettings().concurrency, show_default=True)
@click.option("--part-size-mib", type=int, default=PullSettings().part_size_bytes // MiB, show_default=True)
@click.option("--allow-pickle", is_flag=True, help="Accept pickle-based weights (.bin/.pt/.pth); unsafe to load.")
@click.option(
    "--verify-on-hit",
    type=click.Choice(["sha256", "stat"]),
    default="sha256",
    show_default=True,
    help="What a node-cache hit checks: every file's sha256, or only files changed since they were verified.",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_s3_options
@_friendly_errors
def pull(
    source: str,
    dest: Path | None,
    node_cache: Path | None,
    size_limit_gib: float | None,
    expected_digest: str | None,
    concurrency: int,
    part_size_mib: int,
    allow_pickle: bool,
    verify_on_hit: str,
    quiet: bool,
    endpoint_url: str | None,
    region: str | None,
    credentials_dir: Path | None,
) -> None:
    """Download the model at SOURCE (s3://bucket/prefix) into DEST, verifying every file's sha256.

    An interrupted pull resumes where it stopped. With --node-cache, the model goes into the node
    cache instead, shared by every process on the node and downloaded once.
    """
    from kvfleet.weight_cache.download import fetch_manifest, pull_to_dir
    from kvfleet.weight_cache.errors import ManifestError
    from kvfleet.weight_cache.progress import NullProgress, TransferProgress
    from kvfleet.weight_cache.pull import pull_model
    from kvfleet.weight_cache.s3 import S3Uri, make_client

    if (dest is None) == (node_cache is None):
        raise click.UsageError("give either DEST or --node-cache ROOT")
    settings = PullSettings(
        concurrency=concurrency,
        part_size_bytes=part_size_mib * MiB,
        allow_pickle=allow_pickle,
        verify_on_hit=verify_on_hit,
    )
    client = make_client(_s3_settings(endpoint_url, region, credentials_dir), max_pool_connections=concurrency)
    bar = RichProgress("pull")
    progress: TransferProgress = NullProgress() if quiet else bar
    with bar if not quiet else _nothing():
        if node_cache is not None:
            limit = None if size_limit_gib is None else int(size_limit_gib * GiB)
            with pull_model(
                source,
                node_cache,
                settings,
                node_cache_settings=NodeCacheSettings(size_limit_bytes=limit),
                client=client,
                progress=progress,
                expected_digest=expected_digest,
            ) as model:
                line = "node cache hit" if model.result is None else model.result.throughput_line()
                path, digest = model.path, model.digest
        else:
            assert dest is not None
            uri = S3Uri.parse(source)
            fetched = fetch_manifest(client, uri)
            if expected_digest is not None and fetched.digest != expected_digest:
                raise ManifestError(f"{uri}: manifest digest is {fetched.digest}, expected {expected_digest}")
            result = pull_to_dir(client, uri, dest, settings, progress=progress, fetched=fetched)
            line, path, digest = result.throughput_line(), dest, result.digest
    click.echo(line)
    click.echo(f"model sha256:{digest} at {path}")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


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
@_friendly_errors
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
@_friendly_errors
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
@_s3_options
@_friendly_errors
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
    client = make_client(_s3_settings(endpoint_url, region, credentials_dir))
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
@_s3_options
@_friendly_errors
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
    client = make_client(_s3_settings(endpoint_url, region, credentials_dir))
    result = pull_artifacts(client, source, fp, directory, trust=trust)
    if result.hit:
        click.echo(f"hit: artifact {result.key} restored into {directory} ({result.size_bytes} bytes)")
        return
    click.echo(f"miss: artifact {result.key}: {result.reason}")
    if result.warning:
        click.echo(f"warning: artifact {result.key} ignored: {result.reason}", err=True)
    if fail_on_miss:
        sys.exit(3)
