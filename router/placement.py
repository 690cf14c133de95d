"""Placement every router replica agrees on without talking: rendezvous hashing over where a prompt diverges.

Several routers behind one Service each see a random share of the requests, so each one's learned
prefix index knows only its own picks, and the same conversation or document is homed on different
replicas by different routers. A deterministic home fixes that: every router ranks the replicas for
a prompt the same way (rendezvous, or highest-random-weight, hashing of a stable key and each replica
id), so they agree with nothing shared; the load bound and the learned index then refine the choice
(an overloaded home is filtered out and the next in the ranking takes its place).

The key is what decides whether that helps. Hashing the first block homes every prompt that starts
with the same system prompt on one replica; hashing the whole prompt homes every turn of a
conversation apart. The key here is the prompt up to and including its **divergence block**: the
block after the deepest *family* point on its path, a point where the prompts seen branch into
children that come back (``BranchIndex``):
- chat with a shared system prompt: the system prompt branches at its end into conversations, which
  come back turn after turn: key = the conversation's first block past it, the same for every later
  turn, which only extends the chain;
- RAG with a shared instruction before the document: key = the document's first block (documents
  come back with more questions; the questions, which do not, are no family point);
- prompts that diverge at their first block (tenants' own system prompts, unrelated prompts) get no
  key: each router's own index places them, which measured better than a hashed home.
Routers that saw different samples of the same traffic find the same family points, so they compute
the same key; a router that starts empty finds them once it sees a few prompts come back.

Nothing here does I/O; memory is bounded by ``max_entries``, CPU per request by ``max_depth_blocks``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet.router.picking import Candidate, PickRequest
    from kvfleet.router.prefix_index import PrefixIndex

# Python's hash() never returns -1 (CPython maps -1 to -2), so -1 can mark what no block hash is.
ROOT = -1  # the parent of every prompt's first block
BRANCHED = -1  # a block seen with two or more different next blocks

_MASK = (1 << 64) - 1


class BranchIndex:
    """Where the prompts seen diverge, and which of those points lead to families of prompts.

    For each block seen: its only next block, or ``BRANCHED``. A branch point is a **family** point once
    a prompt passes through one of its children that an earlier prompt reached too: its children
    recur (conversations come back with their next turn, documents with their next question), unlike
    a point whose children are one-off questions. Both are bounded by ``max_entries``, branch points
    refreshed on every pass (LRU), other blocks in the order they were learned.
    """

    def __init__(self, max_entries: int, max_depth_blocks: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_depth_blocks < 1:
            raise ValueError(f"max_depth_blocks must be >= 1, got {max_depth_blocks}")
        self.max_entries = max_entries
        self.max_depth_blocks = max_depth_blocks
        self._next: OrderedDict[int, int] = OrderedDict()
        self._family: OrderedDict[int, None] = OrderedDict()

    def observe(self, hashes: Sequence[int]) -> int:
        """Learn the prompt's chain and return its divergence block.

        That is the block after the deepest family point on the prompt's path (the first block that is
        this conversation's or document's own); -1 when none is known within ``max_depth_blocks`` (a
        router that has seen too little, or a shared prefix longer than the bound). Prompts of several
        applications diverge at the root, then each application's conversations after its system
        prompt: the deepest family point is the conversation's, whatever else shares the router.
        CPU: one dict lookup per block up to ``max_depth_blocks`` along chains seen before. Only branch
        points are refreshed in the LRU: a single-chain block that ages out is learned again from the
        next prompt through it, while the points keys depend on stay.
        """
        nxt = self._next
        family = self._family
        get = nxt.get
        parent = ROOT
        key = -1
        for j, child in enumerate(hashes[: self.max_depth_blocks]):
            known = get(parent)
            if known != child:  # anything but a single chain seen before (the common case: one lookup)
                if known is None:
                    nxt[parent] = child
                    if len(nxt) > self.max_entries:
                        nxt.popitem(last=False)
                elif known != BRANCHED and known == parent:  # a prompt ended here before: this one goes on
                    nxt[parent] = child
                else:  # a branch point (BRANCHED is never a block hash)
                    nxt[parent] = BRANCHED
                    nxt.move_to_end(parent)
                    if parent in family:
                        family.move_to_end(parent)
                        key = j
                    elif child in nxt:  # an earlier prompt reached this child: it recurs
                        family[parent] = None
                        if len(family) > self.max_entries:
                            family.popitem(last=False)
                        key = j
            parent = child
        if parent != ROOT and parent not in nxt:  # a prompt's last block maps to itself: "nothing after it yet"
            nxt[parent] = parent
            if len(nxt) > self.max_entries:
                nxt.popitem(last=False)
        return key

    def entries(self) -> int:
        return len(self._next) + len(self._family)


def stable_key(hashes: Sequence[int], block: int) -> int:
    """A key for the prompt up to the end of ``block`` that every router process computes alike.

    The block hashes are Python's keyed per-process hash, so they cannot be compared across router
    processes; ``BlockChain`` (what ``prompt.block_hashes`` returns) hashes the text itself with
    blake2b. A plain sequence of hashes (one process, as in the routing simulator and the tests)
    uses the block's own hash, which is stable within that process.
    """
    stable = getattr(hashes, "stable_hash", None)
    return stable(block) if stable is not None else hashes[block] & _MASK


def _mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer to a well-spread 64-bit integer."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


@dataclass
class RendezvousRanker:
    """Highest-random-weight hashing: replica ``r``'s weight for key ``k`` is ``mix(k ^ id(r))``.

    Replica ids hash with blake2b (stable across processes; cached, bounded by ``max_ids``), so every
    router ranks the same replicas the same way, and a replica that joins or leaves moves only the
    keys it wins or held (1/n of them), not the rest.
    """

    max_ids: int = 4096
    _ids: dict[str, int] = field(default_factory=dict)

    def replica_hash(self, replica_id: str) -> int:
        found = self._ids.get(replica_id)
        if found is None:
            if len(self._ids) >= self.max_ids:
                self._ids.clear()
            found = self._ids[replica_id] = int.from_bytes(
                hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "big"
            )
        return found

    def weight(self, key: int, replica_id: str) -> int:
        return _mix(key ^ self.replica_hash(replica_id))


@dataclass
class PlacementScorer:
    """The candidate ranked first for the prompt's key is credited with the prompt's own part; the rest 0.

    The home is taken to hold the blocks from the divergence block on (this conversation's or
    document's own part: every router sends this key there, though this router may never have seen
    the earlier turns), and the shared part before it wherever this router's index says. So its credit
    is the prompt's length minus what the index already credits it with, at least the shared part.
    A one-off question after a shared system prompt has a short own part and still goes where the
    system prompt is cached; a long conversation goes home unless the home has ``credit /
    load_penalty_blocks`` more requests in flight. The ranking is over the candidates the filters
    left, so when the load bound drops the home, the next replica in the same ranking is the home
    (consistent hashing with bounded loads): routers agree on the overflow too. A request without a
    key (``PickRequest.home_key`` None) scores 0 everywhere: the index and load decide, as before.
    """

    index: PrefixIndex
    ranker: RendezvousRanker = field(default_factory=RendezvousRanker)
    name: str = "placement"

    def score(self, candidates: Sequence[Candidate], request: PickRequest) -> list[float]:
        out = [0.0] * len(candidates)
        key = request.home_key
        if key is None or not candidates:
            return out
        weight = self.ranker.weight
        weights = [weight(key, c.replica_id) for c in candidates]
        best = weights.index(max(weights))
        hashes = request.hashes
        held = self.index.matched_blocks(candidates[best].replica_id, hashes)
        out[best] = float(len(hashes) - max(held, request.home_block))
        return out


def home(branches: BranchIndex, hashes: Sequence[int]) -> tuple[int | None, int]:
    """The prompt's placement key and its divergence block, or ``(None, 0)`` when placement should not
    decide (the chain is learned either way).

    None when no branch point is known yet (an empty router routes as a lone router would), and for a
    prompt that diverges at its first block: it shares no prefix with a family of others (one-off
    prompts; or tenants' system prompts, which a router's own index places as well as placement does
    with one router, and better where a hot tenant needs several replicas: bench/routing_sim.py
    --routers). A prompt that diverges later shares a prefix with others (a new conversation after a
    shared system prompt, a document after a shared instruction), and its later turns, which any
    router may receive, must find it.
    """
    if not hashes:
        return None, 0
    block = branches.observe(hashes)
    return (stable_key(hashes, block), block) if block > 0 else (None, 0)
