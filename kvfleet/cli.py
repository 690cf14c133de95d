"""The ``kvfleet`` command line. Each component owns its command group in its own module; they are
imported only when used, so ``kvfleet validate`` does not pay for importing torch."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import click

from kvfleet.cli_options import manifest_files, output_format

# name -> ("module:attribute", one-line help). A component adds its group here.
LAZY_GROUPS: dict[str, tuple[str, str]] = {
    "crd": ("kvfleet.crd_cli:crd", "Generate or check the InferenceDeployment CRD."),
    "autoscaler": ("kvfleet.autoscaler.cli:autoscaler", "Scale deployments on traffic and utilization, to zero."),
    "operator": ("kvfleet.operator.cli:operator", "Run the Kubernetes operator; print its RBAC."),
    "cache": ("kvfleet.weight_cache.cli.cache:cache", "Populate and pull models through the S3 weight cache."),
    "artifacts": ("kvfleet.weight_cache.cli.artifacts:artifacts", "Push and pull fingerprinted engine artifacts."),
    "router": ("kvfleet.router.cli:router", "Run the OpenAI-compatible, prefix-aware router."),
    # The engine's own commands plus the images' `launch`, joined where the launcher lives (it may
    # import the engine; the engine imports no other component).
    "engine": (
        "kvfleet.engine_image.launch_cli:engine",
        "Serve a model with the reference engine, or build a tiny test model.",
    ),
    "local": ("kvfleet.local.cli:local", "Run deployments on this machine: engines, router, autoscaler."),
    "dev": ("kvfleet.devcluster.cli:dev", "A local Kubernetes control plane with fake GPU nodes (no Docker)."),
}


class LazyGroup(click.Group):
    """A click group whose subcommand groups are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_GROUPS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_GROUPS:
            module_name, attr = LAZY_GROUPS[cmd_name][0].split(":")
            command = getattr(importlib.import_module(module_name), attr)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, LAZY_GROUPS[name][1]) for name in sorted(LAZY_GROUPS)]
        for name in super().list_commands(ctx):
            command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=80)))
        with formatter.section("Commands"):
            formatter.write_dl(sorted(rows))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvfleet")
def cli() -> None:
    """kvfleet: run LLMs on GPU Kubernetes clusters (or locally, for a laptop and the tests)."""


@cli.command()
@manifest_files("Manifest file (several documents allowed); repeat for more files.")
def validate(files: tuple[Path, ...]) -> None:
    """Check InferenceDeployment manifests; print each problem with its field path.

    Exits 0 when every InferenceDeployment is valid and 2 otherwise.
    """
    from kvfleet.manifests import load_deployments

    failed = False
    for path in files:
        result = load_deployments(path)
        for where, problems in result.problems:
            failed = True
            for problem in problems:
                click.echo(f"{path}{where}: {problem}", err=True)
        for deployment in result.deployments:
            click.echo(f"{path}: {deployment.namespace}/{deployment.name} is valid")
    if failed:
        sys.exit(2)


@cli.command()
@manifest_files("Manifest file (several documents allowed); repeat for more files.")
@output_format(default="yaml")
def plan(files: tuple[Path, ...], output: str) -> None:
    """Print the child objects the operator would create (a dry run, no cluster needed)."""
    import json

    import yaml

    from kvfleet.manifests import load_deployments
    from kvfleet.operator.planning import plan_children

    objects: list[dict[str, Any]] = []
    failed = False
    for path in files:
        result = load_deployments(path)
        for where, problems in result.problems:
            failed = True
            for problem in problems:
                click.echo(f"{path}{where}: {problem}", err=True)
        for deployment in result.deployments:
            objects.extend(plan_children(deployment))
    if output == "json":
        click.echo(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        click.echo(yaml.safe_dump_all(objects, sort_keys=False), nl=False)
    if failed:
        sys.exit(2)


def main() -> None:
    cli(prog_name="kvfleet")


if __name__ == "__main__":
    main()
