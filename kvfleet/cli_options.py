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


# kubectl's convention: -o/--output names a format (never a file); a file to write is --file.
DATA_FORMATS = ("json", "yaml")


def output_format(*, default: str | None = None, human: str | None = None) -> Callable[[F], F]:
    """``-o/--output json|yaml`` (plus ``human``, e.g. ``table``, where the command has a human view),
    passed as ``output``. ``default`` None: the command does something else unless -o is given."""
    choices = [human, *DATA_FORMATS] if human else list(DATA_FORMATS)
    return click.option(
        "-o",
        "--output",
        "output",
        type=click.Choice(choices),
        default=default,
        show_default=default is not None,
        help="Print in this format.",
    )


def format_data(data: object, output: str) -> str:
    """``data`` (JSON-able) as ``output`` (json or yaml), ending in a newline."""
    if output == "json":
        import json

        return json.dumps(data, indent=2) + "\n"
    if output == "yaml":
        import yaml

        return str(yaml.safe_dump(data, sort_keys=False))
    raise ValueError(f"unknown output format {output!r}")


def checkout_file(relative: str, package_dir: Path | None = None) -> Path:
    """``<checkout>/<relative>``: a generated file kept in the source checkout this kvfleet runs from
    (the CRD, the operator's install manifest). ``package_dir`` is the ``kvfleet`` package's folder
    (default: the imported one; an editable install's is inside the checkout).

    Raises ``click.UsageError`` asking for ``--file`` when there is no checkout around the package (an
    installed wheel), rather than writing beside site-packages."""
    if package_dir is None:
        import kvfleet

        package_dir = Path(kvfleet.__file__).parent
    root = package_dir.resolve().parent
    folder = (root / relative).parent
    if not (root / "pyproject.toml").is_file() or not folder.is_dir():
        raise click.UsageError(
            f"{root} is not a kvfleet source checkout (no pyproject.toml and {folder.relative_to(root)}/ beside the "
            "kvfleet package): pass --file PATH"
        )
    return root / relative
