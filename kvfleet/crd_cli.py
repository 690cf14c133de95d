"""``kvfleet crd``: write or check the generated CRD."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvfleet.crd import CRD_PATH, check_crd, write_crd


@click.group()
def crd() -> None:
    """Generate or check the InferenceDeployment CRD."""


@crd.command()
@click.option("--check", is_flag=True, help="Fail (exit 1) when the file differs from what the models generate.")
@click.option(
    "--file",
    "output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=CRD_PATH,
    show_default=True,
    help="The CRD file to write or check.",
)
def generate(check: bool, output: Path) -> None:
    """Write crds/inferencedeployments.kvfleet.io.yaml from the API types."""
    if check:
        if not check_crd(output):
            click.echo(f"{output} is stale: run `kvfleet crd generate`", err=True)
            sys.exit(1)
        click.echo(f"{output} is up to date")
        return
    write_crd(output)
    click.echo(f"wrote {output}")
