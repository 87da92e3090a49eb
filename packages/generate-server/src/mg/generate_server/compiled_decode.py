"""Compiled decode steps on a CPU (`mg-serve --enable-torch-compile`).

On a CPU a small model's decode step is mostly per-op overhead: 30 layers of
dozens of small ops (norms, RoPE, residual adds, the SwiGLU product), each a
Python call and a pass over memory. `torch.compile` (inductor) fuses them into
a few C++ kernels per layer, and with inductor's freezing the weights are
packed once for oneDNN instead of at every matmul. This is the CPU counterpart
of `--enable-cuda-graph` and shares its static path (`CudaGraphRunner`): a
decode-only step is padded to the next batch-size bucket and its inputs are
copied into that bucket's fixed tensors, so each bucket is one graph of static
shapes, compiled at start-up (`compile_buckets`, before the server listens) and
never again while serving.

The paged attention stays out of the graph, as one opaque op per layer
(`mg_serve::paged_attend`, the cache's own eager `attend`): it gathers only
the blocks the step's sequences use (the graph's shapes do not depend on their
lengths), and the KV pool, which the op writes in place, is never a graph
input that the compiler could copy. Steps with prompt chunks or draft tokens
run eagerly; so does every step, logged once, when no C++ compiler is found or
compiling fails.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor
from torch._inductor.cpp_builder import get_cpp_compiler

from mg.core.models import GPTModel
from mg.core.models.paged_attention_cpu import quiet_cpp_extension
from mg.core.models.paged_kv_cache import PagedKVCache, PagedSegment
from mg.generate_server.cuda_graphs import CudaGraphRunner, _StaticStep

log = logging.getLogger("mg.generate_server")

_CACHES: weakref.WeakValueDictionary[int, PagedKVCache] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


# Defined through torch.library.Library rather than the `custom_op` decorator: the
# decorator's per-call checks cost ~0.3 ms a call here, 30 calls a step.
_LIBRARY = torch.library.Library("mg_serve", "DEF")
_LIBRARY.define(
    "paged_attend(Tensor query, Tensor key, Tensor value, int layer, int cache) -> Tensor"
)


def paged_attend(query: Tensor, key: Tensor, value: Tensor, layer: int, cache: int) -> Tensor:
    """`PagedKVCache.attend` of the registered cache `cache`, opaque to the compiler. The
    pool it writes is reached through the registry, not an argument: the compiled graph
    orders the layers' calls by their data (layer i+1's query needs layer i's context)."""
    return _CACHES[cache].attend(layer, query, key, value)


_LIBRARY.impl("paged_attend", paged_attend, "CompositeExplicitAutograd")


@torch.library.register_fake("mg_serve::paged_attend")
def _(query: Tensor, key: Tensor, value: Tensor, layer: int, cache: int) -> Tensor:
    b, t, heads, d = query.shape
    return query.new_empty(b, t, heads * d)


class _OpaqueAttention:
    """What the compiled model's layers see as their inference cache."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.key = next(_KEYS)
        _CACHES[self.key] = cache

    def attend(self, layer_index: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return torch.ops.mg_serve.paged_attend(query, key, value, layer_index, self.key)


def cpp_compiler_missing() -> str | None:
    """Why inductor cannot build CPU kernels here (no C++ compiler), or None."""
    try:
        get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - whatever inductor says
        return f"no C++ compiler for torch.compile's CPU kernels ({err}); set CXX or install g++"
    return None


class CompiledDecodeRunner(CudaGraphRunner):
    """A `ModelRunner` whose decode-only steps run a torch.compile'd graph per batch-size
    bucket (`compile_buckets` compiles them all)."""

    def __init__(
        self,
        model: GPTModel,
        num_slots: int,
        max_length: int,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
    ) -> None:
        super().__init__(
            model, num_slots, max_length, num_blocks, block_size, kv_cache_dtype, capture=False
        )
        self._attention = _OpaqueAttention(self.cache)
        self._compiled = None
        self._eager_only = True  # until compile_buckets succeeds
        self.compile_seconds: float | None = None
        self.status = "eager (not compiled)"
        """What runs the decode steps, for the start-up line."""

    def compile_buckets(self, backend: str = "inductor") -> bool:
        """Compile and run the decode step of every bucket once (padding rows only, in the
        scratch block). False, with one log line, and eager steps from then on, if the
        compiler is missing or any bucket fails. `backend` "eager" traces without inductor
        (the tests' quick check of the graph)."""
        result: list[bool] = []

        def compile_with_the_engines_threads() -> None:
            # the graphs are guarded on the intra-op thread count and their kernels sized
            # for it: compile in a thread with the engine thread's count (which the
            # thread building the runner may not have; see GenerationEngine._loop)
            torch.set_num_threads(self.num_threads)
            result.append(self._compile_buckets(backend))

        with quiet_cpp_extension():
            worker = threading.Thread(target=compile_with_the_engines_threads)
            worker.start()
            worker.join()
        return bool(result and result[0])

    def _compile_buckets(self, backend: str) -> bool:
        missing = cpp_compiler_missing()
        if missing is not None:
            return self._give_up(missing)
        started = time.monotonic()
        self._compiled = torch.compile(self._decode, backend=backend, fullgraph=True, dynamic=False)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, len(self.buckets) + 1)
        self._eager_only = False
        try:
            # freezing: the weights are constants, packed for oneDNN once (dynamo reads the
            # flag while tracing, inductor while compiling: both happen in these calls)
            with torch._inductor.config.patch(freezing=True), torch.inference_mode():
                for rows in self.buckets:
                    step = self._static_step(rows)
                    self.cache.bind_static([], rows, 1, self.pad_block)
                    step.logits = self._compiled(step.ids, step.positions)
        except Exception as err:  # noqa: BLE001 - any compile failure: serve eagerly
            return self._give_up(f"torch.compile failed: {type(err).__name__}: {err}")
        self.compile_seconds = time.monotonic() - started
        sizes = ", ".join(map(str, self.buckets))
        self.status = f"decode compiled for {sizes} sequences in {self.compile_seconds:.0f} s"
        log.info(
            "decode steps compiled (torch.compile, inductor) for batches of %s sequences in %.1f s",
            sizes,
            self.compile_seconds,
        )
        return True

    def _give_up(self, why: str) -> bool:
        log.warning("%s; decode steps run eagerly", why)
        self._eager_only = True
        self._compiled = None
        self.status = "decode eager: " + why.split(";")[0].split(" (")[0]
        return False

    def _decode(self, ids: Tensor, positions: Tensor) -> Tensor:
        """The traced step: the model over the bound static inputs, attention opaque."""
        return self._logits(ids, positions, cache=self._attention)

    def _static_step(self, rows: int) -> _StaticStep:
        step = self._steps.get(rows)
        if step is None:
            zeros = torch.zeros((1, rows), dtype=torch.long, device=self.device)
            step = self._steps[rows] = _StaticStep(zeros, zeros.clone())
        return step

    def _static_width(self, segments: Sequence[PagedSegment]) -> int:
        """Only the blocks the longest sequence uses: attention runs outside the graph."""
        return max(-(-s.context_length // self.block_size) for s in segments)

    def _execute(self, step: _StaticStep) -> bool:
        """The bucket's compiled graph; a recompilation (a guard that no longer holds) is
        refused, so no request pays a compile: eager from then on, logged once.

        Only the guards that tell the buckets apart are evaluated (dynamo's
        `skip_guard_eval_unsafe`): every bucket was compiled at start-up, the inputs
        are the bucket's own static tensors and the weights are frozen constants, so
        nothing the other guards check can change, and checking them all (every
        parameter of the model) took ~1 ms a step."""
        try:
            with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
                step.logits = self._compiled(step.ids, step.positions)
        except Exception as err:  # noqa: BLE001 - serve eagerly rather than fail requests
            self._give_up(f"the compiled decode step failed: {type(err).__name__}: {err}")
            return False
        return True
