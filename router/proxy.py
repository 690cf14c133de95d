"""The OpenAI-compatible HTTP surface: parse and check the request, pick a replica, forward it, and relay
the answer chunk by chunk. Router errors are translated to HTTP answers here, once."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any
from urllib.parse import unquote

from prometheus_client import CONTENT_TYPE_LATEST

from kvfleet.openai_shape import error_body, method_not_allowed_body, model_object, not_found_body
from kvfleet.router.errors import (
    BadRequestError,
    ClientNamespaceError,
    GatewayTimeoutError,
    ModelNotFoundError,
    PayloadTooLargeError,
    RouterError,
    UpstreamAttemptError,
    UpstreamError,
)
from kvfleet.router.fleet import Fleet, Lease
from kvfleet.router.http_server import Handler, Headers, HttpRequest, Responder
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.migration import CHAT_PATH, Splicer, continuation, finish_event, progress
from kvfleet.router.prompt import block_hashes, render_prompt
from kvfleet.router.replicas import DeploymentView, key_labels
from kvfleet.router.settings import RouterSettings
from kvfleet.router.sse import EventSplitter, error_event
from kvfleet.router.upstream import (
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamIOError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeoutError,
)

log = logging.getLogger(__name__)

# Per-connection headers (RFC 9110 7.6.1) and the ones the router's server writes itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "server",
        "date",
    }
)
# Not forwarded upstream either: the router's server answers ``Expect: 100-continue`` itself, and the
# request it sends is complete.
_NOT_FORWARDED = _HOP_BY_HOP | {"expect"}
_HOP_BY_HOP_RAW = frozenset(name.encode() for name in _HOP_BY_HOP)
_NOT_FORWARDED_RAW = frozenset(name.encode() for name in _NOT_FORWARDED | {"x-forwarded-for"})
# First wait before retrying on a replica that already failed this request; doubles per attempt.
RETRY_BACKOFF_S = 0.25
# The HTTP code counted for a request whose client went away before the answer (nginx's convention).
CLIENT_CLOSED = 499


_JSON = ("Content-Type", "application/json")
_MODEL_PREFIX = "/v1/models/"
_NO_MODEL = ("", "")  # the labels of requests that name no deployment this client may reach
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1123 label


class _Answered:
    """An awaitable that is already done: for routes answered without waiting on anything."""

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


_DONE = _Answered()
_NONE_TRIED: frozenset[str] = frozenset()


def send_json(responder: Responder, status: int, obj: object, extra: Headers = ()) -> None:
    responder.send(status, [_JSON, *extra], json.dumps(obj).encode())


def send_error(responder: Responder, error: RouterError) -> None:
    extra = [("Retry-After", str(error.retry_after_s))] if error.retry_after_s is not None else []
    body = error_body(error.reason, error.kind, param=error.param, code=error.code)
    send_json(responder, error.status, body, extra)


def parse_body(raw: bytes) -> tuple[dict[str, Any], str]:
    """The request object and its ``model``; ``BadRequestError`` naming what is wrong otherwise."""
    try:
        body = json.loads(raw.decode())  # JSON between systems is UTF-8 (RFC 8259); decoding first skips detection
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequestError(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # the parser's own depth bound (about 1,000 levels): a client's error, not ours
        raise BadRequestError("request body is nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise BadRequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' is required and must be a non-empty string", param="model")
    return body, model


class Proxy:
    def __init__(
        self,
        settings: RouterSettings,
        fleet: Fleet,
        metrics: RouterMetrics,
        upstream: UpstreamPool,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._fleet = fleet
        self._metrics = metrics
        self._upstream = upstream
        self._clock = clock
        self._shared = frozenset(settings.shared_namespaces)
        self._routes: dict[str, tuple[str, Handler]] = {
            "/v1/completions": ("POST", self.inference),
            "/v1/chat/completions": ("POST", self.inference),
            "/v1/models": ("GET", self.models),
            "/health": ("GET", self.health),
            "/metrics": ("GET", self.metrics),
        }

    def handle(self, request: HttpRequest, responder: Responder) -> Awaitable[None]:
        """The server's one handler: dispatch on method and path.

        A plain function returning the route's coroutine, not a coroutine awaiting it: every coroutine
        layer between the server and the upstream wait is paid again on each suspend and resume.
        """
        route = self._routes.get(request.path)
        if route is None and request.path.startswith(_MODEL_PREFIX):
            route = ("GET", self.model)
        if route is None:
            send_json(responder, 404, not_found_body(request.method, request.path))
            return _DONE
        method, handler = route
        if request.method != method:
            extra = [("Allow", method)]
            send_json(responder, 405, method_not_allowed_body(request.method, request.path, method), extra)
            return _DONE
        return handler(request, responder)

    # -- small endpoints -----------------------------------------------------------------------

    async def models(self, request: HttpRequest, responder: Responder) -> None:
        try:
            scope = self._scope(request)
        except RouterError as e:
            send_error(responder, e)
            return
        views = [v for v in self._fleet.models() if scope is None or v.namespace in scope]
        data = [self._model_object(view) for view in sorted(views, key=lambda v: v.served_name)]
        send_json(responder, 200, {"object": "list", "data": data})

    async def model(self, request: HttpRequest, responder: Responder) -> None:
        """``GET /v1/models/{id}``: the id may hold slashes (``org/name``) and is percent-decoded."""
        try:
            view = self._resolve(unquote(request.path.removeprefix(_MODEL_PREFIX)), self._scope(request))
        except RouterError as e:
            send_error(responder, e)
            return
        send_json(responder, 200, self._model_object(view))

    def _model_object(self, view: DeploymentView) -> dict[str, Any]:
        created = self._fleet.created_unix_s(view.key)
        return model_object(view.served_name, created_unix_s=created, root=view.name)

    def _scope(self, request: HttpRequest) -> frozenset[str] | None:
        """The namespaces this client may reach (its own, from the gateway's header, and the shared
        ones), or None when client scoping is off. A request without the header is refused: it did
        not come through the gateway, and guessing a namespace for it would leak or capture traffic."""
        header = self._settings.client_namespace_header
        if header is None:
            return None
        wanted = header.lower().encode("latin-1")
        values = [v for n, v in request.raw_headers if n.lower() == wanted]
        if len(values) != 1:
            why = "is missing" if not values else "is sent more than once"
            raise ClientNamespaceError(f"header {header!r} {why}: requests must come through the gateway that sets it")
        namespace = values[0].decode("latin-1").strip()
        if not _NAMESPACE.match(namespace):
            raise ClientNamespaceError(f"header {header!r} does not hold a Kubernetes namespace name")
        return self._shared | {namespace}

    def _resolve(self, model: str, scope: frozenset[str] | None) -> DeploymentView:
        """The deployment a request's ``model`` names (``namespace/served-name`` exactly, or a bare served
        name), when this client may reach it; another namespace's model answers exactly as an unknown one."""
        view = self._fleet.view(model)
        if view is None or (scope is not None and view.namespace not in scope):
            raise ModelNotFoundError(f"model {model!r} is not served here")
        return view

    async def health(self, request: HttpRequest, responder: Responder) -> None:
        send_json(responder, 200, {"status": "ok"})

    async def metrics(self, request: HttpRequest, responder: Responder) -> None:
        responder.send(200, [("Content-Type", CONTENT_TYPE_LATEST)], self._metrics.render())

    # -- inference -----------------------------------------------------------------------------

    async def inference(self, request: HttpRequest, responder: Responder) -> None:
        started_s = self._clock()
        model_label = _NO_MODEL  # only known deployments become label values
        code = 500
        try:
            if request.body_too_large:
                raise PayloadTooLargeError(
                    f"request body is larger than the router's limit of {self._settings.max_body_bytes} bytes"
                )
            body, asked = parse_body(request.body)
            view = self._resolve(asked, self._scope(request))
            model = view.key  # exact from here on
            if asked != view.served_name:
                # Qualified (namespace/served-name): the engine knows the served name only.
                body["model"] = view.served_name
                request.body = json.dumps(body).encode()
            block_chars = view.routing.prefix_block_chars
            hashes = block_hashes(
                render_prompt(body),
                model=view.served_name,
                block_chars=block_chars,
                max_blocks=self._settings.max_prompt_blocks,
            )
            tokenize = self._fleet.engine_blocks_job(model, body, hashes)
            if tokenize is not None:
                if len(request.body) > self._settings.kv_events_inline_tokenize_bytes:
                    # Milliseconds of tokenizer work: off the event loop, so other requests are not held up.
                    await asyncio.get_running_loop().run_in_executor(None, tokenize)
                else:
                    tokenize()
            # Labelled with the model only once it is headed for a replica: the autoscaler reads this
            # series as the model's arrivals, and a request the router refuses itself (malformed
            # messages) must not wake a deployment from zero or keep it from scaling there.
            model_label = view.labels
            code = await self._forward(request, responder, model, hashes, started_s, body)
        except RouterError as e:
            code = e.status
            if e.status >= 500:
                log.warning("%s %s: %s", request.path, "/".join(model_label) if model_label[0] else "-", e.reason)
            send_error(responder, e)
        except asyncio.CancelledError:
            code = CLIENT_CLOSED
            raise
        finally:
            self._metrics.requests.inc((*model_label, str(code)))

    async def _forward(
        self,
        request: HttpRequest,
        responder: Responder,
        model: str,
        hashes: list[int],
        started_s: float,
        body: dict[str, Any],
    ) -> int:
        """Send to a replica (retrying elsewhere while nothing was relayed) and relay; returns the status."""
        headers = _forward_headers(request)
        tried: set[str] = set()
        failures: list[str] = []
        for attempt in range(self._settings.max_attempts):
            exclude = frozenset(tried) if tried else _NONE_TRIED
            # The common case picks without a coroutine; ``acquire`` holds the request while there is no replica.
            lease = self._fleet.try_acquire(model, hashes, exclude) or await self._fleet.acquire(model, hashes, exclude)
            if attempt:
                self._metrics.retries.inc(key_labels(model))
                if lease.replica_id in tried:
                    # Only replicas that just failed are left (one died and the source has not dropped it
                    # yet): back off a little so the retry does not land in the same instant.
                    try:
                        await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
                    except BaseException:
                        lease.release("aborted")
                        raise
            try:
                upstream, first = await self._attempt(lease, request.path_qs, request.body, headers)
            except UpstreamAttemptError as e:
                lease.release("failed")
                tried.add(lease.replica_id)
                failures.append(str(e))
                continue
            except BaseException:
                lease.release("aborted")
                raise
            if upstream.at_eof() and upstream.content_type != "text/event-stream":
                self._relay_whole(responder, model, lease, upstream, first, started_s)
            else:
                resume = None
                if body.get("stream") is True and upstream.status == 200 and self._settings.stream_migration_attempts:
                    resume = _Resume(request, body, headers, hashes, tried)
                await self._relay(responder, model, lease, upstream, first, started_s, resume)
            return upstream.status
        raise UpstreamError(
            f"model {model!r}: {len(failures)} attempts failed before any response byte: " + "; ".join(failures)
        )

    async def _attempt(self, lease: Lease, path_qs: str, raw: bytes, headers: bytes) -> tuple[UpstreamResponse, bytes]:
        """Send the request and read its first body bytes: everything here may still be retried."""
        try:
            upstream = self._upstream.send_nowait(lease.url, path_qs, headers, raw) or await self._upstream.send(
                lease.url, path_qs, headers, raw
            )
        except (UpstreamConnectError, UpstreamClosedError) as e:  # refused, connect timeout, closed before headers
            raise UpstreamAttemptError(lease.replica_id, f"{type(e).__name__}: {e}") from e
        try:
            while not upstream.head_done:
                await upstream.progress()
            if upstream.status == 503:
                # Draining or still loading: nothing was done, try another replica.
                raise UpstreamAttemptError(lease.replica_id, "answered 503 (draining or not ready)")
            first = await upstream.readany()
        except UpstreamTimeoutError as e:
            # Connected and sent, then silence: the replica may still be working on it, so no retry.
            upstream.close()
            part = "body" if upstream.head_done else "headers"
            raise GatewayTimeoutError(f"replica {lease.replica_id} sent no response {part} in time") from e
        except UpstreamClosedError as e:
            upstream.close()
            where = "broke before the first byte" if upstream.head_done else type(e).__name__
            raise UpstreamAttemptError(lease.replica_id, f"{where}: {e}") from e
        except BaseException:
            upstream.close()
            raise
        lease.first_byte()
        return upstream, first

    def _relay_whole(
        self,
        responder: Responder,
        model: str,
        lease: Lease,
        upstream: UpstreamResponse,
        first: bytes,
        started_s: float,
    ) -> None:
        """The whole body came in the first read (the usual non-streaming answer): one write, no coroutine."""
        upstream.release()  # fully read: the connection goes back to the keep-alive pool
        try:
            headers = _response_header_lines(upstream, lease.replica_id)
            responder.send(upstream.status, (), first, reason=upstream.reason, raw_headers=headers)
        except BaseException:
            lease.release("aborted")
            raise
        lease.release("ok")
        self._metrics.ttft.observe(key_labels(model), self._clock() - started_s)

    async def _relay(
        self,
        responder: Responder,
        model: str,
        lease: Lease,
        upstream: UpstreamResponse,
        first: bytes,
        started_s: float,
        resume: _Resume | None,
    ) -> None:
        """Pass the replica's answer to the client as it arrives; the request is committed now.

        A streamed completion (``resume``) that its replica breaks is continued on another one
        (``_migrate``); when it cannot be, the client gets an SSE error event and ``[DONE]``.
        """
        is_sse = upstream.content_type == "text/event-stream"
        headers = _response_header_lines(upstream, lease.replica_id)
        length = upstream.content_length if not is_sse else None
        try:
            responder.start(upstream.status, (), content_length=length, reason=upstream.reason, raw_headers=headers)
        except BaseException:
            upstream.close()
            lease.release("aborted")
            raise
        self._metrics.ttft.observe(key_labels(model), self._clock() - started_s)
        splitter = EventSplitter(self._settings.sse_max_pending_bytes) if is_sse else None
        # What the client was sent, kept only for a stream that may need continuing elsewhere.
        sent: list[bytes] | None = [] if resume is not None and splitter is not None else None
        try:
            await self._pump(responder, lease, upstream, first, splitter, sent, None)
        except UpstreamIOError as e:
            if splitter is None:
                # A plain body cannot carry an error now: drop the connection so the client sees a
                # truncated transfer instead of a short body that looks complete.
                responder.abort()
                return
            splitter.discard()
            if resume is not None and sent is not None:
                await self._migrate(responder, model, resume, sent, lease.replica_id, e)
                return
            await responder.write(error_event(f"replica {lease.replica_id} failed mid-stream: {e!r}"))
            await responder.write(b"data: [DONE]\n\n")
            responder.end()
            return
        if splitter is not None and (rest := splitter.flush()):
            await responder.write(rest)
        responder.end()

    async def _pump(
        self,
        responder: Responder,
        lease: Lease,
        upstream: UpstreamResponse,
        first: bytes,
        splitter: EventSplitter | None,
        sent: list[bytes] | None,
        splicer: Splicer | None,
    ) -> None:
        """Copy one upstream body to the client; releases the lease and the upstream either way.

        Raises ``UpstreamIOError`` when the replica broke it (the client is still there)."""
        outcome = "aborted"
        clean_end = False
        try:
            chunk = first
            try:
                while chunk:
                    out = splitter.feed(chunk) if splitter else chunk
                    if out and splicer is not None:
                        out = splicer.rewrite(out)
                    if out:
                        if sent is not None:
                            sent.append(out)
                        await responder.write(out)
                    chunk = await upstream.readany()
            except UpstreamIOError as e:
                outcome = "failed"
                log.warning("replica %s broke a started response: %r", lease.replica_id, e)
                raise
            outcome = "ok"
            clean_end = True
        finally:
            if clean_end:
                upstream.release()  # fully read: the connection goes back to the keep-alive pool
            else:
                upstream.close()  # client gone or replica broke: close, so the replica stops generating
            lease.release(outcome)

    async def _migrate(
        self,
        responder: Responder,
        model: str,
        resume: _Resume,
        sent: list[bytes],
        broken_by: str,
        error: Exception,
    ) -> None:
        """Continue a broken stream on other replicas, within ``stream_migration_attempts`` and
        ``stream_migration_timeout_s``; end it with an error event and ``[DONE]`` when that fails."""
        chat = resume.request.path == CHAT_PATH
        resume.tried.add(broken_by)
        deadline_s = self._clock() + self._settings.stream_migration_timeout_s
        attempts = 0
        broke_s = self._clock()
        why = f"replica {broken_by} broke the stream ({type(error).__name__})"
        while True:
            so_far = progress(b"".join(sent), chat=chat)
            if so_far.done or so_far.finish_reason is not None:
                # Only the tail (usage, [DONE]) was lost: close the stream as it would have been.
                self._metrics.migrations.inc((*key_labels(model), "completed_tail"))
                if not so_far.done:
                    await responder.write(b"data: [DONE]\n\n")
                responder.end()
                return
            plan = continuation(resume.request.path, resume.body, so_far)
            if plan.body is None:
                if plan.remaining_tokens == 0:
                    self._metrics.migrations.inc((*key_labels(model), "completed_tail"))
                    await responder.write(finish_event(so_far, chat=chat))
                    await responder.write(b"data: [DONE]\n\n")
                    responder.end()
                    return
                result, why = "not_continuable", f"{why}; cannot continue: {plan.reason}"
                break
            if attempts >= self._settings.stream_migration_attempts:
                result, why = "attempts_exhausted", f"{why}; {attempts} continuation attempts failed"
                break
            remaining_s = deadline_s - self._clock()
            if remaining_s <= 0:
                limit_s = self._settings.stream_migration_timeout_s
                result, why = "timeout", f"{why}; no continuation within {limit_s:g} s"
                break
            attempts += 1
            raw = json.dumps(plan.body).encode()
            exclude = frozenset(resume.tried)
            try:
                async with asyncio.timeout(remaining_s):
                    lease = self._fleet.try_acquire(model, resume.hashes, exclude) or await self._fleet.acquire(
                        model, resume.hashes, exclude
                    )
                    try:
                        upstream, first = await self._attempt(lease, resume.request.path_qs, raw, resume.headers)
                    except UpstreamAttemptError:
                        lease.release("failed")
                        resume.tried.add(lease.replica_id)
                        raise
                    except BaseException:
                        lease.release("aborted")
                        raise
            except (UpstreamAttemptError, RouterError, TimeoutError) as e:
                log.warning("stream of %s: continuation attempt %d failed: %s", model, attempts, e)
                why = f"{why}; attempt {attempts}: {e}"
                await asyncio.sleep(min(0.05 * attempts, max(0.0, deadline_s - self._clock())))
                continue
            if upstream.status != 200 or upstream.content_type != "text/event-stream":
                upstream.close()
                lease.release("failed")
                resume.tried.add(lease.replica_id)
                why = f"{why}; attempt {attempts}: replica {lease.replica_id} answered {upstream.status}"
                continue
            gap_s = self._clock() - broke_s
            self._metrics.migration_gap.observe(key_labels(model), gap_s)
            self._metrics.migrations.inc((*key_labels(model), "continued"))
            log.info(
                "stream %s of %s continued on %s after %d chars, %.3f s after the break (%s)",
                so_far.response_id or "-",
                model,
                lease.replica_id,
                len(so_far.text),
                gap_s,
                why,
                extra={"stream_id": so_far.response_id, "gap_s": gap_s},
            )
            splitter = EventSplitter(self._settings.sse_max_pending_bytes)
            try:
                await self._pump(responder, lease, upstream, first, splitter, sent, Splicer(so_far, chat=chat))
            except UpstreamIOError as e:
                splitter.discard()
                broke_s = self._clock()
                resume.tried.add(lease.replica_id)
                why = f"replica {lease.replica_id} broke the continued stream ({type(e).__name__})"
                continue
            if rest := splitter.flush():
                await responder.write(Splicer(so_far, chat=chat).rewrite(rest))
            responder.end()
            return
        self._metrics.migrations.inc((*key_labels(model), result))
        log.warning("stream of %s could not be continued: %s", model, why)
        await responder.write(error_event(f"the stream broke and could not be continued: {why}"))
        await responder.write(b"data: [DONE]\n\n")
        responder.end()


class _Resume:
    """What continuing a streamed request elsewhere needs."""

    __slots__ = ("body", "hashes", "headers", "request", "tried")

    def __init__(
        self, request: HttpRequest, body: dict[str, Any], headers: bytes, hashes: list[int], tried: set[str]
    ) -> None:
        self.request = request
        self.body = body
        self.headers = headers
        self.hashes = hashes
        self.tried = tried


def _response_header_lines(upstream: UpstreamResponse, replica_id: str) -> bytes:
    """The replica's end-to-end headers as sent (llhttp has checked them), and which replica answered."""
    lines = [
        name + b": " + value + b"\r\n" for name, value in upstream.raw_headers if name.lower() not in _HOP_BY_HOP_RAW
    ]
    lines.append(b"X-Kvfleet-Replica: " + replica_id.encode("latin-1") + b"\r\n")
    return b"".join(lines)


def _forward_headers(request: HttpRequest) -> bytes:
    """The client's end-to-end headers as ``Name: value\r\n`` lines, with X-Forwarded-For extended."""
    lines: list[bytes] = []
    prior = b""
    for name, value in request.raw_headers:
        lower = name.lower()
        if lower == b"x-forwarded-for":
            prior = value if not prior else prior + b", " + value
        elif lower not in _NOT_FORWARDED_RAW:
            lines.append(name + b": " + value + b"\r\n")
    peer = request.remote.encode("latin-1")
    lines.append(b"X-Forwarded-For: " + (prior + b", " + peer if prior else peer) + b"\r\n")
    return b"".join(lines)
