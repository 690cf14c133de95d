"""A small real HTTP server with the engine's surface, for the launcher's failure and signal paths.

The launcher's happy paths run against the real reference engine (test_launch_e2e.py); this
process exists to make an engine misbehave on purpose (exit while loading, never get ready) and
to check signal forwarding quickly. It speaks the contract: /health 503 while loading, 200 when
ready; /v1/completions; SIGTERM drains and exits 0.

    python standin_engine.py --port N [--load-s S] [--exit-early CODE] [--artifacts-dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

from aiohttp import web


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--load-s", type=float, default=0.2)
    parser.add_argument("--exit-early", type=int, default=None)
    parser.add_argument("--artifacts-dir", type=Path, default=None)
    args = parser.parse_args()
    started = time.monotonic()

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if time.monotonic() - started >= args.load_s else 503)

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(
            {"object": "text_completion", "model": body["model"], "choices": [{"index": 0, "text": "x"}]}
        )

    async def run() -> None:
        if args.exit_early is not None:
            sys.stderr.write("loading model\nRuntimeError: model config is broken\n")
            sys.stderr.flush()
            sys.exit(args.exit_early)
        if args.artifacts_dir is not None:
            args.artifacts_dir.mkdir(parents=True, exist_ok=True)
            (args.artifacts_dir / "built.txt").write_text("compiled\n")
            # Written last, as the reference engine does once its artifacts are complete.
            (args.artifacts_dir / "artifacts.json").write_text('{"empty": false}\n')
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()
        sys.stderr.write("draining\n")
        sys.stderr.flush()
        await runner.cleanup()

    asyncio.run(run())


if __name__ == "__main__":
    main()
