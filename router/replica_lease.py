"""A request's hold on one replica of its deployment: the counts it keeps while held, and how it ends.

The fleet picks a replica and hands out a ``ReplicaLease``; the request path holds it in a ``with``
block for one attempt. While held, the replica counts the request in flight and, until the answer's
first body byte, waiting; leaving the block takes it out of both and tells the fleet how the attempt
went (ok, failed, aborted), which feeds outlier ejection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvfleet.router.errors import ReplicaFailure
from kvfleet.router.picking import Pick
from kvfleet.router.replicas import Endpoint


@dataclass
class ReplicaLoad:
    """One replica as the fleet knows it: where it is, and the requests this router has on it."""

    endpoint: Endpoint
    inflight: int = 0  # sent and not finished
    # Sent and no response body byte yet: queued or prefilling at the engine (for a streamed answer;
    # a non-streamed one's first byte comes with the whole answer, so it counts here until done).
    waiting: int = 0


class ReplicaLease:
    """One attempt's hold on a replica, released exactly once.

    Used as ``with lease:``, how the block ends is the outcome: normally ``ok`` (the replica answered),
    by a ``ReplicaFailure`` ``failed`` (counts towards ejecting it), by anything else ``aborted`` (the
    client left, the router refused: neither). ``release(outcome)`` does the same by hand.

    It holds the replica's record itself, not its id: a replica that leaves and comes back under the
    same id is a new record, and requests sent to the old process never touch the new one's counts.
    """

    __slots__ = (
        "_awaiting",
        "_on_change",
        "_on_release",
        "_released",
        "_replica",
        "model",
        "pick",
        "replica_id",
        "url",
    )

    def __init__(
        self,
        model: str,
        replica_id: str,
        url: str,
        pick: Pick,
        replica: ReplicaLoad,
        on_release: Callable[[ReplicaLease, str], None],
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.replica_id = replica_id
        self.url = url
        self.pick = pick
        self._replica = replica
        self._on_release = on_release  # the fleet's outlier detection hears every outcome
        self._on_change = on_change  # the replica's counts moved (the peer link sends them)
        self._released = False
        self._awaiting = True

    def __enter__(self) -> ReplicaLease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            self.release("ok")
        elif issubclass(exc_type, ReplicaFailure):
            self.release("failed")
        else:
            self.release("aborted")

    def first_byte(self) -> None:
        """The answer's first body bytes arrived: the request is past the replica's prefill queue."""
        if self._awaiting:
            self._awaiting = False
            self._replica.waiting -= 1
            if self._on_change is not None:
                self._on_change()

    def release(self, outcome: str) -> None:
        """``ok``: the replica answered; ``failed``: it failed before the first byte; ``aborted``: neither."""
        if self._released:
            return
        self._released = True
        self.first_byte()  # no longer waiting either way (a no-op when it already counted)
        self._replica.inflight -= 1
        self._on_release(self, outcome)
