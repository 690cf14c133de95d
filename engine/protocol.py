"""OpenAI request bodies (validated with pydantic, errors named by field) and response shapes."""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvfleet.engine.errors import InvalidRequestError, RequestError
from kvfleet.engine.sampling import REPORT_MODES, SamplingParams
from kvfleet.openai_shape import error_body

MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's extension: the usage so far in every chunk too (the router counts a migrated stream's
    # tokens from it: one chunk may carry several tokens).
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    n: int = 1
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    # vLLM's extra sampling args; the reference engine reads kv_cache_report_mode and ignores the rest.
    vllm_xargs: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported by the reference engine")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported by the reference engine (only 0)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("vllm_xargs")
    @classmethod
    def _xargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        mode = (value or {}).get("kv_cache_report_mode", REPORT_MODES[0])
        if mode not in REPORT_MODES:
            raise ValueError(f"kv_cache_report_mode must be 'incremental' or 'full', got {mode!r}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: Any) -> Any:
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported by the reference engine")
        return value

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            kv_cache_report_mode=(self.vllm_xargs or {}).get("kv_cache_report_mode", REPORT_MODES[0]),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's rule, only together with ``include_usage``."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported by the reference engine")
        return value

    def prompt_input(self) -> str | list[int]:
        """One prompt: text or token ids. Batched prompts are refused (use one request each)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [int(x) for x in p]  # type: ignore[arg-type]
        if len(p) == 1:
            only = p[0]
            return only if isinstance(only, str) else [int(x) for x in only]  # type: ignore[union-attr]
        raise InvalidRequestError(
            "prompt: batched prompts are not supported; send one request per prompt", param="prompt"
        )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    # Continue the final (assistant) message instead of starting a new one, as vLLM does: how the
    # router resumes a stream on another replica.
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _continuation(self) -> ChatCompletionRequest:
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    def rendered_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


T = TypeVar("T", bound=BaseModel)


def parse_request(model: type[T], body: Any) -> T:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = first.get("loc", ())
        field = str(loc[0]) if loc else None
        where = ".".join(str(x) for x in loc) or "body"
        raise InvalidRequestError(f"{where}: {first.get('msg', 'invalid value')}", param=field) from e


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def request_error_body(e: RequestError) -> dict[str, Any]:
    return error_body(e.message, e.error_type, param=e.param, code=e.code)


def now_s() -> int:
    return int(time.time())
