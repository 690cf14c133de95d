"""The engine core (vLLM v1's ``EngineCore``): admits requests and runs ``step()``, wiring four
parts that each do one job --

- ``Scheduler``: which sequences run this step, and how many tokens each;
- ``KVCacheManager``: their KV blocks and the prefix cache (the scheduler's only way to the pool);
- ``ModelRunner``: the batch tensors, one forward pass, sampling;
- ``OutputProcessor``: detokenization, stop conditions, the text each output may carry;

plus ``EngineMetrics`` (what a step records) and the KV-event publisher. It runs on the engine
thread only (``async_engine.py``); nothing here blocks on I/O. ``load_engine_core`` builds one
from a model folder.

Overlapped scheduling (``EngineSettings.async_scheduling``, on by default on CUDA; vLLM's async
scheduling, SGLang's overlap scheduler): ``step()`` schedules and launches step N+1 *before* it
waits for step N's sampled ids, so the host's bookkeeping of step N (detokenizing, stop
conditions, outputs) and its building of step N+2 run while the device computes step N+1. A
sequence sampled in step N enters step N+1 with a placeholder token that the device fills from
step N's ids. A sequence that step N finished (EOS, a stop string) was already in step N+1: that
speculative token is dropped, never emitted; one whose step-N token is its ``max_tokens``-th is
not scheduled again. Outputs are the same tokens as without overlap; each ``step()`` returns the
previous launch's outputs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvfleet.engine.artifacts_ready import mark_artifacts_ready
from kvfleet.engine.block_pool import BlockPool, root_hash
from kvfleet.engine.compiled_forward import compile_model
from kvfleet.engine.device import resolve_device, resolve_dtype
from kvfleet.engine.errors import ModelLoadError, PromptTooLongError
from kvfleet.engine.kv_cache_manager import KVCacheManager, pool_size_blocks
from kvfleet.engine.kv_events import ZmqEventPublisher
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.model import LlamaModel
from kvfleet.engine.model_config import load_model_config
from kvfleet.engine.model_runner import LaunchedStep, ModelRunner, kv_bytes_per_token
from kvfleet.engine.output_processor import OutputProcessor
from kvfleet.engine.paged_decode_triton import available as paged_decode_available
from kvfleet.engine.request import EngineRequest, RequestOutput
from kvfleet.engine.runtime_artifacts import load_model
from kvfleet.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.settings import EngineSettings
from kvfleet.engine.tokenizer import ModelTokenizer
from kvfleet.weight_stream import StreamError, StreamReader

log = logging.getLogger(__name__)


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
        self.tokenizer = tokenizer
        self.settings = settings
        self.model_id = model_id
        self.metrics = metrics or EngineMetrics(model_id)
        self.clock = clock
        cfg = model.config
        bs = settings.block_size_tokens
        self.overlap = settings.async_scheduling_enabled(model.device.type)
        self._in_flight: LaunchedStep | None = None  # launched, its ids not yet collected (overlap)
        self.max_model_len = min(
            settings.max_model_len_tokens or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.num_blocks = pool_size_blocks(
            num_kv_blocks=settings.num_kv_blocks,
            kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            kv_bytes_per_token=kv_bytes_per_token(model),
            block_size_tokens=bs,
            max_num_seqs=settings.max_num_seqs,
            max_model_len_tokens=self.max_model_len,
        )
        pool = BlockPool(
            self.num_blocks,
            enable_prefix_caching=settings.enable_prefix_caching,
            record_events=settings.kv_events.enabled,
        )
        self.events = ZmqEventPublisher(settings.kv_events) if pool.events is not None else None
        if self.events is not None:
            log.info("publishing KV-cache events on %s", self.events.endpoint)
        self.kv_cache = KVCacheManager(pool, bs, root_hash(model_id))
        self.scheduler = Scheduler(
            SchedulerConfig(settings.max_num_seqs, settings.max_num_batched_tokens), self.kv_cache
        )
        model.decode_attention_triton = settings.decode_attention_triton(model.device.type, paged_decode_available())
        self.runner = ModelRunner(
            model,
            self.num_blocks,
            bs,
            settings.seed,
            max_num_seqs=settings.max_num_seqs,
            max_model_len_tokens=self.max_model_len,
            cuda_graphs=settings.cuda_graphs,
            overlap=self.overlap,
        )
        eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer, eos_ids, self.max_model_len)
        self._requests: dict[str, Sequence] = {}  # admitted and not finished
        self.total_prefill_computed_tokens = 0

    @property
    def model(self) -> LlamaModel:
        return self.runner.model

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
        self.runner.add_request(seq.request_id, seq.params)
        self.outputs.add_request(seq)
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self._update_gauges()

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        self.metrics.record_finish("abort", None)
        self._update_gauges()
        return self.outputs.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def step_in_flight(self) -> bool:
        """A step is launched whose sampled ids the next ``step()`` collects (overlap only)."""
        return self._in_flight is not None

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the chunks through the model, turn each sampled token into an output.

        Overlapped, the outputs are those of the step launched by the previous call; this call's
        launch is collected by the next one (``has_work`` stays true until it is)."""
        try:
            sched = self.scheduler.schedule()
            self.metrics.record_schedule(sched)
            for p in sched.preempted:
                log.info("preempted %s: %s", p.request_id, p.reason)
            launched = self._launch(sched) if sched.chunks else None
            if self.overlap:
                done, self._in_flight = self._in_flight, launched
            else:
                done = launched
            outputs = self._collect(done) if done is not None else []
            if self._in_flight is not None:
                self._add_placeholders(self._in_flight)
            self._update_gauges()
            return outputs
        finally:
            self._publish_events()

    def _launch(self, sched: SchedulerOutput) -> LaunchedStep | None:
        launched = self.runner.launch(sched.chunks)
        self.scheduler.after_step(sched.chunks)
        computed_prompt_tokens = sched.computed_prompt_tokens
        self.total_prefill_computed_tokens += computed_prompt_tokens
        self.metrics.record_prefill(computed_prompt_tokens)
        return launched

    def _collect(self, launched: LaunchedStep) -> list[RequestOutput]:
        sampled = self.runner.collect(launched)
        now = self.clock()
        outputs = []
        for seq, token in sampled:
            if seq.finish_reason is not None:
                continue  # finished (or aborted) while this step ran: its token was speculative
            if seq.num_pending_tokens:
                seq.token_ids[-1] = token
                seq.num_pending_tokens = 0
                self.scheduler.token_known(seq)
            else:
                seq.token_ids.append(token)
            outputs.append(self._append_token(seq, token, now))
        return outputs

    @staticmethod
    def _add_placeholders(launched: LaunchedStep) -> None:
        """Each sequence sampled by the step in flight gets its token as a placeholder naming its row,
        so the next step can be scheduled (and its input filled on the device) before the id is known."""
        for row, seq in enumerate(launched.seqs):
            if seq.finish_reason is None:
                seq.token_ids.append(-(row + 1))
                seq.num_pending_tokens = 1

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        self.metrics.record_token(seq, now)
        output = self.outputs.process_token(seq, token)
        if output.finish_reason is not None:
            self._finish(seq, output.finish_reason)
            self.metrics.record_finish(output.finish_reason, now - seq.arrival_time_s)
        return output

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.remove_request(seq.request_id)
        del self._requests[seq.request_id]

    def _update_gauges(self) -> None:
        s = self.scheduler
        self.metrics.set_load(running=len(s.running), waiting=len(s.waiting), kv_cache_usage=self.kv_cache.usage())

    def _publish_events(self) -> None:
        if self.events is not None:
            events = self.kv_cache.take_events()
            if events:
                self.events.publish(events)

    def close(self) -> None:
        """Release what outlives the step loop (the event socket)."""
        if self.events is not None:
            self.events.close()
            self.events = None


def load_engine_core(
    model_dir: Path,
    settings: EngineSettings,
    model_id: str,
    metrics: EngineMetrics | None = None,
    clock: Callable[[], float] = time.monotonic,
    stopping: threading.Event | None = None,
) -> EngineCore:
    """Load weights and tokenizer from a Hugging Face folder onto the chosen device.

    With ``settings.weights_arrival_timeout_s`` the folder is one the weight pull is still filling
    (kvfleet.weight_stream): the small files are waited for first, then each shard is loaded as it
    lands, verified, while later ones still download; a file that does not come in time fails the
    load naming it, and ``stopping`` (set when the engine is told to stop) ends a wait at once."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    arrivals = None
    runtime_dir = settings.artifacts_dir if settings.runtime_weights_artifact else None
    if settings.weights_arrival_timeout_s is not None:
        stop = stopping or threading.Event()
        arrivals = StreamReader(model_dir, settings.weights_arrival_timeout_s, stopped=stop.is_set)
        try:
            # Runtime artifacts are keyed by every weight file's identity: wait for all of them then.
            arrivals.wait_for_all(exclude_suffix=None if runtime_dir is not None else ".safetensors")
        except StreamError as e:
            raise ModelLoadError(str(e)) from e
    config = load_model_config(model_dir)
    device = resolve_device(settings.device, torch.cuda.is_available())
    dtype = resolve_dtype(settings.dtype, device, config.torch_dtype)
    tokenizer = ModelTokenizer.from_dir(model_dir, config.eos_token_ids)
    model, saving = load_model(config, model_dir, device, dtype, runtime_dir, arrivals)
    log.info("loaded %s on %s as %s", model_dir, device, dtype)
    compiled = None
    if settings.compile_enabled(device.type):
        compiled = compile_model(model, model_dir, settings)
    if settings.artifacts_dir is not None:
        mark_artifacts_ready(settings.artifacts_dir, compiled, saving)
    return EngineCore(model, tokenizer, settings, model_id, metrics, clock)
