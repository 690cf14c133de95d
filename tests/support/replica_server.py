"""A small HTTP server process with the engine's process contract, for the actuator's tests.

It answers /health (200 when ready, 503 while draining), /metrics (vllm:num_requests_running),
GET /scrapes (how many times /metrics was read), and POST /slow?seconds=S (holds the request S
seconds). SIGTERM: stop admitting, finish what is in flight, exit 0 -- the engine contract in
docs/contracts.md. The whole-system tests use the real reference engine; this keeps the
actuator's tests fast and independent of it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from aiohttp import web


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-after-s", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=None, help="exit at once with this code")
    args = parser.parse_args()
    if args.exit_code is not None:
        return int(args.exit_code)
    state = {"ready": False, "draining": False, "inflight": 0, "scrapes": 0}
    done = asyncio.Event()

    async def health(_: web.Request) -> web.Response:
        ok = state["ready"] and not state["draining"]
        return web.Response(status=200 if ok else 503, text="ok" if ok else "unavailable")

    async def metrics(_: web.Request) -> web.Response:
        state["scrapes"] += 1
        text = (
            f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name="t"}} {state["inflight"]}\n'
        )
        return web.Response(text=text)

    async def scrapes(_: web.Request) -> web.Response:
        return web.Response(text=str(state["scrapes"]))

    async def slow(request: web.Request) -> web.Response:
        if state["draining"]:
            return web.Response(status=503, headers={"Retry-After": "1"})
        state["inflight"] += 1
        try:
            await asyncio.sleep(float(request.query.get("seconds", "1")))
        finally:
            state["inflight"] -= 1
        return web.Response(text="done")

    app = web.Application()
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/metrics", metrics),
            web.get("/scrapes", scrapes),
            web.post("/slow", slow),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()

    loop = asyncio.get_running_loop()

    def on_term() -> None:
        if state["draining"]:
            sys.exit(1)
        state["draining"] = True
        done.set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    await asyncio.sleep(args.ready_after_s)
    state["ready"] = True
    await done.wait()
    while state["inflight"]:  # noqa: ASYNC110 (a poll is the simplest drain here)
        await asyncio.sleep(0.05)
    await runner.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
