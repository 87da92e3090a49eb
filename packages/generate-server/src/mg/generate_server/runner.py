"""The model side of generation: one packed forward over a paged KV cache.

The engine decides *what* to run (which tokens of which sequences, at which
positions, in which cache blocks); the runner runs it. A step is one row of
tokens, every sequence's new tokens end to end (`PagedSegment`s say where),
and only the rows whose logits are needed go through the output layer (the
last token of each sequence that samples; every prompt token when prompt
log-probabilities are asked for).

The cache follows the model: a GPTModel (dense or MoE) keeps keys/values in
the paged pool; a MambaModel (Mamba-2 or hybrid) keeps each running sequence's
recurrent state in a slot (`PagedSegment.slot`) and its attention layers'
keys/values in the pool (`PagedHybridCache`). An MoE model is routed dropless
(`moe_routing`). `tensor_parallel.TensorParallelRunner` is
the runner for a TP-sharded model: it broadcasts each step from rank 0 so that
every rank runs the same forward on its shard of the heads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from mg.core.models import GPTModel
from mg.core.models.attention_backend import serving_kernels
from mg.core.models.mamba import MambaModel, PagedHybridCache
from mg.core.models.paged_kv_cache import GATHERED, PagedKVCache, PagedSegment
from mg.core.models.paged_latent_cache import PagedLatentCache
from mg.generate_server import cpu_isa
from mg.generate_server.fused_decode import FusedDecode, fused_decode_unsupported
from mg.generate_server.moe_routing import route_dropless
from mg.generate_server.vector_decode import VectorDecode, vector_decode_unsupported

log = logging.getLogger("mg.generate_server")

DEFAULT_BLOCK_SIZE = 16


class ModelRunner:
    """A GPTModel or MambaModel and the paged cache it decodes with.

    `num_slots` is how many sequences run at once; `max_length` the positions
    one sequence may use. The pool holds `num_blocks` blocks of `block_size`
    positions (default: enough for `num_slots` sequences of `max_length`; on the
    CPU only the blocks ever written take memory).
    """

    def __init__(
        self,
        model: GPTModel | MambaModel,
        num_slots: int,
        max_length: int,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model.eval()
        self.num_slots = num_slots
        self.max_length = max_length
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = num_slots * -(-max_length // block_size)
        self.num_blocks = num_blocks
        self.kv_cache_dtype = kv_cache_dtype
        """"auto" (the model's dtype) or "fp8" (float8_e4m3 blocks with per-head scales)."""
        fp8 = kv_cache_dtype == "fp8"
        self.recurrent_state = isinstance(model, MambaModel)
        """Mamba layers: a state slot per running sequence, no prefix caching (a recurrent
        state cannot be restored from cached blocks)."""
        if self.recurrent_state:
            self.cache = PagedHybridCache.for_model(model, num_slots, num_blocks, block_size, fp8)
        elif getattr(model.config, "multi_latent_attention", False):  # MLA's latents only
            self.cache = PagedLatentCache.for_model(model, num_blocks, block_size, fp8)
        else:
            self.cache = PagedKVCache.for_model(model, num_blocks, block_size, fp8)
        self.capacity_factor = route_dropless(model)
        self.device = next(model.parameters()).device
        self.num_threads = torch.get_num_threads()
        self.heartbeat_seconds: float | None = None
        """When set, the engine calls `heartbeat` after this long idle."""
        self.attention_backend = "auto"
        """`--attention-backend`: the SDPA kernels the cache's attention may use."""
        self.packed_linears = 0
        """Linears whose bf16 weights were packed once (`packed_linears`)."""
        self.fused_decode = None
        """`fused_decode.FusedDecode`: steps of decodes and short prompt chunks as one C++
        call (`use_fused_decode`)."""

    @property
    def _attention_cache(self) -> PagedKVCache | None:
        """The pool of keys/values (a hybrid's attention layers'; None: no attention)."""
        return self.cache.kv if self.recurrent_state else self.cache

    def choose_decode_attention(self) -> str:
        """With `--attention-backend auto` on a CPU, decode rows read their KV blocks in
        place (`mg.core.models.paged_attention_cpu`) where that kernel can be built; any
        other backend names SDPA kernels, which keep attending over gathered blocks.
        What decode attention runs, for the log."""
        cache = self._attention_cache
        if cache is None or self.attention_backend != "auto":
            return GATHERED
        return cache.use_cpu_decode_kernel(cpu_isa.confining_flags())

    def use_fused_decode(self) -> str | None:
        """Run steps of decodes and short prompt chunks as one C++ call (`fused_decode`)
        where this model and machine allow it (a Llama-shaped bf16 model whose linears the
        AMX kernel took; else an fp32 or bf16 one on AVX2/AVX-512: `vector_decode`); None,
        or why not, for the log (a bf16 model's AMX reason where AMX may run)."""
        cache = self._attention_cache
        why = fused_decode_unsupported(self.model, cache)
        step = FusedDecode
        dtype = cache.keys.dtype if cache is not None else None
        if why is not None and dtype in (torch.float32, torch.bfloat16):
            vector_why = vector_decode_unsupported(self.model, cache)
            if vector_why is None or dtype == torch.float32 or not cpu_isa.allows("amx"):
                why, step = vector_why, VectorDecode
        if why is None:
            try:
                self.fused_decode = step(self.model, cache)
            except Exception as err:  # noqa: BLE001 - the compiler refused: op by op serves
                return f"the fused step could not be built ({type(err).__name__}: {err})"
        return why

    @property
    def cache_decode_kernel(self):
        """The CPU kernel answering decode rows, or None (SDPA over gathered blocks)."""
        return getattr(self._attention_cache, "decode_kernel", None)

    @torch.inference_mode()
    def forward(
        self,
        segments: Sequence[PagedSegment],
        input_ids: Sequence[int],
        positions: Sequence[int],
        logit_rows: Sequence[int],
        image_rows: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Run the packed step; fp32 logits [len(logit_rows), vocab] of those rows, on the CPU.
        `image_rows` (rows of the step, their embeddings): input embeddings that replace
        those rows' token embeddings (a vision-language model's images, `vision_prefill`)."""
        kernels = serving_kernels(self.attention_backend)
        if kernels is None:
            return self._forward(segments, input_ids, positions, logit_rows, image_rows)
        with sdpa_kernel(list(kernels)):
            return self._forward(segments, input_ids, positions, logit_rows, image_rows)

    def _forward(
        self,
        segments: Sequence[PagedSegment],
        input_ids: Sequence[int],
        positions: Sequence[int],
        logit_rows: Sequence[int],
        image_rows: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        pos = torch.tensor([list(positions)], dtype=torch.long, device=self.device)
        fused = self.fused_decode
        if image_rows is None and fused is not None and fused.takes(segments):
            return fused.logits(segments, ids, pos, logit_rows).float()
        self.cache.bind(segments)
        rows = torch.tensor(list(logit_rows), dtype=torch.long, device=self.device)
        return self._logits(ids, pos, rows, image_rows=image_rows).float().cpu()

    def _logits(
        self,
        ids: Tensor,
        positions: Tensor,
        rows: Tensor | None = None,
        cache=None,
        image_rows: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The model over the bound cache (or `cache`, an object with the same `attend`):
        logits [rows (all when None), vocab]."""
        model = self.model
        hidden = model.embedding(ids, positions)
        if image_rows is not None:
            where, embeddings = image_rows
            hidden = hidden.clone()
            hidden[0, where.to(hidden.device)] = embeddings.to(hidden.device, hidden.dtype)
        rope = model.rotary_pos_emb
        rotary = rope(positions) if rope is not None else None
        hidden = model.decoder(hidden, rotary, None, self.cache if cache is None else cache)
        if rows is not None:
            hidden = hidden[:, rows]
        return model.output_and_loss(hidden, None)[0]

    def heartbeat(self) -> None:
        """Called while idle (every `heartbeat_seconds`): nothing to do in one process."""

    def close(self) -> None:
        """Called once by the engine thread when it stops."""
