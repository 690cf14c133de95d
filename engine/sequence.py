"""A request's state inside the engine: its tokens, how many are in the KV cache, its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvfleet.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time_s: float
    token_ids: list[int] = field(default_factory=list)  # prompt then generated
    # Trailing entries of token_ids sampled on the device by a step still in flight (overlapped
    # scheduling, engine_core.py): placeholders ``-(row + 1)`` naming the row of that step's sampled
    # ids, until the step's ids reach the host. 0 or 1.
    num_pending_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks of token_ids
    num_registered_blocks: int = 0  # leading blocks already findable in the prefix cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None
    finish_reason: str | None = None
    prompt_counted: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (all but the pending placeholders)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) : self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens the host has (pending placeholders not counted)."""
        return self.num_known_tokens - len(self.prompt_token_ids)
