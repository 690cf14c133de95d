"""Click options shared by several ``kvfleet`` commands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

F = TypeVar("F", bound=Callable[..., object])


def manifest_files(help_text: str) -> Callable[[F], F]:
    """``-f/--filename FILE`` (repeatable, required): InferenceDeployment manifests, passed as ``files``."""
    return click.option(
        "-f",
        "--filename",
        "files",
        multiple=True,
        required=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help=help_text,
    )
