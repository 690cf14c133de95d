"""Holding a request while its model has no ready replica, so that the client survives the cold start.

- A streamed request (``"stream": true``) gets its response head (200, ``text/event-stream``) at once
  and an SSE comment line every ``cold_start_comment_interval_s`` with the wake's progress, so the
  proxies between client and router see traffic and do not time it out. Its status is committed from
  the first comment: a wake that fails or runs past ``routing.maxQueueWaitSeconds`` ends the stream
  with an OpenAI-shaped error event and ``[DONE]`` (``Forwarder``), as a failed migration does.
- Any other request is held as before, bounded by ``routing.maxQueueWaitSeconds``; when the wake's
  own estimate already exceeds that bound it is answered 503 at once (Retry-After from the
  estimate), and the wake is still sent so the deployment is ready for the retry.

Every held answer carries ``X-Kvfleet-Cold-Start: <seconds held>``; the metrics count held requests by
outcome, the time held and the comments sent. A client that leaves while held cancels its hold: it
leaves the queue at once, and the wake stops repeating when no one else waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from kvfleet.contracts import COLD_START_HEADER
from kvfleet.router.cold_start import comment, remaining_s, retry_after_s, starting_message, waiting_comment
from kvfleet.router.errors import (
    ColdStartingError,
    ModelNotFoundError,
    QueueFullError,
    QueueTimeoutError,
    RouterError,
)
from kvfleet.router.fleet import Fleet
from kvfleet.router.http_server import Responder
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.replica_lease import ReplicaLease
from kvfleet.router.replicas import key_labels
from kvfleet.router.settings import RouterSettings

_OUTCOMES: dict[type[RouterError], str] = {
    QueueTimeoutError: "timeout",
    ColdStartingError: "refused",
    QueueFullError: "full",
    ModelNotFoundError: "gone",
}
# The head of a held stream: no caching, and no buffering by nginx (its X-Accel-Buffering), which would
# hold the comments back and defeat them.
_STREAM_HEAD = (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no"))


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Held:
    """One request's hold: when it began, how long it lasted, and whether its stream's head (and so
    its 200) already went out with the comments (``committed``)."""

    __slots__ = ("comments", "committed", "held_s", "started_s")

    def __init__(self, started_s: float) -> None:
        self.started_s = started_s
        self.held_s = 0.0
        self.committed = False
        self.comments = 0

    def header_line(self) -> bytes:
        """``X-Kvfleet-Cold-Start: <seconds held>\\r\\n`` for a response head sent after the hold."""
        return b"%s: %.3f\r\n" % (COLD_START_HEADER.encode(), self.held_s)


class ColdStartHold:
    def __init__(
        self, settings: RouterSettings, fleet: Fleet, metrics: RouterMetrics, clock: Callable[[], float]
    ) -> None:
        self._settings = settings
        self._fleet = fleet
        self._metrics = metrics
        self._clock = clock

    async def hold(
        self,
        responder: Responder,
        model: str,
        body: dict[str, Any],
        hashes: Sequence[int],
        exclude: frozenset[str],
    ) -> tuple[ReplicaLease, Held]:
        """A replica for the request, holding it (with comments where it streams) until one takes
        requests; raises the ``RouterError`` that ends the hold, with its ``held_s`` set."""
        held = Held(self._clock())
        labels = key_labels(model)
        outcome = "client_gone"  # unless the hold ends otherwise: cancelled, or the comments' writes failed
        try:
            if body.get("stream") is True and self._settings.cold_start_comments:
                lease = await self._with_comments(responder, model, hashes, exclude, held)
            else:
                self._refuse_if_too_long(model)
                lease = await self._fleet.acquire(model, hashes, exclude)
            outcome = "served"
            return lease, held
        except RouterError as e:
            outcome = _OUTCOMES.get(type(e), "failed")
            e.held_s = self._clock() - held.started_s if outcome != "refused" else 0.0
            raise
        finally:
            held.held_s = self._clock() - held.started_s
            self._metrics.cold_start_holds.inc((*labels, outcome))
            if outcome != "refused":
                self._metrics.cold_start_hold_time.observe(labels, held.held_s)

    async def again(
        self, responder: Responder, model: str, hashes: Sequence[int], exclude: frozenset[str], held: Held
    ) -> ReplicaLease:
        """A retry that finds no replica after the hold (the replica it got failed before answering):
        held again, with the comments going on where its stream's head went out already. Counted once,
        as the first hold."""
        try:
            if not held.committed:
                return await self._fleet.acquire(model, hashes, exclude)
            return await self._with_comments(responder, model, hashes, exclude, held)
        finally:
            held.held_s = self._clock() - held.started_s

    def until_first_token(self, responder: Responder, model: str, held: Held) -> asyncio.Task[None] | None:
        """For a held stream whose replica was leased: comments go on while the replica prepares its first
        token (a long prompt's prefill, the new engine's first compile), so the proxies' timers stay
        reset until it comes. The caller cancels the task before it writes the token; a write is whole
        (``Responder.write`` hands the transport each chunk at once), so none is cut."""
        if not held.committed:
            return None
        return asyncio.get_running_loop().create_task(self._awaiting_token(responder, model, held))

    async def _awaiting_token(self, responder: Responder, model: str, held: Held) -> None:
        labels = key_labels(model)
        try:
            while True:
                await asyncio.sleep(self._settings.cold_start_comment_interval_s)
                await responder.write(waiting_comment(self._clock() - held.started_s))
                held.comments += 1
                self._metrics.cold_start_comments.inc(labels)
        except Exception:  # noqa: S110 - the client left: its request's own task ends it
            pass

    def _refuse_if_too_long(self, model: str) -> None:
        """503 at once when the wake is expected to outlast the hold bound (the wake is still sent)."""
        view, waking_for_s = self._fleet.cold_start(model)
        left = remaining_s(view.cold_start, waking_for_s)
        bound_s = view.routing.max_queue_wait_seconds
        if left is not None and left > bound_s:
            self._fleet.wake_once(model)
            why = starting_message(view.served_name, left, bound_s)
            raise ColdStartingError(why, retry_after_s=retry_after_s(left))

    async def _with_comments(
        self, responder: Responder, model: str, hashes: Sequence[int], exclude: frozenset[str], held: Held
    ) -> ReplicaLease:
        """Send the stream's head at once (unless it went out already), then a comment every interval
        until a replica is leased."""
        if not held.committed:
            responder.start(200, (*_STREAM_HEAD, (COLD_START_HEADER, "0.000")))
            held.committed = True
        loop = asyncio.get_running_loop()
        acquiring = loop.create_task(self._fleet.acquire(model, hashes, exclude))
        # One future per interval, set by its timer or by the acquire finishing: a third of
        # asyncio.wait's cost per comment (docs/benchmarks/cold_start_hold.md).
        tick: list[asyncio.Future[None]] = [loop.create_future()]
        acquiring.add_done_callback(lambda _: _wake(tick[0]))
        handed_over = False
        labels = key_labels(model)
        try:
            while not acquiring.done():
                view, waking_for_s = self._fleet.cold_start(model)
                now_s = self._clock()
                await responder.write(comment(view.served_name, view.cold_start, now_s - held.started_s, waking_for_s))
                held.comments += 1
                self._metrics.cold_start_comments.inc(labels)
                if acquiring.done():
                    break
                tick[0] = loop.create_future()
                timer = loop.call_later(self._settings.cold_start_comment_interval_s, _wake, tick[0])
                try:
                    await tick[0]
                finally:
                    timer.cancel()
            lease = acquiring.result()
            handed_over = True
            return lease
        finally:
            if not acquiring.done():
                acquiring.cancel()  # leaves the queue: no longer counted, no longer woken for
            elif not handed_over and not acquiring.cancelled() and acquiring.exception() is None:
                acquiring.result().release("aborted")  # leased in the instant the client left
