"""A small OpenAI-shaped HTTP server, run as its own process, standing in for an engine replica.

Its behaviour is steered by a ``kvfleet_test`` object in the request body (which the router forwards
unchanged): ``chunks`` (number of SSE chunks / words), ``delay_s`` (between chunks), ``hold_s``
(before the response headers), ``break_after`` (drop the connection after that many chunks),
``status`` (answer with that status; ``error``, the error object then). ``GET /stats`` reports what
it saw; ``POST /admin/drain`` makes it answer 503 from then on, as an engine does after SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica-id", required=True)
    args = parser.parse_args()
    stats = {"requests": 0, "completed": 0, "cancelled": 0, "active": 0, "draining": False}

    async def completions(request: web.Request) -> web.StreamResponse:
        if stats["draining"]:
            return web.json_response({"error": "draining"}, status=503, headers={"Retry-After": "1"})
        body = await request.json()
        knobs = body.get("kvfleet_test", {})
        stats["requests"] += 1
        stats["active"] += 1
        try:
            if knobs.get("hold_s"):
                await asyncio.sleep(knobs["hold_s"])
            if knobs.get("status"):
                # ``error``: the error object to answer with (an engine's own shape), else a plain string.
                return web.json_response({"error": knobs.get("error", "asked to fail")}, status=knobs["status"])
            chunks = int(knobs.get("chunks", 3))
            words = [f"w{i}" for i in range(chunks)]
            if not body.get("stream"):
                payload = {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": body["model"],
                    "replica": args.replica_id,
                    "choices": [{"index": 0, "text": " ".join(words), "finish_reason": "length"}],
                }
                stats["completed"] += 1
                return web.json_response(payload)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Replica": args.replica_id})
            await response.prepare(request)
            for i, word in enumerate(words):
                if knobs.get("break_after") is not None and i == knobs["break_after"]:
                    # Half an event, then the connection drops: what a crashing engine looks like.
                    await response.write(b'data: {"partial": ')
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                event = {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "created": 0,
                    "model": body["model"],
                    "replica": args.replica_id,
                    "choices": [{"index": 0, "text": word, "finish_reason": None}],
                }
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if knobs.get("delay_s"):
                    await asyncio.sleep(knobs["delay_s"])
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            stats["completed"] += 1
            return response
        except asyncio.CancelledError:
            stats["cancelled"] += 1
            raise
        finally:
            stats["active"] -= 1

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "draining" if stats["draining"] else "ok"})

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    async def drain(request: web.Request) -> web.Response:
        stats["draining"] = True
        return web.json_response(stats)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", get_stats)
    app.router.add_post("/admin/drain", drain)
    web.run_app(app, host="127.0.0.1", port=args.port, handler_cancellation=True, print=None, access_log=None)


if __name__ == "__main__":
    main()
