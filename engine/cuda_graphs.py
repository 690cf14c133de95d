"""Uniform steps captured as CUDA graphs, one per bucket, and replayed (vLLM's CUDA-graph mode).

A uniform step's forward (``LlamaModel.forward_uniform``) has fixed shapes per bucket and reads
nothing back to the host, so it is captured once, the first time its bucket is met, and every
later step of that bucket is one input copy plus one ``graph.replay()``: the ~30 kernels per
layer are launched by the driver from the captured graph instead of from Python. All graphs share
one memory pool; their logits stay valid until the next replay (the runner samples right after).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvfleet.engine.block_table_attention import UniformBatch, flat_len
from kvfleet.engine.model import LlamaModel
from kvfleet.engine.step_shapes import StepShape

log = logging.getLogger(__name__)

# Graphs kept at most: batch buckets x query buckets x width buckets met (a few dozen in
# practice); past this bound a bucket runs uncaptured rather than holding more memory.
MAX_GRAPHS = 128


@dataclass
class _Captured:
    inputs: torch.Tensor  # the packed-input buffer the graph reads
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # written by each replay


class UniformStepGraphs:
    def __init__(
        self,
        model: LlamaModel,
        k_pools: torch.Tensor,
        v_pools: torch.Tensor,
        block_size: int,
        max_graphs: int,
        sampled: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        # The previous step's sampled ids on the device (overlapped scheduling): a graph reads its
        # placeholder tokens from this fixed buffer, so the replay never waits for the host.
        self.sampled = sampled
        self.k_pools, self.v_pools = k_pools, v_pools
        self.block_size = block_size
        self.max_graphs = max_graphs
        self._graphs: dict[StepShape, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._uncaptured_inputs = torch.empty(0, dtype=torch.long, device=model.device)
        # Set when a capture fails: the engine then serves every step uncaptured (slower, correct).
        self.disabled_reason: str | None = None

    @property
    def shapes(self) -> list[StepShape]:
        return sorted(self._graphs)

    def run(self, shape: StepShape, host_inputs: torch.Tensor) -> torch.Tensor:
        """Logits of the step whose packed inputs are ``host_inputs`` (pinned; copied without
        blocking the host)."""
        captured = self._graphs.get(shape)
        if captured is None:
            if len(self._graphs) >= self.max_graphs or self.disabled_reason is not None:
                return self._run_uncaptured(shape, host_inputs)
            try:
                captured = self._capture(shape, host_inputs)
            except RuntimeError as e:
                # Something in the forward cannot be captured on this build (a kernel that syncs,
                # say): serve on without graphs rather than fail requests, and say why.
                self.disabled_reason = f"capturing {shape} failed: {e}"
                log.error("CUDA graphs disabled: %s", self.disabled_reason)
                torch.cuda.synchronize(self.model.device)
                return self._run_uncaptured(shape, host_inputs)
        captured.inputs.copy_(host_inputs, non_blocking=True)
        captured.graph.replay()
        return captured.logits

    def _run_uncaptured(self, shape: StepShape, host_inputs: torch.Tensor) -> torch.Tensor:
        if self._uncaptured_inputs.numel() < host_inputs.numel():
            self._uncaptured_inputs = torch.empty_like(host_inputs, device=self.model.device)
        inputs = self._uncaptured_inputs[: host_inputs.numel()]
        inputs.copy_(host_inputs, non_blocking=True)
        return self._forward(shape, inputs)

    def _forward(self, shape: StepShape, inputs: torch.Tensor) -> torch.Tensor:
        batch = UniformBatch.from_flat(shape, inputs, self.sampled)
        return self.model.forward_uniform(batch, self.k_pools, self.v_pools, self.block_size)

    def _capture(self, shape: StepShape, host_inputs: torch.Tensor) -> _Captured:
        inputs = torch.empty(flat_len(shape), dtype=torch.long, device=self.model.device)
        inputs.copy_(host_inputs)
        # Warm up on a side stream first (torch's capture recipe): cuBLAS handles, any lazy
        # compile of this size and the allocator's first blocks stay out of the graph. The warm-up
        # runs this very step, so the K/V it writes are the ones the replay writes again.
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            self._forward(shape, inputs)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(shape, inputs)
        log.info("captured a CUDA graph for %s (%d graphs)", shape, len(self._graphs) + 1)
        captured = _Captured(inputs, graph, logits)
        self._graphs[shape] = captured
        return captured
