"""The arguments the chart renders are accepted by the real `kvfleet` commands they start.

Each component's command group is checked once it is merged (skipped, naming it, before).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest

from kvfleet.cli import LAZY_GROUPS, cli

from .conftest import CI_VALUES

Render = Callable[[Path], list[dict[str, Any]]]


@pytest.mark.parametrize("component", ["operator", "router", "autoscaler"])
@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_rendered_args_parse(component: str, values_file: Path, render_ci: Render) -> None:
    if component not in LAZY_GROUPS:
        pytest.skip(f"`kvfleet {component}` is not merged into this branch yet")
    (deployment,) = [
        d for d in render_ci(values_file) if d["kind"] == "Deployment" and d["metadata"]["name"].endswith(component)
    ]
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    group, name, *flags = args
    ctx = click.Context(cli)
    command = cli.get_command(ctx, group)
    assert isinstance(command, click.Group), group
    sub = command.get_command(ctx, name)
    assert sub is not None, f"kvfleet {group} has no {name} command"
    # Parse only (no invoke): unknown options and bad values raise click.UsageError here.
    sub.make_context(f"kvfleet {group} {name}", list(flags), parent=ctx)
    # A repeated option that is not `multiple` silently keeps only the last value.
    repeated = [f for f, n in Counter(a.split("=", 1)[0] for a in flags if a.startswith("--")).items() if n > 1]
    for flag in repeated:
        option = next(p for p in sub.params if isinstance(p, click.Option) and flag in p.opts)
        assert option.multiple, f"{flag} is repeated but kvfleet {group} {name} keeps only the last one"
