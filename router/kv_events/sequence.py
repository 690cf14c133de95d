"""What a batch's sequence number says about the batches before it: in order, lost, a restart, a repeat.

Apart from decoding because it is state kept per subscription across batches, while decoding looks
at one batch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SequenceCheck:
    """What each batch's sequence number says about the batches before it.

    ``next``: the number expected (None before the first batch). A publisher numbers its batches from
    0 when it starts, so a number below the expected one is a restarted engine (its cache is empty),
    unless it is a repeat of one just seen.
    """

    next: int | None = None

    def check(self, seq: int) -> str:
        """``ok``, ``first`` (the first batch seen), ``gap`` (batches were lost: a slow subscriber past the
        socket's high-water mark, a dropped connection), ``restart`` (the publisher started over) or
        ``duplicate`` (the batch just before again; skip it)."""
        expected = self.next
        if seq < 0:
            return "duplicate"  # vLLM's end-of-replay marker (-1) is never a batch
        if expected is None:
            self.next = seq + 1
            return "first"
        if seq == expected:
            self.next = seq + 1
            return "ok"
        if seq == expected - 1:
            return "duplicate"
        self.next = seq + 1
        return "gap" if seq > expected else "restart"
