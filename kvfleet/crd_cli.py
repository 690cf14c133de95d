"""``kvfleet crd``: write or check the generated CRD.

The CRD is generated into a source checkout's ``crds/`` folder (the chart copies it from there). An
installed kvfleet has no such folder, so without ``--file`` the command looks for the checkout it
runs from and says so when there is none, instead of writing beside the installed package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvfleet.cli_options import checkout_file
from kvfleet.crd import CRD_FILE_NAME, check_crd, write_crd


@click.group()
def crd() -> None:
    """Generate or check the InferenceDeployment CRD."""


@crd.command()
@click.option("--check", is_flag=True, help="Fail (exit 1) when the file differs from what the models generate.")
@click.option(
    "--file",
    "output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"The CRD file to write or check [default: crds/{CRD_FILE_NAME} of the source checkout].",
)
def generate(check: bool, output: Path | None) -> None:
    """Write crds/inferencedeployments.kvfleet.io.yaml from the API types."""
    if output is None:
        output = checkout_file(f"crds/{CRD_FILE_NAME}")
    if check:
        if not check_crd(output):
            click.echo(f"{output} is stale: run `kvfleet crd generate`", err=True)
            sys.exit(1)
        click.echo(f"{output} is up to date")
        return
    write_crd(output)
    click.echo(f"wrote {output}")
