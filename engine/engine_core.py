"""The synchronous engine: one ``step()`` schedules, runs one batched forward over the paged
KV cache, samples and turns new tokens into text deltas. It runs on the engine thread only
(``async_engine.py``); nothing here blocks on I/O."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvfleet.engine.artifacts_ready import mark_artifacts_ready
from kvfleet.engine.block_pool import BlockPool, root_hash
from kvfleet.engine.compiled_forward import compile_model
from kvfleet.engine.device import resolve_device, resolve_dtype
from kvfleet.engine.errors import PromptTooLongError
from kvfleet.engine.kv_events import ZmqEventPublisher
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.model import LlamaModel
from kvfleet.engine.model_config import load_model_config
from kvfleet.engine.paged_attention import ForwardBatch, decode_group, prefill_group, slot_table
from kvfleet.engine.runtime_artifacts import load_model
from kvfleet.engine.sampling import SamplingParams, sample
from kvfleet.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.settings import EngineSettings
from kvfleet.engine.tokenizer import IncrementalDetokenizer, ModelTokenizer

log = logging.getLogger(__name__)


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
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(eq=False)
class _Tracked:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""
    sent_chars: int = 0
    pending_tokens: list[int] = field(default_factory=list)


class EngineCore:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: ModelTokenizer,
        settings: EngineSettings,
        model_id: str,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.model_id = model_id
        self.metrics = metrics or EngineMetrics(model_id)
        self.clock = clock
        cfg = model.config
        bs = settings.block_size_tokens
        bytes_per_token = cfg.kv_bytes_per_token // 4 * torch.tensor([], dtype=model.dtype).element_size()
        self.max_model_len = min(
            settings.max_model_len_tokens or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        # Without an explicit block count: the memory budget, but no more than every running
        # sequence at full context could use (a tiny model must not reserve 512 MiB).
        by_memory = settings.kv_cache_memory_bytes // (bytes_per_token * bs)
        by_use = settings.max_num_seqs * -(-self.max_model_len // bs)
        self.num_blocks = settings.num_kv_blocks or max(1, min(by_memory, by_use))
        self.pool = BlockPool(
            self.num_blocks,
            enable_prefix_caching=settings.enable_prefix_caching,
            record_events=settings.kv_events.enabled,
        )
        self.events = ZmqEventPublisher(settings.kv_events) if self.pool.events is not None else None
        if self.events is not None:
            log.info("publishing KV-cache events on %s", self.events.endpoint)
        self.scheduler = Scheduler(
            SchedulerConfig(bs, settings.max_num_seqs, settings.max_num_batched_tokens), self.pool, root_hash(model_id)
        )
        self.k_pools, self.v_pools = model.allocate_kv_pools(self.num_blocks * bs)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self._tracked: dict[str, _Tracked] = {}
        self._seed_rng = torch.Generator().manual_seed(settings.seed)
        self.total_prefill_computed_tokens = 0

    # -- admission -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.settings.block_size_tokens

    def check_lengths(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse what can never be served: a sequence must fit the context and the pool alone."""
        if prompt_tokens < 1:
            raise PromptTooLongError("prompt is empty (it must encode to at least one token)", param="prompt")
        if prompt_tokens + max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {prompt_tokens} "
                f"tokens and max_tokens asks for {max_tokens} more ({prompt_tokens + max_tokens} in total)",
                param="max_tokens" if prompt_tokens < self.max_model_len else "prompt",
            )
        if prompt_tokens + max_tokens > self.capacity_tokens:
            raise PromptTooLongError(
                f"the KV cache holds {self.capacity_tokens} tokens; the prompt has {prompt_tokens} tokens and "
                f"max_tokens asks for {max_tokens} more ({prompt_tokens + max_tokens} in total)",
                param="max_tokens",
            )

    def default_max_tokens(self, prompt_tokens: int) -> int:
        return max(1, min(self.max_model_len, self.capacity_tokens) - prompt_tokens)

    def add_request(self, request: EngineRequest) -> None:
        self.check_lengths(len(request.prompt_token_ids), request.params.max_tokens)
        seq = Sequence(request.request_id, list(request.prompt_token_ids), request.params, request.arrival_time_s)
        generator = None
        if not request.params.greedy:
            seed = request.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng).item())
            generator = torch.Generator(device=self.model.device).manual_seed(seed)
        self._tracked[request.request_id] = _Tracked(seq, IncrementalDetokenizer(self.tokenizer), generator)
        self.scheduler.add(seq)
        self._update_gauges()

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.seq, "abort")
        self.metrics.request_success.labels(self.model_id, "abort").inc()
        self._update_gauges()
        return self._output(tracked, "", finished=True, reason="abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_requests(self) -> int:
        return len(self._tracked)

    # -- the step --------------------------------------------------------------------------
    def _build_batch(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ScheduledChunk]]:
        device = self.model.device
        bs = self.settings.block_size_tokens
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        slots = slot_table([c.seq.block_table for c in ordered], bs)
        token_ids: list[int] = []
        positions: list[int] = []
        slot_rows: list[torch.Tensor] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        groups = []
        for i, c in enumerate(ordered):
            row = len(token_ids)
            token_ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            positions.extend(range(c.start, c.start + c.num_tokens))
            slot_rows.append(slots[i, c.start : c.start + c.num_tokens])
            if c.samples:
                logits_rows.append(row + c.num_tokens - 1)
                sampled.append(c)
            if c.num_tokens > 1:
                groups.append(prefill_group(slice(row, row + c.num_tokens), slots[i], c.start, device))
        if decodes:
            ctx = [c.start + 1 for c in decodes]
            groups.insert(0, decode_group(slice(0, len(decodes)), slots[: len(decodes)], ctx, device))
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.long).to(device),
            positions=torch.tensor(positions, dtype=torch.long).to(device),
            slot_mapping=torch.cat(slot_rows).to(device),
            groups=tuple(groups),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long).to(device),
        )
        return batch, sampled

    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            self._publish_events()

    def _publish_events(self) -> None:
        events = self.pool.events
        if events and self.events is not None:
            self.events.publish(events[:])
            events.clear()

    def close(self) -> None:
        """Release what outlives the step loop (the event socket)."""
        if self.events is not None:
            self.events.close()
            self.events = None

    def _step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        m, name = self.metrics, self.model_id
        if sched.preempted:
            m.num_preemptions.labels(name).inc(len(sched.preempted))
            for p in sched.preempted:
                log.info("preempted %s: %s", p.request_id, p.reason)
        m.prefix_cache_queries.labels(name).inc(sched.prefix_queries_tokens)
        m.prefix_cache_hits.labels(name).inc(sched.prefix_hits_tokens)
        if not sched.chunks:
            self._update_gauges()
            return []
        batch, sampled = self._build_batch(sched.chunks)
        logits = self.model.forward(batch, self.k_pools, self.v_pools)
        self.scheduler.after_step(sched.chunks)
        computed_prompt = sum(
            max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start) for c in sched.chunks
        )
        self.total_prefill_computed_tokens += computed_prompt
        m.prefill_computed_tokens.labels(name).inc(computed_prompt)
        outputs: list[RequestOutput] = []
        if sampled:
            trackeds = [self._tracked[c.seq.request_id] for c in sampled]
            new_tokens = sample(logits, [c.seq.params for c in sampled], [t.generator for t in trackeds])
            now = self.clock()
            for tracked, token in zip(trackeds, new_tokens, strict=True):
                outputs.append(self._append_token(tracked, token, now))
        self._update_gauges()
        return outputs

    def _append_token(self, t: _Tracked, token: int, now: float) -> RequestOutput:
        seq, p = t.seq, t.seq.params
        m, name = self.metrics, self.model_id
        if not seq.prompt_counted:
            seq.prompt_counted = True
            m.prompt_tokens.labels(name).inc(seq.num_prompt_tokens)
        if seq.first_token_time_s is None:
            seq.first_token_time_s = now
            m.time_to_first_token.labels(name).observe(max(0.0, now - seq.arrival_time_s))
        elif seq.last_token_time_s is not None:
            m.inter_token_latency.labels(name).observe(max(0.0, now - seq.last_token_time_s))
        seq.last_token_time_s = now
        seq.token_ids.append(token)
        m.generation_tokens.labels(name).inc()
        reason: str | None = None
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        else:
            t.text += t.detok.add(token)
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            t.text += t.detok.flush()
        if p.stop:
            # Search only where a new match can start: the last delta plus a stop string's length.
            window = max(len(s) for s in p.stop)
            search_from = max(0, t.sent_chars - window)
            hits = [i for i in (t.text.find(s, search_from) for s in p.stop) if i >= 0]
            if hits:
                t.text = t.text[: min(hits)]
                reason = "stop"
        t.pending_tokens.append(token)
        if reason is None:
            return self._output(t, self._emit(t, holdback=max((len(s) for s in p.stop), default=1) - 1), False, None)
        self.scheduler.finish(seq, reason)
        self._tracked.pop(seq.request_id, None)
        m.request_success.labels(name, reason).inc()
        m.e2e_request_latency.labels(name).observe(max(0.0, now - seq.arrival_time_s))
        return self._output(t, self._emit(t, holdback=0), True, reason)

    @staticmethod
    def _emit(t: _Tracked, holdback: int) -> str:
        """Text not yet sent, keeping back what could still become the start of a stop string."""
        upto = max(t.sent_chars, len(t.text) - holdback)
        delta = t.text[t.sent_chars : upto]
        t.sent_chars = upto
        return delta

    def _output(self, t: _Tracked, delta: str, finished: bool, reason: str | None) -> RequestOutput:
        tokens = tuple(t.pending_tokens)
        t.pending_tokens.clear()
        return RequestOutput(
            request_id=t.seq.request_id,
            text_delta=delta,
            new_token_ids=tokens,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=t.seq.num_prompt_tokens,
            completion_tokens=t.seq.num_output_tokens,
            cached_tokens=t.seq.num_cached_prompt_tokens,
        )

    def _update_gauges(self) -> None:
        m, name = self.metrics, self.model_id
        m.num_requests_running.labels(name).set(len(self.scheduler.running))
        m.num_requests_waiting.labels(name).set(len(self.scheduler.waiting))
        m.kv_cache_usage_perc.labels(name).set(self.pool.usage())


def load_engine_core(
    model_dir: Path,
    settings: EngineSettings,
    model_id: str,
    metrics: EngineMetrics | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> EngineCore:
    """Load weights and tokenizer from a Hugging Face folder onto the chosen device."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    config = load_model_config(model_dir)
    device = resolve_device(settings.device, torch.cuda.is_available())
    dtype = resolve_dtype(settings.dtype, device, config.torch_dtype)
    tokenizer = ModelTokenizer.from_dir(model_dir, config.eos_token_ids)
    runtime_dir = settings.artifacts_dir if settings.runtime_weights_artifact else None
    model, saving = load_model(config, model_dir, device, dtype, runtime_dir)
    log.info("loaded %s on %s as %s", model_dir, device, dtype)
    compiled = None
    if settings.compile_enabled(device.type):
        compiled = compile_model(model, model_dir, settings)
    if settings.artifacts_dir is not None:
        mark_artifacts_ready(settings.artifacts_dir, compiled, saving)
    return EngineCore(model, tokenizer, settings, model_id, metrics, clock)
