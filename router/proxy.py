"""The OpenAI-compatible HTTP surface: dispatch, the small endpoints, and the start of an inference
request (parse and check it, resolve its model, hash its prompt) before ``forward.Forwarder`` takes it to
a replica. Router errors are translated to HTTP answers here, once."""

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

from kvfleet.contracts import COLD_START_HEADER
from kvfleet.openai_shape import error_body, method_not_allowed_body, model_object, not_found_body
from kvfleet.router.errors import (
    BadRequestError,
    ClientNamespaceError,
    ModelNotFoundError,
    PayloadTooLargeError,
    RouterError,
)
from kvfleet.router.fleet import Fleet
from kvfleet.router.forward import Forwarder
from kvfleet.router.http_server import Handler, Headers, HttpRequest, Responder
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.replicas import DeploymentView
from kvfleet.router.settings import RouterSettings
from kvfleet.router.upstream import UpstreamPool

log = logging.getLogger(__name__)

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


def send_json(responder: Responder, status: int, obj: object, extra: Headers = ()) -> None:
    responder.send(status, [_JSON, *extra], json.dumps(obj).encode())


def send_error(responder: Responder, error: RouterError) -> None:
    extra = [("Retry-After", str(error.retry_after_s))] if error.retry_after_s is not None else []
    if error.held_s is not None:
        extra.append((COLD_START_HEADER, f"{error.held_s:.3f}"))
    body = error_body(error.reason, error.kind, param=error.param, code=error.code)
    send_json(responder, error.status, body, extra)


REPORT_HITS = b'"vllm_xargs":{"kv_cache_report_mode":"full"},'


def with_hits_reported(raw: bytes, body: dict[str, Any]) -> bytes:
    """The request asking its engine to announce the prefix-cache blocks it hits (vLLM's per-request
    ``vllm_xargs.kv_cache_report_mode: "full"``), so every router's view learns a prefix stored before it
    subscribed. ``body`` is ``raw`` parsed (an object with a model: never empty). A client's own
    ``vllm_xargs`` are kept, and its own report mode wins."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        # Spliced after the opening brace: no re-encoding of a long prompt.
        start = raw.index(b"{") + 1
        return raw[:start] + REPORT_HITS + raw[start:]
    if isinstance(xargs, dict) and "kv_cache_report_mode" not in xargs:
        body["vllm_xargs"] = {**xargs, "kv_cache_report_mode": "full"}
        return json.dumps(body).encode()
    return raw


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
        self._clock = clock
        self._forwarder = Forwarder(settings, fleet, metrics, upstream, clock)
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
            hashes = self._fleet.prompt_blocks(model, body)
            tokenize = self._fleet.engine_blocks_job(model, body, hashes)
            if tokenize is not None:
                if self._settings.kv_events_report_hits:
                    request.body = with_hits_reported(request.body, body)
                if len(request.body) > self._settings.kv_events_inline_tokenize_bytes:
                    # Milliseconds of tokenizer work: off the event loop, so other requests are not held up.
                    await asyncio.get_running_loop().run_in_executor(None, tokenize)
                else:
                    tokenize()
            # Labelled with the model only once it is headed for a replica: the autoscaler reads this
            # series as the model's arrivals, and a request the router refuses itself (malformed
            # messages) must not wake a deployment from zero or keep it from scaling there.
            model_label = view.labels
            code = await self._forwarder.forward(request, responder, model, hashes, started_s, body)
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
