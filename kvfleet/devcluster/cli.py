"""``kvfleet dev cluster up|down|status``: a real control plane on this machine, without Docker or kind."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from kvfleet.cli_options import format_data, output_format

from .controlplane import ControlPlane
from .processes import ClusterState, pid_alive, stop_root
from .settings import ClusterSettings, ControlPlaneError


def default_root() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kvfleet" / "dev-cluster"


root_option = click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False, path_type=Path),
    default=default_root,
    show_default="$XDG_STATE_HOME/kvfleet/dev-cluster",
    help="Folder for the cluster's certificates, etcd data, logs and kubeconfig.",
)


@click.group()
def dev() -> None:
    """Tools for trying kvfleet on this machine."""


@dev.group()
def cluster() -> None:
    """A local Kubernetes control plane (etcd, API server, controllers, scheduler, kwok GPU nodes)."""


@cluster.command()
@root_option
@click.option("--gpu-nodes", type=click.IntRange(1, 100), default=3, show_default=True, help="kwok GPU nodes.")
@click.option("--gpus-per-node", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--gpu-product", default="NVIDIA-H100-80GB-HBM3", show_default=True, help="nvidia.com/gpu.product label.")
def up(root: Path, gpu_nodes: int, gpus_per_node: int, gpu_product: str) -> None:
    """Build (or reuse) the binaries, start the control plane, and print how to use it."""
    from .binaries import ensure_binaries

    try:
        bin_dir = ensure_binaries()
        root.mkdir(parents=True, exist_ok=True)
        settings = ClusterSettings(
            root=root.resolve(),
            bin_dir=bin_dir,
            gpu_nodes=gpu_nodes,
            gpus_per_node=gpus_per_node,
            gpu_product=gpu_product,
        )
        state = ControlPlane(settings).start()
    except ControlPlaneError as e:
        raise click.ClickException(str(e)) from e
    version = (
        (bin_dir.parent / "build-info.txt").read_text().split("\n")[0]
        if (bin_dir.parent / "build-info.txt").exists()
        else ""
    )
    kubectl = shutil.which("kubectl") or "kubectl"
    click.echo(f"kvfleet dev cluster is up at {state.server} ({version.replace('version=', 'Kubernetes ')})")
    click.echo(f"  {gpu_nodes} kwok nodes, {gpus_per_node} x {gpu_product} each; logs in {root / 'logs'}")
    click.echo("Try:")
    click.echo(f"  export KUBECONFIG={state.kubeconfig}")
    click.echo("  kubectl get nodes -L nvidia.com/gpu.product      # kubectl >= 1.35 (.venv/bin/kubectl is 1.36)")
    click.echo("  kubectl apply --server-side -f crds/")
    click.echo("  kvfleet operator run &                            # the operator, against this cluster")
    click.echo("  kubectl apply -f examples/llama-3.1-8b-h100.yaml && kubectl get infd -A -w")
    click.echo(f"  {bin_dir / 'helm'} install kvfleet charts/kvfleet -n kvfleet-system --create-namespace")
    click.echo("Stop and remove it: kvfleet dev cluster down")
    if "kubectl" not in kubectl:
        click.echo("(no kubectl on PATH)", err=True)


@cluster.command()
@root_option
@click.option("--keep", is_flag=True, help="Stop the processes but keep the folder (logs, etcd data).")
def down(root: Path, keep: bool) -> None:
    """Stop every process of the cluster and remove its folder."""
    stopped = stop_root(root)
    click.echo(f"stopped {', '.join(stopped)}" if stopped else "no running cluster found")
    if not keep and root.exists():
        shutil.rmtree(root)
        click.echo(f"removed {root}")


@cluster.command()
@root_option
@output_format(default="text", human="text")
def status(root: Path, output: str) -> None:
    """Say whether a cluster runs, and where its kubeconfig is (exit 1 when none)."""
    state = ClusterState.load(root)
    if state is None:
        click.echo(f"no cluster at {root}")
        sys.exit(1)
    if output != "text":
        running = {name: pid_alive(pid) for name, pid in state.pids.items()}
        processes = [{"name": n, "pid": p, "running": running[n]} for n, p in state.pids.items()]
        data = {"server": state.server, "kubeconfig": state.kubeconfig, "ports": state.ports, "processes": processes}
        click.echo(format_data(data, output), nl=False)
        return
    for name, pid in state.pids.items():
        click.echo(f"{name:<24} pid {pid:<8} {'running' if pid_alive(pid) else 'STOPPED'}")
    click.echo(f"server {state.server}\nkubeconfig {state.kubeconfig}")
