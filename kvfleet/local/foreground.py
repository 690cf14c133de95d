"""``kvfleet local up`` in the foreground: signals and the live view around a ``LocalRuntime``.

SIGINT/SIGTERM drains and stops everything, a second one kills the engines at once, and SIGHUP
replaces the engines one at a time (a rolling restart). On a terminal the view redraws every tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence

from kvfleet.local.runtime import LocalRuntime
from kvfleet.local.settings import LocalSettings
from kvfleet.local.status import render_status
from kvfleet.resource import InferenceDeployment


async def run_until_signalled(
    deployments: Sequence[InferenceDeployment], settings: LocalSettings, *, view: bool
) -> int:
    """Run until SIGINT/SIGTERM; a second one kills the engines instead of draining them."""
    from rich.console import Console
    from rich.live import Live

    console = Console(stderr=not view)
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            force.set()
        else:
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    runtime = LocalRuntime(deployments, settings)
    restarts: set[asyncio.Task[None]] = set()

    def on_hangup() -> None:
        # SIGHUP: a rolling restart of the engines (new binaries or weights on disk), as a Deployment rollout.
        task = asyncio.create_task(runtime.rolling_restart("SIGHUP"))
        restarts.add(task)
        task.add_done_callback(restart_done)

    def restart_done(task: asyncio.Task[None]) -> None:
        restarts.discard(task)
        if not task.cancelled() and task.exception() is not None:
            console.print(f"kvfleet local: rolling restart stopped: {task.exception()}")

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        await runtime.start()
        model = deployments[0].served_name
        console.print(f"[bold]kvfleet local[/bold]: serving {', '.join(d.served_name for d in deployments)}")
        console.print(f"  OpenAI API  {runtime.router.url}/v1   status  {runtime.status_url}/status")
        console.print(
            f"  try: curl {runtime.router.url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\'',
            soft_wrap=True,  # one line, so it can be copied and pasted as is
            markup=False,
        )
        console.print(
            f"  streamed, with the cold start's progress from zero: curl -N {runtime.router.url}/v1/completions "
            f"-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16, "stream": true}}\'',
            soft_wrap=True,
            markup=False,
        )
        console.print("  Ctrl-C drains and stops everything; a second Ctrl-C kills at once.")
        if view:
            with Live(render_status(runtime.status()), console=console, auto_refresh=False) as live:
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), settings.tick_s)
                    live.update(render_status(runtime.status()), refresh=True)
        else:
            await stop.wait()
        console.print("kvfleet local: stopping (draining engines; Ctrl-C again to kill them)")
    finally:
        try:
            await runtime.stop(force)
        finally:
            runtime.kill_all()
            loop.remove_signal_handler(signal.SIGHUP)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    return 0
