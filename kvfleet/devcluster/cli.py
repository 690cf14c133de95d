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
@click.option(
    "--real-node",
    is_flag=True,
    help="Also run one real node (kubelet, containerd, kube-proxy) where pods really run; kwok nodes get a taint.",
)
@click.option(
    "--router-service",
    default="kvfleet-system/kvfleet-router:80",
    show_default=True,
    help="With --real-node: the Service (NAMESPACE/NAME:PORT) the printed router address forwards to.",
)
def up(root: Path, gpu_nodes: int, gpus_per_node: int, gpu_product: str, real_node: bool, router_service: str) -> None:
    """Build (or reuse) the binaries, start the control plane, and print how to use it."""
    from .binaries import ensure_binaries
    from .realnode.settings import NodeError

    try:
        bin_dir = ensure_binaries()
        node_bin_dir = coredns = None
        if real_node:
            node_bin_dir, coredns = _node_binaries()
        root.mkdir(parents=True, exist_ok=True)
        settings = ClusterSettings(
            root=root.resolve(),
            bin_dir=bin_dir,
            gpu_nodes=gpu_nodes,
            gpus_per_node=gpus_per_node,
            gpu_product=gpu_product,
            node_bin_dir=node_bin_dir,
            coredns=coredns,
            router_service=router_service,
        )
        state = ControlPlane(settings).start()
    except (ControlPlaneError, NodeError) as e:
        raise click.ClickException(str(e)) from e
    version = (
        (bin_dir.parent / "build-info.txt").read_text().split("\n")[0]
        if (bin_dir.parent / "build-info.txt").exists()
        else ""
    )
    kubectl = shutil.which("kubectl") or "kubectl"
    click.echo(f"kvfleet dev cluster is up at {state.server} ({version.replace('version=', 'Kubernetes ')})")
    click.echo(f"  {gpu_nodes} kwok nodes, {gpus_per_node} x {gpu_product} each; logs in {root / 'logs'}")
    if state.node is not None:
        click.echo(
            "  1 real node (kvfleet-node: kubelet, containerd, kube-proxy); kwok nodes are tainted kvfleet.io/kwok"
        )
        click.echo(f"  router: {state.node['router']} -> Service {router_service} (once the chart is installed)")
    click.echo("Try:")
    click.echo(f"  export KUBECONFIG={state.kubeconfig}")
    click.echo("  kubectl get nodes -L nvidia.com/gpu.product      # kubectl >= 1.35 (.venv/bin/kubectl is 1.36)")
    click.echo("  kubectl apply --server-side -f crds/")
    click.echo("  kvfleet operator run &                            # the operator, against this cluster")
    click.echo("  kubectl apply -f examples/llama-3.1-8b-h100.yaml && kubectl get infd -A -w")
    click.echo(f"  {bin_dir / 'helm'} install kvfleet charts/kvfleet -n kvfleet-system --create-namespace")
    if state.node is not None:
        click.echo("  kvfleet dev cluster images                        # build the repo's images into the node")
    click.echo("Stop and remove it: kvfleet dev cluster down")
    if "kubectl" not in kubectl:
        click.echo("(no kubectl on PATH)", err=True)


def _node_binaries() -> tuple[Path, Path]:
    """The node's bin folder and its cluster DNS's binary (each built once, then cached)."""
    from .realnode.binaries import ensure_coredns, ensure_node_binaries, missing_system_tools
    from .realnode.settings import NodeError, NodeSettings

    gone = missing_system_tools(NodeSettings.cni_bin_dir)
    if gone:
        raise NodeError(f"the real node needs {', '.join(gone)} (scripts/bootstrap --with-node installs them)")
    return ensure_node_binaries(), ensure_coredns()


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


@cluster.command()
@root_option
@click.option("--engine/--no-engine", default=True, show_default=True, help="Also the CPU engine image (torch: GBs).")
@click.option(
    "--torch-index",
    default=None,
    help="The engine image's TORCH_INDEX build argument (its Dockerfile's PyTorch CPU index by default; "
    "https://pypi.org/simple where that is unreachable: the registry's torch, the CUDA build).",
)
@click.option("--mirror", default="http://deb.debian.org/debian", show_default=True, help="Debian mirror for the base.")
def images(root: Path, engine: bool, torch_index: str | None, mirror: str) -> None:
    """Build the repository's images from its Dockerfiles (no Docker, no registry) and load them
    into the real node of `up --real-node`."""
    import time

    from .realnode import images as node_images
    from .realnode.settings import NodeError

    state = ClusterState.load(root)
    if state is None or state.node is None:
        raise click.ClickException(f"no real node at {root}: start one with `kvfleet dev cluster up --real-node`")
    repo = node_images.BUILD_CONTEXT
    wanted = [node_images.RepoImage("kvfleet", "Dockerfile")]
    if engine:
        args = (("TORCH_INDEX", torch_index),) if torch_index else ()
        wanted.append(node_images.RepoImage("engine-cpu", "engine_image/Dockerfile.cpu", args))
    socket = Path(state.node["root"]) / "containerd" / "containerd.sock"
    try:
        base = node_images.base_image(mirror, click.echo)
        for image in wanted:
            t0 = time.monotonic()
            image_base = base
            if image.name == "engine-cpu":
                index = torch_index or node_images.dockerfile_arg(repo / image.dockerfile, "TORCH_INDEX")
                image_base = node_images.engine_base_image(repo, base, index, click.echo)
            name, tarball = node_images.repo_image(repo, image, image_base, click.echo)
            built_s = time.monotonic() - t0
            loaded = node_images.load_repo_image(socket, name, tarball)
            size_mb = tarball.stat().st_size / 1e6
            click.echo(
                f"{name}: {size_mb:.0f} MB, built or found in {built_s:.0f} s, "
                f"{'imported' if loaded else 'already in the node'}; ready in {time.monotonic() - t0:.0f} s"
            )
    except NodeError as e:
        raise click.ClickException(str(e)) from e
