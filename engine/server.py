"""The vLLM-compatible HTTP server: OpenAI completions and chat completions (with SSE), models,
health and Prometheus metrics. Engine errors are translated to HTTP statuses here, once. The
process around it (listen, load, drain on SIGTERM) is ``lifecycle.py``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet.engine.async_engine import AsyncEngine, RequestStream
from kvfleet.engine.connection_guard import GuardedTCPSite, GuardSettings
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.errors import (
    DrainingError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    OverloadedError,
    RequestError,
    UnknownModelError,
)
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    now_s,
    parse_request,
    request_error_body,
    usage,
)
from kvfleet.engine.request import RequestOutput
from kvfleet.engine.settings import ServerSettings
from kvfleet.openai_shape import error_body, method_not_allowed_body, model_object, not_found_body

log = logging.getLogger(__name__)

# OpenAI's default for /v1/completions; chat defaults to the rest of the context (as vLLM does).
DEFAULT_COMPLETION_MAX_TOKENS = 16

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerState:
    settings: ServerSettings
    served_model_name: str
    metrics: EngineMetrics
    engine: AsyncEngine | None = None
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def ready_engine(self) -> AsyncEngine:
        """The engine if it accepts work, else the reason as a 503."""
        retry = self.settings.retry_after_s
        if self.draining:
            raise DrainingError("the server is shutting down and accepts no new requests", retry_after_s=retry)
        if self.engine is None:
            raise DrainingError("the model is still loading", retry_after_s=retry)
        if self.engine.dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.engine.dead}")
        return self.engine


STATE_KEY = web.AppKey("state", ServerState)


def _error_response(e: RequestError) -> web.Response:
    headers = {}
    if isinstance(e, OverloadedError | DrainingError):
        headers["Retry-After"] = str(e.retry_after_s)
    return web.json_response(request_error_body(e), status=e.status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return _error_response(e)
    except web.HTTPMethodNotAllowed as e:  # aiohttp's own answers are plain text: OpenAI-shaped instead
        allowed = ", ".join(sorted(e.allowed_methods))
        body = method_not_allowed_body(request.method, request.path, allowed)
        return web.json_response(body, status=405, headers={"Allow": allowed})
    except web.HTTPNotFound:
        return web.json_response(not_found_body(request.method, request.path), status=404)
    except EngineDeadError as e:
        return web.json_response(error_body(str(e), "internal_error"), status=500)
    except EngineError as e:
        log.exception("engine error on %s", request.path)
        return web.json_response(error_body(str(e), "internal_error"), status=500)


async def _read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"malformed JSON body: {e}") from e
    except RecursionError:  # the parser's own depth bound (about 1,000 levels)
        raise InvalidRequestError("malformed JSON body: nested too deeply to parse") from None


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _outputs(request: web.Request, stream: RequestStream, poll_s: float) -> AsyncIterator[RequestOutput]:
    """The request's outputs until it finishes; stops early (aborting it) when the client leaves."""
    try:
        while True:
            # Checked on every output, and every poll_s while none comes (e.g. queued).
            if _client_gone(request):
                log.info("client of %s went away; aborting it", stream.request_id)
                return
            try:
                output = await asyncio.wait_for(stream.next(), timeout=poll_s)
            except TimeoutError:
                continue
            yield output
            if output.finished:
                return
    finally:
        stream.abort()  # frees its KV blocks unless it already finished


class Handlers:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        # The model object's ``created``: when this server started serving it, the same on every call.
        self._created_unix_s = now_s()

    async def health(self, request: web.Request) -> web.Response:
        try:
            self.state.ready_engine()
        except (RequestError, EngineDeadError) as e:
            return web.Response(
                status=503, text=str(e), headers={"Retry-After": str(self.state.settings.retry_after_s)}
            )
        return web.Response(status=200)

    def _model_card(self) -> dict[str, Any]:
        engine = self.state.engine
        card = model_object(self.state.served_model_name, created_unix_s=self._created_unix_s)
        if engine is not None:
            card["max_model_len"] = engine.core.max_model_len
        return card

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (the id may hold slashes, as served names often do)."""
        self._check_model(request.match_info["model_id"])
        return web.json_response(self._model_card())

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.state.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.served_model_name:
            raise UnknownModelError(
                f"the model {model!r} does not exist; this server serves {self.state.served_model_name!r}",
                param="model",
            )

    @staticmethod
    def _prompt_ids(core: EngineCore, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return core.tokenizer.encode(prompt)
        vocab = core.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt"
            )
        return prompt

    async def completions(self, request: web.Request) -> web.StreamResponse:
        # Counted from the first byte: a drain never cuts off a request it already let in.
        self.state.enter()
        try:
            engine = self.state.ready_engine()
            body = parse_request(CompletionRequest, await _read_json(request))
            self._check_model(body.model)
            prompt_ids = self._prompt_ids(engine.core, body.prompt_input())
            max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
            engine.core.check_lengths(len(prompt_ids), max_tokens)
            stream = engine.submit(engine.new_request_id("cmpl"), prompt_ids, body.sampling_params(max_tokens))
            if body.stream:
                return await self._stream(
                    request, stream, chat=False, include_usage=body.include_usage, continuous=body.continuous_usage
                )
            return await self._collect(request, stream, chat=False)
        finally:
            self.state.leave()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.state.enter()
        try:
            engine = self.state.ready_engine()
            body = parse_request(ChatCompletionRequest, await _read_json(request))
            self._check_model(body.model)
            core = engine.core
            messages = body.rendered_messages()
            text = core.tokenizer.render_chat(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
            prompt_ids = core.tokenizer.encode(text, add_special_tokens=False)
            max_tokens = body.requested_max_tokens() or core.default_max_tokens(len(prompt_ids))
            core.check_lengths(len(prompt_ids), max_tokens)
            stream = engine.submit(engine.new_request_id("chatcmpl"), prompt_ids, body.sampling_params(max_tokens))
            if body.stream:
                return await self._stream(
                    request, stream, chat=True, include_usage=body.include_usage, continuous=body.continuous_usage
                )
            return await self._collect(request, stream, chat=True)
        finally:
            self.state.leave()

    def _envelope(self, stream: RequestStream, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        # One creation time per response: every chunk of a stream carries the same one, as OpenAI's do.
        return {
            "id": stream.request_id,
            "object": kind,
            "created": stream.created_s,
            "model": self.state.served_model_name,
        }

    async def _collect(self, request: web.Request, stream: RequestStream, chat: bool) -> web.StreamResponse:
        parts: list[str] = []
        last: RequestOutput | None = None
        async for output in _outputs(request, stream, self.state.settings.disconnect_poll_s):
            parts.append(output.text_delta)
            last = output
        if last is None or not last.finished:
            return web.Response(status=499)  # the client left; nobody reads this
        if last.finish_reason == "error":
            raise EngineDeadError("the engine failed while serving this request")
        text = "".join(parts)
        body = self._envelope(stream, chat, chunk=False)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": last.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        body["choices"] = [choice]
        body["usage"] = usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        return web.json_response(body)

    async def _stream(
        self, request: web.Request, stream: RequestStream, chat: bool, include_usage: bool, continuous: bool = False
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
        )

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())

        def choice(delta_text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": reason}
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta_text:
                delta["content"] = delta_text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

        await response.prepare(request)
        try:
            role_sent = not chat
            async for output in _outputs(request, stream, self.state.settings.disconnect_poll_s):
                if not role_sent and output.finish_reason != "error":
                    # With the first output (after prefill), as vLLM does: a client's (and the router's)
                    # time to the first body byte is then the time to the first token.
                    opening = {**self._envelope(stream, chat, True), "choices": [choice(None, None, first=True)]}
                    if continuous:
                        opening["usage"] = usage(output.prompt_tokens, 0, output.cached_tokens)
                    await send(opening)
                    role_sent = True
                if output.finish_reason == "error":
                    await send(error_body("the engine failed while serving this request", "internal_error"))
                    break
                if output.text_delta or output.finished:
                    reason = output.finish_reason if output.finished else None
                    chunk = {**self._envelope(stream, chat, True), "choices": [choice(output.text_delta, reason)]}
                    if continuous:  # the tokens so far, as vLLM's continuous_usage_stats gives them
                        chunk["usage"] = usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens)
                    await send(chunk)
                if output.finished and include_usage:
                    await send(
                        {
                            **self._envelope(stream, chat, True),
                            "choices": [],
                            "usage": usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens),
                        }
                    )
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:
            log.info("client of %s disconnected mid-stream; aborted", stream.request_id)
        finally:
            stream.abort()
        return response


def create_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=state.settings.max_request_bytes)
    app[STATE_KEY] = state
    h = Handlers(state)
    app.router.add_get("/health", h.health)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/v1/models/{model_id:.+}", h.model)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_post("/v1/chat/completions", h.chat)
    return app


async def start_site(app: web.Application, settings: ServerSettings) -> tuple[web.AppRunner, GuardedTCPSite]:
    """Listen with the front-end bounds: aiohttp's own line and field limits are set to the guard's,
    so the guard (which sees the bytes first) is the one that answers, with 431."""
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        max_line_size=settings.max_head_bytes,
        max_field_size=settings.max_head_bytes,
        max_headers=settings.max_headers,
    )
    await runner.setup()
    guard = GuardSettings(
        max_head_bytes=settings.max_head_bytes,
        max_headers=settings.max_headers,
        head_timeout_s=settings.head_timeout_s,
        max_connections=settings.max_connections,
        max_connections_per_client=settings.max_connections_per_client,
    )
    site = GuardedTCPSite(runner, settings.host, settings.port, guard)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site
