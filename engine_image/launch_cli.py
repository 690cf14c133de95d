"""``kvfleet engine launch``: the entrypoint of the engine images, and the ``kvfleet engine`` group
that joins it to the engine's own commands (the launcher imports the engine, never the reverse).

Kept light at import time (click only): every ``kvfleet engine ...`` call imports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvfleet import contracts
from kvfleet.engine.cli import engine as engine_commands


@click.command("launch")
@click.option(
    "--spec",
    "spec_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=f"{contracts.SPEC_MOUNT_DIR}/{contracts.SPEC_FILE}",
    show_default=True,
    help="spec.json written by the operator (docs/contracts.md).",
)
@click.option(
    "--node-cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"Node cache volume [default: $KVFLEET_NODE_CACHE or {contracts.NODE_CACHE_MOUNT}].",
)
@click.option("--engine-port", type=click.IntRange(1, 65535), default=contracts.ENGINE_HTTP_PORT, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=contracts.LAUNCHER_PORT, show_default=True)
@click.option("--metrics-host", default="0.0.0.0", show_default=True, help="Address of the launcher's endpoint.")
@click.option(
    "--ready-timeout-s",
    type=click.FloatRange(1, 7200),
    default=1800.0,
    show_default=True,
    help="Longest wait for the engine's /health to answer 200.",
)
@click.option(
    "--overlap-pull/--no-overlap-pull",
    default=True,
    show_default=True,
    help="Start the reference engine while the weights are pulled; it loads each verified shard as it lands.",
)
@click.option(
    "--vllm-load-format",
    type=click.Choice(["safetensors", "runai_streamer"]),
    default=None,
    help="vLLM's --load-format on the node cache's verified files [default: vLLM's own choice].",
)
def launch(
    spec_path: Path,
    node_cache_dir: Path | None,
    engine_port: int,
    metrics_port: int,
    metrics_host: str,
    ready_timeout_s: float,
    overlap_pull: bool,
    vllm_load_format: str | None,
) -> None:
    """Pull weights and artifacts, start the engine, measure the cold start, supervise the engine.

    Exits with the engine's exit code once it stops; with 2 for an invalid spec and 3 when a phase
    fails, after one line naming the phase and the reason.
    """
    from .cli_main import main

    sys.exit(
        main(
            spec_path=spec_path,
            node_cache_dir=node_cache_dir,
            engine_port=engine_port,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            ready_timeout_s=ready_timeout_s,
            overlap_pull=overlap_pull,
            vllm_load_format=vllm_load_format,
        )
    )


engine = click.Group(
    "engine",
    commands=[*engine_commands.commands.values(), launch],
    help="The reference engine (CPU/CUDA): serve a model with the vLLM-compatible API; launch an engine pod.",
)


if __name__ == "__main__":
    launch()
