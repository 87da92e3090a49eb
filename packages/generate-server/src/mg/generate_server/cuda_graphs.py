"""CUDA graphs for decode steps (`mg-serve --enable-cuda-graph`).

At small batch a decode step launches hundreds of small kernels whose launch
time exceeds their run time on a GPU. A CUDA graph records a step's kernels
once and replays them with one launch. A graph replays fixed shapes and fixed
memory, so a decode-only step (every sequence one new token) is padded to the
next batch-size bucket (1, 2, 4, 8, ... up to `--inference-max-requests`) and
its inputs (token ids, positions, KV-cache slots, block tables, the attention
mask over `max_length` positions) are copied into that bucket's static
tensors (`PagedKVCache.bind_static`); padding rows use a scratch block no
sequence holds. Steps with prompt chunks or draft tokens run eagerly as
before; so does everything where a capture fails (the log says so once).

`capture=False` runs the same static path without recording a graph: the
CPU tests check with it that padded static steps give the eager tokens.
`compiled_decode.CompiledDecodeRunner` (`--enable-torch-compile`) runs it
compiled by torch.compile on a CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mg.core.models import GPTModel
from mg.core.models.paged_kv_cache import PagedSegment
from mg.generate_server.runner import ModelRunner

log = logging.getLogger("mg.generate_server")


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch` itself."""
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch]


@dataclass
class _StaticStep:
    ids: Tensor
    positions: Tensor
    logits: Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class CudaGraphRunner(ModelRunner):
    """A `ModelRunner` whose decode-only steps replay a CUDA graph per batch-size bucket."""

    def __init__(
        self,
        model: GPTModel,
        num_slots: int,
        max_length: int,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        capture: bool = True,
    ) -> None:
        if not isinstance(model, GPTModel) or model.config.num_moe_experts:
            raise ValueError(
                "CUDA graphs replay fixed shapes: dense GPT-family models only (MoE routing and "
                "Mamba states vary per step)"
            )
        if num_blocks is None:
            num_blocks = num_slots * -(-max_length // block_size)
        super().__init__(model, num_slots, max_length, num_blocks + 1, block_size, kv_cache_dtype)
        self.num_blocks = num_blocks
        """Blocks the engine may hand out; the pool's last one is the padding rows' scratch."""
        self.pad_block = num_blocks
        self.width = -(-max_length // block_size)
        self.buckets = batch_buckets(num_slots)
        self.capture = capture
        self.graph_steps = 0
        """Decode steps run through the static path (replayed graphs when capturing)."""
        self._steps: dict[int, _StaticStep] = {}
        self._pool = None
        self._eager_only = False

    def _forward(
        self,
        segments: Sequence[PagedSegment],
        input_ids: Sequence[int],
        positions: Sequence[int],
        logit_rows: Sequence[int],
        image_rows: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        n = len(segments)
        decode_only = all(s.query_length == 1 for s in segments)
        static = decode_only and image_rows is None and list(logit_rows) == list(range(n))
        if self._eager_only or not static:
            return super()._forward(segments, input_ids, positions, logit_rows, image_rows)
        rows = next(b for b in self.buckets if b >= n)
        step = self._steps.get(rows)
        if step is None:
            zeros = torch.zeros((1, rows), dtype=torch.long, device=self.device)
            step = self._steps[rows] = _StaticStep(zeros, zeros.clone())
        self.cache.bind_static(segments, rows, self._static_width(segments), self.pad_block)
        padding = [0] * (rows - n)
        step.ids.copy_(torch.tensor([[*input_ids, *padding]]), non_blocking=True)
        step.positions.copy_(torch.tensor([[*positions, *padding]]), non_blocking=True)
        if not self._execute(step):
            return super()._forward(segments, input_ids, positions, logit_rows)
        self.graph_steps += 1
        return step.logits[:n].float().cpu()

    def _static_width(self, segments: Sequence[PagedSegment]) -> int:
        """Blocks every row's attention covers: all of `max_length` (a graph's fixed shape)."""
        return self.width

    def _execute(self, step: _StaticStep) -> bool:
        """Run the bound static step into `step.logits`; False: run this step eagerly."""
        if not self.capture:
            self._run(step)
        elif step.graph is None and not self._record(step):
            return False
        else:
            step.graph.replay()
        return True

    @torch.inference_mode()
    def _run(self, step: _StaticStep) -> None:
        """One padded decode step over the static tensors; logits into `step.logits`."""
        logits = self._logits(step.ids, step.positions)
        if step.logits is None:
            step.logits = logits.clone()
        else:
            step.logits.copy_(logits)

    def _record(self, step: _StaticStep) -> bool:
        """Warm up on a side stream, capture the step into a graph, replay it once (the
        capture itself computes nothing). False, and eager from now on, if it fails."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._run(step)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._run(step)
            self._pool = graph.pool()
            step.graph = graph
            graph.replay()
            log.info("CUDA graph captured for decode steps of %d sequences", step.ids.shape[1])
            return True
        except Exception as err:  # noqa: BLE001 - any capture failure: serve eagerly
            log.warning("CUDA graph capture failed (%s); decode steps run eagerly", err)
            self._eager_only = True
            return False
