"""One inference request's way to a replica and back: lease a replica, send, read the answer's head and
first bytes (all of which may still be retried elsewhere), relay the answer, and continue a stream
that its replica broke on another one.

Leases and upstream responses are ``with`` blocks, so each is released exactly once however its block
ends (the block's exception says how the attempt went). A failure talking to a replica becomes the
router's answer in one place, ``upstream_failure``, by the phase it happened in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from kvfleet.openai_shape import openai_error_body
from kvfleet.router.cold_hold import ColdStartHold, Held
from kvfleet.router.cold_start import ready_comment
from kvfleet.router.errors import (
    GatewayTimeoutError,
    RouterError,
    StreamBrokenError,
    UpstreamAttemptError,
    UpstreamBusyError,
    UpstreamError,
)
from kvfleet.router.fleet import Fleet
from kvfleet.router.headers import forward_headers, response_header_lines
from kvfleet.router.http_server import HttpRequest, Responder
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.migration import (
    CHAT_PATH,
    Splicer,
    UsageFilter,
    continuation,
    engine_body,
    finish_event,
    progress,
    with_usage_asked,
)
from kvfleet.router.replica_lease import ReplicaLease
from kvfleet.router.replicas import key_labels
from kvfleet.router.settings import RouterSettings
from kvfleet.router.sse import EventSplitter, error_event
from kvfleet.router.upstream import (
    UpstreamConnectError,
    UpstreamIOError,
    UpstreamPool,
    UpstreamPoolTimeoutError,
    UpstreamResponse,
    UpstreamTimeoutError,
)

# The logger keeps the proxy's name: operators and bench/chaos.py filter the request path's records by it.
log = logging.getLogger("kvfleet.router.proxy")

# First wait before retrying on a replica that already failed this request; doubles per attempt.
RETRY_BACKOFF_S = 0.25
_SSE = "text/event-stream"
_JSON = "application/json"
# A replica's error answer to a held stream is passed on as an event of at most this much of its body.
_MAX_ERROR_BODY_BYTES = 64 * 1024
_NONE_TRIED: frozenset[str] = frozenset()

# Where a request was when talking to its replica failed (the label of kvfleet_router_upstream_timeouts).
PHASES = ("pool", "connect", "head", "body")


def upstream_failure(
    error: UpstreamIOError, replica_id: str, *, head_done: bool, retry_after_s: int
) -> tuple[str, RouterError | UpstreamAttemptError]:
    """The phase of a failure before any byte reached the client, and what the router makes of it.

    - pool: no connection to the replica came free within pool_wait_timeout_s: 503 with Retry-After
      (a closed pool, the router stopping, is a retryable attempt).
    - connect: refused or timed out; nothing was sent, so another replica is tried.
    - head, body (before the first body byte): silence past idle_read_timeout_s is 504, not retried
      (the replica may still be working on it); a broken connection is retried elsewhere.
    """
    if isinstance(error, UpstreamPoolTimeoutError):
        reason = f"replica {replica_id} is at this router's connection limit: {error}"
        return "pool", UpstreamBusyError(reason, retry_after_s=retry_after_s)
    if isinstance(error, UpstreamConnectError):
        return "connect", UpstreamAttemptError(replica_id, f"{type(error).__name__}: {error}")
    phase = "body" if head_done else "head"
    if isinstance(error, UpstreamTimeoutError):
        part = "body" if head_done else "headers"
        return phase, GatewayTimeoutError(f"replica {replica_id} sent no response {part} in time")
    where = "broke before the first byte" if head_done else type(error).__name__
    return phase, UpstreamAttemptError(replica_id, f"{where}: {error}")


async def _openai_error(upstream: UpstreamResponse, first: bytes) -> bytes:
    """A replica's JSON error answer, read whole (bounded), in OpenAI's shape (vLLM's ``type`` is a class
    name and its ``code`` the HTTP status). Left as it came when it is longer than the bound, breaks
    (the relay then fails as any broken body does) or is OpenAI's shape already."""
    body = first
    try:
        while not upstream.at_eof() and len(body) < _MAX_ERROR_BODY_BYTES:
            body += await upstream.readany()
    except UpstreamIOError:
        return body
    if not upstream.at_eof():
        return body
    try:
        shaped = openai_error_body(upstream.status, json.loads(body))
    except ValueError:
        return body
    return json.dumps(shaped).encode() if shaped is not None else body


class _Resume(NamedTuple):
    """What continuing a streamed request elsewhere needs."""

    request: HttpRequest
    body: dict[str, Any]
    headers: bytes
    hashes: list[int]
    tried: set[str]


class _Relay(NamedTuple):
    """An answer being relayed: its SSE splitter (None: a plain body), the events relayed (kept only for
    a stream that may need continuing elsewhere; with the usage the router asked for), how to continue
    it (None: not), and what takes that usage out again before the client (None: nothing to take)."""

    splitter: EventSplitter | None
    sent: list[bytes] | None
    resume: _Resume | None
    usage: UsageFilter | None = None


class Forwarder:
    def __init__(
        self,
        settings: RouterSettings,
        fleet: Fleet,
        metrics: RouterMetrics,
        upstream: UpstreamPool,
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._fleet = fleet
        self._metrics = metrics
        self._upstream = upstream
        self._clock = clock
        self._hold = ColdStartHold(settings, fleet, metrics, clock)

    async def forward(
        self,
        request: HttpRequest,
        responder: Responder,
        model: str,
        hashes: list[int],
        started_s: float,
        body: dict[str, Any],
    ) -> int:
        """Send to a replica (retrying elsewhere while nothing was relayed) and relay; returns the status."""
        headers = forward_headers(request)
        raw = request.body
        usage: UsageFilter | None = None
        if body.get("stream") is True and self._settings.stream_migration_attempts:
            # The engine's token counts in every chunk: what a continuation's max_tokens needs (migration.py).
            asked = with_usage_asked(raw, body)
            if asked is not None:
                raw, usage = asked, UsageFilter(body)
        tried: set[str] = set()
        failures: list[str] = []
        held: Held | None = None
        try:
            for attempt in range(self._settings.max_attempts):
                exclude = frozenset(tried) if tried else _NONE_TRIED
                # The common case picks without a coroutine; a request that finds no replica is held (cold_hold.py).
                lease = self._fleet.try_acquire(model, hashes, exclude)
                if lease is None:
                    if held is None:
                        lease, held = await self._hold.hold(responder, model, body, hashes, exclude)
                    else:  # held once already, and its replica failed: held again (comments go on)
                        lease = await self._hold.again(responder, model, hashes, exclude, held)
                if attempt:
                    self._metrics.retries.inc(key_labels(model))
                relay: _Relay | None = None
                # A held stream's comments go on until its replica's first token (cancelled right then).
                ticking = self._hold.until_first_token(responder, model, held) if held is not None else None
                try:
                    with lease:
                        if attempt and lease.replica_id in tried:
                            # Only replicas that just failed are left (one died and the source has not dropped it
                            # yet): back off a little so the retry does not land in the same instant.
                            await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
                        upstream = self._upstream.send_nowait(
                            lease.url, request.path_qs, headers, raw
                        ) or await self._send(model, lease, request.path_qs, raw, headers)
                        with upstream:
                            first = await self._first_bytes(model, lease, upstream)
                            if ticking is not None:
                                ticking.cancel()
                            committed = held is not None and held.committed
                            if committed and (upstream.status != 200 or upstream.content_type != _SSE):
                                await self._answer_as_event(responder, lease.replica_id, upstream, first)
                                return upstream.status
                            held_line = held.header_line() if held is not None else b""
                            if upstream.status >= 400 and upstream.content_type == _JSON:
                                first = await _openai_error(upstream, first)
                            if upstream.at_eof() and upstream.content_type != _SSE:
                                self._relay_whole(
                                    responder, model, lease.replica_id, upstream, first, started_s, held_line
                                )
                                return upstream.status
                            resume = None
                            if (
                                body.get("stream") is True
                                and upstream.status == 200
                                and self._settings.stream_migration_attempts
                            ):
                                resume = _Resume(request, body, headers, hashes, tried)
                            relay = self._start_relay(
                                responder,
                                model,
                                lease.replica_id,
                                upstream,
                                started_s,
                                resume,
                                held_line,
                                committed,
                                usage,
                            )
                            if committed:
                                assert held is not None
                                # The last comment, then the first token: no comment follows it.
                                await responder.write(ready_comment(held.held_s))
                            await self._pump(responder, model, lease.replica_id, upstream, first, relay, None)
                except UpstreamAttemptError as e:
                    tried.add(e.replica_id)
                    failures.append(str(e))
                    continue
                except StreamBrokenError as e:
                    assert relay is not None  # only the relay raises it
                    await self._after_break(responder, model, relay, e)
                    return upstream.status
                finally:
                    if ticking is not None:
                        ticking.cancel()
                if relay.splitter is not None and (rest := relay.splitter.flush()):
                    await responder.write(relay.usage.apply(rest) if relay.usage else rest)
                responder.end()
                return upstream.status
            error = UpstreamError(
                f"model {model!r}: {len(failures)} attempts failed before any response byte: " + "; ".join(failures)
            )
            error.held_s = held.held_s if held is not None else None
            raise error
        except RouterError as e:
            if not responder.started or responder.finished:
                raise
            # A held stream's head went out with its cold-start comments: the error can only be an event.
            await responder.write(error_event(e.reason, kind=e.kind))
            await responder.write(b"data: [DONE]\n\n")
            responder.end()
            return e.status

    # -- one attempt ---------------------------------------------------------------------------

    async def _send(
        self, model: str, lease: ReplicaLease, path_qs: str, raw: bytes, headers: bytes
    ) -> UpstreamResponse:
        """Send when no idle connection was at hand: wait for a free one (pool) or open one (connect)."""
        try:
            return await self._upstream.send(lease.url, path_qs, headers, raw)
        except UpstreamIOError as e:
            raise self._failure(model, lease.replica_id, e, head_done=False) from e

    async def _first_bytes(self, model: str, lease: ReplicaLease, upstream: UpstreamResponse) -> bytes:
        """Read the head and the first body bytes: until here the attempt may still be retried."""
        try:
            while not upstream.head_done:
                await upstream.progress()
            if upstream.status == 503:
                # Draining or still loading: nothing was done, try another replica.
                raise UpstreamAttemptError(lease.replica_id, "answered 503 (draining or not ready)")
            first = await upstream.readany()
        except UpstreamIOError as e:
            raise self._failure(model, lease.replica_id, e, head_done=upstream.head_done) from e
        lease.first_byte()
        return first

    def _failure(
        self, model: str, replica_id: str, error: UpstreamIOError, *, head_done: bool
    ) -> RouterError | UpstreamAttemptError:
        phase, failure = upstream_failure(
            error, replica_id, head_done=head_done, retry_after_s=self._settings.retry_after_s
        )
        if error.is_timeout:
            self._metrics.upstream_timeouts.inc((*key_labels(model), phase))
        return failure

    # -- relaying ------------------------------------------------------------------------------

    def _relay_whole(
        self,
        responder: Responder,
        model: str,
        replica_id: str,
        upstream: UpstreamResponse,
        first: bytes,
        started_s: float,
        held_line: bytes = b"",
    ) -> None:
        """The whole body came in the first read (the usual non-streaming answer): one write, no coroutine."""
        headers = response_header_lines(upstream, replica_id) + held_line
        responder.send(upstream.status, (), first, reason=upstream.reason, raw_headers=headers)
        self._metrics.ttft.observe(key_labels(model), self._clock() - started_s)

    def _start_relay(
        self,
        responder: Responder,
        model: str,
        replica_id: str,
        upstream: UpstreamResponse,
        started_s: float,
        resume: _Resume | None,
        held_line: bytes = b"",
        committed: bool = False,
        usage: UsageFilter | None = None,
    ) -> _Relay:
        """Send the answer's head to the client (unless a held stream's went out already): the request
        is committed now."""
        is_sse = upstream.content_type == _SSE
        if not committed:
            headers = response_header_lines(upstream, replica_id) + held_line
            length = upstream.content_length if not is_sse else None
            responder.start(upstream.status, (), content_length=length, reason=upstream.reason, raw_headers=headers)
        self._metrics.ttft.observe(key_labels(model), self._clock() - started_s)
        splitter = EventSplitter(self._settings.sse_max_pending_bytes) if is_sse else None
        sent: list[bytes] | None = [] if resume is not None and splitter is not None else None
        return _Relay(splitter, sent, resume, usage if splitter is not None else None)

    async def _answer_as_event(
        self, responder: Responder, replica_id: str, upstream: UpstreamResponse, first: bytes
    ) -> None:
        """A held stream (200 sent with its comments) whose replica answered other than a 200 stream (a 400
        for a bad parameter, say): the replica's error, bounded, as an error event, then ``[DONE]``."""
        body = first
        try:
            while len(body) < _MAX_ERROR_BODY_BYTES and (more := await upstream.readany()):
                body += more
        except UpstreamIOError as e:
            log.warning("replica %s broke its error answer to a held stream: %r", replica_id, e)
        payload = None
        with contextlib.suppress(ValueError):  # not JSON: passed on as text
            payload = json.loads(body[:_MAX_ERROR_BODY_BYTES])
        payload = openai_error_body(upstream.status, payload) or payload
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            await responder.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        else:
            text = body[:512].decode("utf-8", "replace")
            why = f"replica {replica_id} answered {upstream.status}: {text}"
            await responder.write(error_event(why, kind="upstream_error"))
        await responder.write(b"data: [DONE]\n\n")
        responder.end()

    async def _pump(
        self,
        responder: Responder,
        model: str,
        replica_id: str,
        upstream: UpstreamResponse,
        first: bytes,
        relay: _Relay,
        splicer: Splicer | None,
    ) -> None:
        """Copy one upstream body to the client; ``StreamBrokenError`` when the replica broke it."""
        splitter, sent = relay.splitter, relay.sent
        chunk = first
        try:
            while chunk:
                out = splitter.feed(chunk) if splitter else chunk
                if out and splicer is not None:
                    out = splicer.rewrite(out)
                if out:
                    if sent is not None:
                        sent.append(out)
                    if relay.usage is not None:
                        out = relay.usage.apply(out)
                if out:
                    await responder.write(out)
                chunk = await upstream.readany()
        except UpstreamIOError as e:
            log.warning("replica %s broke a started response: %r", replica_id, e)
            if e.is_timeout:
                self._metrics.upstream_timeouts.inc((*key_labels(model), "body"))
            raise StreamBrokenError(replica_id, e) from e

    async def _after_break(self, responder: Responder, model: str, relay: _Relay, broken: StreamBrokenError) -> None:
        """A started answer broke: continue a stream elsewhere, or end it so the client sees the break."""
        if relay.splitter is None:
            # A plain body cannot carry an error now: drop the connection so the client sees a
            # truncated transfer instead of a short body that looks complete.
            responder.abort()
            return
        relay.splitter.discard()
        if relay.resume is not None and relay.sent is not None:
            await self._migrate(
                responder, model, relay.resume, relay.sent, broken.replica_id, broken.error, relay.usage
            )
            return
        await responder.write(error_event(f"replica {broken.replica_id} failed mid-stream: {broken.error!r}"))
        await responder.write(b"data: [DONE]\n\n")
        responder.end()

    async def _migrate(
        self,
        responder: Responder,
        model: str,
        resume: _Resume,
        sent: list[bytes],
        broken_by: str,
        error: Exception,
        usage: UsageFilter | None = None,
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
            raw = json.dumps(engine_body(plan.body) or plan.body).encode()
            exclude = frozenset(resume.tried)
            relay = _Relay(EventSplitter(self._settings.sse_max_pending_bytes), sent, None, usage)
            try:
                # The deadline covers finding a replica and its first byte; the continued stream then
                # takes as long as it needs.
                async with asyncio.timeout(remaining_s) as limit:
                    lease = self._fleet.try_acquire(model, resume.hashes, exclude) or await self._fleet.acquire(
                        model, resume.hashes, exclude
                    )
                    with lease:
                        upstream = self._upstream.send_nowait(
                            lease.url, resume.request.path_qs, resume.headers, raw
                        ) or await self._send(model, lease, resume.request.path_qs, raw, resume.headers)
                        with upstream:
                            first = await self._first_bytes(model, lease, upstream)
                            if upstream.status != 200 or upstream.content_type != _SSE:
                                raise UpstreamAttemptError(lease.replica_id, f"answered {upstream.status}")
                            limit.reschedule(None)
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
                            splicer = Splicer(so_far, chat=chat)
                            await self._pump(responder, model, lease.replica_id, upstream, first, relay, splicer)
            except StreamBrokenError as e:
                assert relay.splitter is not None
                relay.splitter.discard()
                broke_s = self._clock()
                resume.tried.add(e.replica_id)
                why = f"replica {e.replica_id} broke the continued stream ({type(e.error).__name__})"
                continue
            except (UpstreamAttemptError, RouterError, TimeoutError) as e:
                if isinstance(e, UpstreamAttemptError):
                    resume.tried.add(e.replica_id)
                log.warning("stream of %s: continuation attempt %d failed: %s", model, attempts, e)
                why = f"{why}; attempt {attempts}: {e}"
                await asyncio.sleep(min(0.05 * attempts, max(0.0, deadline_s - self._clock())))
                continue
            assert relay.splitter is not None
            if rest := relay.splitter.flush():
                rest = Splicer(so_far, chat=chat).rewrite(rest)
                await responder.write(usage.apply(rest) if usage else rest)
            responder.end()
            return
        self._metrics.migrations.inc((*key_labels(model), result))
        log.warning("stream of %s could not be continued: %s", model, why)
        await responder.write(error_event(f"the stream broke and could not be continued: {why}"))
        await responder.write(b"data: [DONE]\n\n")
        responder.end()
