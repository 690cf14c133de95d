"""What enters and leaves the engine core: a request with its prompt token ids and sampling
parameters, and the per-step output of one request (new tokens, their text, and why it finished)."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.engine.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time_s: float


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    text_delta: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", or "error" (the engine failed)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
