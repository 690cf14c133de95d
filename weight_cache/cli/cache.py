"""``kvfleet cache``: populate a model (a directory or an hf:// repository) into the S3 weight
cache, and pull it into a directory or the node cache, with a progress bar on stderr."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import click

from kvfleet.weight_cache.cli.common import RichProgress, friendly_errors, s3_options, s3_settings
from kvfleet.weight_cache.settings import GiB, MiB, NodeCacheSettings, PopulateSettings, PullSettings


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
@s3_options
@friendly_errors
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
    client = make_client(s3_settings(endpoint_url, region, credentials_dir), max_pool_connections=concurrency)
    bar = RichProgress("upload")
    progress: TransferProgress = NullProgress() if quiet else bar
    with bar if not quiet else nullcontext():
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
@s3_options
@friendly_errors
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
    client = make_client(s3_settings(endpoint_url, region, credentials_dir), max_pool_connections=concurrency)
    bar = RichProgress("pull")
    progress: TransferProgress = NullProgress() if quiet else bar
    with bar if not quiet else nullcontext():
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
