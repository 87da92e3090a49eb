"""A paged key/value cache: fixed-size blocks from one pool, a block table per sequence.

A server decodes many sequences of different lengths at once. Giving each a
contiguous slot of the model's full context wastes memory on positions never
used; here the pool is `num_blocks` blocks of `block_size` positions for every
layer, and a sequence owns the blocks its block table lists (position p lives
in block `table[p // block_size]` at offset `p % block_size`). Blocks can be
shared between sequences (a common prompt prefix is computed once).

One forward runs a *packed* step: the new tokens of every sequence laid end to
end as one row, input_ids [1, T] and position_ids [1, T]. A step is described by
`PagedSegment`s (where each sequence's tokens sit in the row, how many
positions it had cached before, its block table), built by the caller on the
host, so nothing in the forward waits on the device:

    cache = PagedKVCache.for_model(model, num_blocks=256, block_size=16)
    cache.bind([PagedSegment(0, 5, 0, [3]), PagedSegment(5, 1, 17, [0, 1])])
    logits = model(ids, positions, inference_cache=cache)   # ids, positions: [1, 6]

Each layer calls `attend(layer, q, k, v)`: the step's keys/values are written
into their blocks (one index_copy_ per layer, no copy of the prefix), then the
queries of the sequences that decode one token are answered together by one
SDPA over their gathered blocks, and each prefill chunk by its own SDPA with a
causal mask offset by its cached prefix (chunked prefill).

With `fp8=True` the pool stores keys and values as float8_e4m3 bit patterns
(one byte an element; kept as uint8, since not every device indexes float8
tensors) with one fp32 scale per position and key/value head (amax / 448, so no
calibration is needed and an outlier token does not coarsen its block's other
positions); blocks are dequantized as they are gathered.

`attend(layer, query, key, value) -> context` is the whole interface a model
layer sees (`KVCache` has it too). A layer with a recurrent state instead of
keys/values (Mamba) keeps it in a per-sequence slot, not in blocks: a segment
names its sequence's `slot` (`mg.core.models.mamba.cache.PagedHybridCache`).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.core_attention import causal_mask, sink_attention, sink_logits
from mg.core.models.paged_attention_cpu import DecodeKernel, decode_kernel

GATHERED = "SDPA over gathered blocks"
"""Decode attention without the CPU kernel (`PagedKVCache.use_cpu_decode_kernel`)."""


@dataclass(frozen=True)
class PagedSegment:
    """One sequence's part of a packed step."""

    query_start: int
    """Index of its first new token in the packed row."""
    query_length: int
    """How many new tokens it has in this step (1 when decoding)."""
    context_start: int
    """Positions already cached before this step; its first new token is at this position."""
    blocks: Sequence[int]
    """Its block table, covering at least context_start + query_length positions."""
    slot: int = 0
    """Its recurrent-state slot (models with Mamba layers; attention ignores it)."""

    @property
    def context_length(self) -> int:
        return self.context_start + self.query_length


def encode_segments(segments: Sequence[PagedSegment]) -> list[int]:
    """The segments as a flat list of ints (to broadcast a step to tensor-parallel ranks)."""
    flat = [len(segments)]
    for s in segments:
        flat += [s.query_start, s.query_length, s.context_start, s.slot, len(s.blocks)]
        flat += s.blocks
    return flat


def decode_segments(flat: Sequence[int]) -> list[PagedSegment]:
    """Inverse of `encode_segments`."""
    segments, i = [], 1
    for _ in range(flat[0]):
        start, length, context, slot, n = flat[i : i + 5]
        blocks = list(flat[i + 5 : i + 5 + n])
        segments.append(PagedSegment(start, length, context, blocks, slot))
        i += 5 + n
    return segments


@dataclass
class _Prefill:
    """A prefill chunk's bound metadata: its rows of the packed step and its keys' blocks."""

    start: int
    length: int
    context: int
    blocks: Tensor
    masks: dict[tuple[int, int] | None, Tensor | None]
    """Per sliding window (None: global) of the model's layers; a mask None: a chunk
    from position 0 (plain causal attention, no window)."""


FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value."""


class Fp8UnavailableError(RuntimeError):
    """This torch cannot store float8_e4m3 on the device."""


def check_fp8(device: torch.device | str) -> None:
    """Raise Fp8UnavailableError unless float8_e4m3fn round-trips on `device`."""
    try:
        probe = torch.ones(2, device=device).to(FP8).view(torch.uint8).view(FP8).float()
        if probe.tolist() != [1.0, 1.0]:
            raise RuntimeError("float8_e4m3fn does not round-trip 1.0")
    except (TypeError, RuntimeError, AttributeError) as err:
        raise Fp8UnavailableError(
            f"torch {torch.__version__} has no usable float8_e4m3fn on {device}: {err}"
        ) from None


def _to_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """[T, groups, d] → float8_e4m3 bit patterns (uint8) and per-row scales [T, groups]."""
    x = x.float()
    scale = x.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (x / scale[..., None]).to(FP8).view(torch.uint8), scale


def _zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor whose memory is touched only when written, on the CPU: anonymous mmap
    pages cost nothing until used, so a large pool holds only the blocks really filled."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)


class PagedKVCache:
    """Keys and values in blocks, [layers, blocks, block_size, groups, head_dim] each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_groups: int,
        head_dim: int,
        num_heads: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window_size: tuple[int, int] | None = None,
        fp8: bool = False,
        layer_windows: Sequence[tuple[int, int] | None] | None = None,
        softmax_scale: float | None = None,
        layer_sinks: Sequence[Tensor | None] | None = None,
    ) -> None:
        device = torch.device(device or "cpu")
        shape = (num_layers, num_blocks, block_size, num_groups, head_dim)
        self.fp8 = fp8
        if fp8:
            check_fp8(device)
            dtype = torch.uint8
            self.key_scales = _zeroed_pool(shape[:-1], torch.float32, device)
            self.value_scales = _zeroed_pool(shape[:-1], torch.float32, device)
        self.keys = _zeroed_pool(shape, dtype, device)
        self.values = _zeroed_pool(shape, dtype, device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_heads = num_heads
        self.window_size = window_size
        # each layer's window, where only some layers slide (Gemma 3's local/global
        # pattern): the masks are built once per bind for each distinct window
        self.layer_windows = list(layer_windows or [window_size] * num_layers)
        self._windows = list(dict.fromkeys(self.layer_windows))
        self.softmax_scale = softmax_scale
        # per layer, the attention-sink logits [heads] (gpt-oss) or None
        self.layer_sinks = list(layer_sinks or [None] * num_layers)
        self.device = device
        self.decode_kernel: DecodeKernel | None = None
        """Decode rows' attention read in place (`use_cpu_decode_kernel`); None: SDPA over
        gathered blocks."""
        self._bound = False

    def use_cpu_decode_kernel(self, isa_flags: tuple[str, ...] = ()) -> str:
        """Answer decode rows with the CPU kernel that reads blocks in place, where it can
        be built (a CPU pool in float32 or bfloat16, a C++ compiler; `isa_flags`: confined
        to an older instruction set, `decode_kernel`'s); what decode attention runs, for
        the log."""
        if self.device.type != "cpu" or self.fp8:
            return GATHERED
        groups, d = self.keys.shape[3], self.keys.shape[4]
        kernel, what = decode_kernel(
            self.keys.dtype, groups, self.num_heads, d, self.block_size, isa_flags
        )
        self.decode_kernel = kernel
        return what if kernel is not None else f"{GATHERED}: {what}"

    @staticmethod
    def block_bytes(
        model: nn.Module, block_size: int, dtype: torch.dtype | None = None, fp8: bool = False
    ) -> int:
        """Bytes one block takes for every attention layer of `model` (keys and values);
        0 for a model without attention (Mamba layers keep no blocks)."""
        layers = [x.self_attention for x in model.decoder.layers if hasattr(x, "self_attention")]
        if not layers:
            return 0
        dtype = dtype or next(model.parameters()).dtype
        if hasattr(layers[0], "kv_lora_rank"):  # MLA: the latent and the positional key
            latent = layers[0].kv_lora_rank + layers[0].qk_pos_emb_head_dim
            return len(layers) * block_size * latent * torch.empty((), dtype=dtype).element_size()
        head = layers[0].head_dim * torch.empty((), dtype=dtype).element_size()
        if fp8:  # a byte an element and an fp32 scale per position and head
            head = layers[0].head_dim + 4
        return 2 * len(layers) * block_size * layers[0].num_groups * head

    @classmethod
    def for_model(
        cls, model: nn.Module, num_blocks: int, block_size: int, fp8: bool = False
    ) -> PagedKVCache:
        """A pool shaped for `model`'s attention layers (a GPTModel's every layer, a hybrid's
        attention layers; their local heads under tensor parallelism)."""
        config = model.config
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                "the paged KV cache (mg-serve) does not cap attention logits "
                "(attn_logit_softcapping) yet; evaluate such a model with mg-eval"
            )
        layers = [layer for layer in model.decoder.layers if hasattr(layer, "self_attention")]
        attention = layers[0].self_attention
        weight = next(model.parameters())
        windows = None
        if getattr(config, "window_attn_skip_freq", None) is not None:
            numbers = [layer.self_attention.layer_number for layer in layers]
            windows = [config.layer_window_size(number) for number in numbers]
        return cls(
            num_layers=len(layers),
            num_blocks=num_blocks,
            block_size=block_size,
            num_groups=attention.num_groups,
            head_dim=attention.head_dim,
            num_heads=attention.num_heads,
            dtype=weight.dtype,
            device=weight.device,
            window_size=config.window_size,
            fp8=fp8,
            layer_windows=windows,
            softmax_scale=getattr(config, "softmax_scale", None),
            layer_sinks=[
                sink_logits(layer.self_attention.core_attention, attention.num_heads, weight.device)
                if hasattr(layer.self_attention, "core_attention")
                else None
                for layer in layers
            ],
        )

    def bind(self, segments: Sequence[PagedSegment]) -> None:
        """Describe the next forward's packed row; everything every layer needs is built here."""
        bs, device = self.block_size, self.device
        slots: list[int] = []
        decodes: list[PagedSegment] = []
        self._prefills: list[_Prefill] = []
        expected = 0
        for s in segments:
            if s.query_start != expected:
                raise ValueError("PagedKVCache: segments must tile the packed row in order")
            expected += s.query_length
            if s.context_length > len(s.blocks) * bs:
                raise ValueError(
                    f"PagedKVCache: a sequence reaches position {s.context_length - 1} but its "
                    f"{len(s.blocks)} blocks of {bs} hold {len(s.blocks) * bs}"
                )
            for p in range(s.context_start, s.context_length):
                slots.append(s.blocks[p // bs] * bs + p % bs)
            if s.query_length == 1:
                decodes.append(s)
            else:
                nb = -(-s.context_length // bs)
                self._prefills.append(
                    _Prefill(
                        s.query_start,
                        s.query_length,
                        s.context_start,
                        torch.tensor(s.blocks[:nb], device=device),
                        {
                            w: self._mask([s], s.query_length, nb * bs, chunk=True, window=w)
                            for w in self._windows
                        },
                    )
                )
        self._num_tokens = expected
        self._slots = torch.tensor(slots, dtype=torch.long, device=device)
        self._decode_rows: Tensor | slice | None = None
        if decodes:
            width = max(-(-s.context_length // bs) for s in decodes)
            tables = [
                list(s.blocks[:width]) + [0] * (width - len(s.blocks[:width])) for s in decodes
            ]
            starts = [s.query_start for s in decodes]
            if starts == list(range(starts[0], starts[0] + len(starts))):
                self._decode_rows = slice(starts[0], starts[0] + len(starts))  # no gather/scatter
            else:
                self._decode_rows = torch.tensor(starts, device=device)
            self._decode_tables = torch.tensor(tables, device=device)
            self._decode_lengths = torch.tensor([s.context_length for s in decodes], device=device)
            self._decode_segments = decodes
            self._decode_masks = {}  # built where first needed: the CPU kernel needs none
        self._decode_biases = {}
        self._bound = True

    def bind_static(
        self, segments: Sequence[PagedSegment], rows: int, width: int, pad_block: int
    ) -> None:
        """Bind a decode-only step (one new token per sequence) padded to `rows` sequences of
        `width` blocks, into the tensors of the last static bind of that many rows: the same
        storage every step, so a CUDA graph captured over one step replays the next.
        Padding rows write to and read position 0 of `pad_block`, a block no sequence holds.
        Attention then covers `width` blocks for every row (masked past each one's length)."""
        n, bs = len(segments), self.block_size
        if n > rows or any(
            s.query_length != 1 or s.query_start != i for i, s in enumerate(segments)
        ):
            raise ValueError(f"PagedKVCache.bind_static: a decode-only row of at most {rows}")
        if any(s.context_length > width * bs for s in segments):
            raise ValueError(f"PagedKVCache.bind_static: a sequence longer than {width} blocks")
        padded = list(segments) + [PagedSegment(i, 1, 0, [pad_block]) for i in range(n, rows)]
        slots = [s.blocks[s.context_start // bs] * bs + s.context_start % bs for s in padded]
        tables = [list(s.blocks[:width]) + [pad_block] * (width - len(s.blocks)) for s in padded]
        masks = [self._mask(padded, 1, width * bs, chunk=False, window=w) for w in self._windows]
        lengths = [s.context_length for s in padded]
        fresh = (torch.tensor(slots), torch.tensor(tables), torch.tensor(lengths), *masks)
        static = getattr(self, "_static", {})
        self._static = static
        if rows not in static or static[rows][1].shape[1] != width:
            static[rows] = tuple(x.to(self.device) for x in fresh)
        else:
            for into, value in zip(static[rows], fresh, strict=True):
                into.copy_(value, non_blocking=True)
        self._slots, self._decode_tables, self._decode_lengths, *masks = static[rows]
        self._decode_masks = dict(zip(self._windows, masks, strict=True))
        self._num_tokens, self._prefills, self._decode_rows = rows, [], slice(0, rows)
        self._decode_biases = {}
        self._bound = True

    def _mask(
        self,
        segments: list[PagedSegment],
        queries: int,
        keys: int,
        chunk: bool,
        window: tuple[int, int] | None,
    ) -> Tensor | None:
        """Bool [rows, 1, queries, keys] (True = attend): key j is visible to query i of a
        row when j <= its position (and within the sliding window)."""
        s = segments[0]
        if chunk and s.context_start == 0 and window is None:
            return None  # plain causal over exactly its own keys
        start = torch.tensor([x.context_start for x in segments])
        position = start[:, None] + torch.arange(queries)[None, :]  # [rows, queries]
        j = torch.arange(keys)
        allowed = j[None, None, :] <= position[:, :, None]
        if window is not None:
            allowed &= j[None, None, :] >= position[:, :, None] - window[0]
        return allowed[:, None].to(self.device)

    def attend(self, layer_index: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Store the step's keys/values [1, T, groups, d] of one layer and return the context
        [1, T, heads·d] of its queries [1, T, heads, d] over each sequence's cached positions."""
        if not self._bound:
            raise RuntimeError("PagedKVCache.bind(segments) must be called before a forward")
        b, t, heads, d = query.shape
        if b != 1 or t != self._num_tokens:
            raise ValueError(
                f"PagedKVCache is bound to a packed row of {self._num_tokens} tokens; "
                f"the step has shape [{b}, {t}]"
            )
        groups = self.keys.shape[3]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(d)
        window = self.layer_windows[layer_index]
        rows = self._decode_rows
        every_row_decodes = isinstance(rows, slice) and rows == slice(0, t)
        if every_row_decodes and self._kernel_reads(query) and key.dtype == query.dtype:
            # every row decodes: the kernel stores the step's keys/values and attends
            context = self._decode_attention(layer_index, query[0], scale, (key[0], value[0]))
            return context.view(1, t, heads * d)
        self._store(layer_index, key[0], value[0])
        gqa = groups != heads
        out = query.new_empty(t, heads, d)
        if self._decode_rows is not None:
            context = self._decode_attention(layer_index, query[0, self._decode_rows], scale)
            if not self._prefills and context.shape[0] == t:  # every row decodes: no scatter
                return context.view(1, t, heads * d)
            out[self._decode_rows] = context
        for p in self._prefills:
            length = p.context + p.length
            mask = p.masks[window]
            q = query[0, p.start : p.start + p.length].transpose(0, 1)[None]  # [1, heads, s, d]
            k, v = self._read(layer_index, p.blocks, q.dtype)
            k, v = k.view(-1, groups, d), v.view(-1, groups, d)
            if mask is None:
                k, v = k[:length], v[:length]
            k, v = (x.transpose(0, 1)[None] for x in (k, v))
            sinks = self.layer_sinks[layer_index]
            if sinks is not None:  # one more logit per head (gpt-oss), an explicit mask
                allowed = mask if mask is not None else causal_mask(length, None, q.device)
                context = sink_attention(q, k, v, allowed, sinks, scale)
            else:
                context = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
                )
            out[p.start : p.start + p.length] = context[0].transpose(0, 1)
        return out.view(1, t, heads * d)

    def _kernel_reads(self, query: Tensor) -> bool:
        """Whether the CPU kernel answers these decode queries."""
        return self.decode_kernel is not None and query.dtype == self.keys.dtype

    def _decode_attention(
        self,
        layer_index: int,
        query: Tensor,
        scale: float,
        new: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The decode rows' context [n, heads, d] for their queries [n, heads, d]; `new`:
        the rows' own keys and values, for the kernel to store (a decode-only step)."""
        n, heads, d = query.shape
        window_size = self.layer_windows[layer_index]
        if self._kernel_reads(query):
            window = window_size[0] if window_size is not None else -1
            return self.decode_kernel(
                query,
                self.keys[layer_index],
                self.values[layer_index],
                self._decode_tables,
                self._decode_lengths,
                window,
                scale,
                None if new is None else (*new, self._slots),
                sinks=self.layer_sinks[layer_index],
            )
        groups = self.keys.shape[3]
        # a group's query heads as its queries ([n, groups, heads/groups, d]): they
        # share its keys, so SDPA needs no GQA expansion (0.6x the time on a CPU)
        q = query.reshape(n, groups, heads // groups, d)
        k, v = self._read(layer_index, self._decode_tables, q.dtype)
        k = k.view(n, -1, groups, d).transpose(1, 2)
        v = v.view(n, -1, groups, d).transpose(1, 2)
        bias = self._bias(q.dtype, window_size)
        sinks = self.layer_sinks[layer_index]
        if sinks is not None:  # a zero key/value whose bias is each head's sink logit
            zeros = k.new_zeros(n, groups, 1, d)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros.to(v.dtype)], dim=2)
            per_head = sinks.to(q.dtype).view(1, groups, heads // groups, 1)
            bias = bias.expand(n, groups, heads // groups, bias.shape[-1])
            bias = torch.cat([bias, per_head.expand(n, -1, -1, 1)], dim=-1)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return context.reshape(n, heads, d)

    def _bias(self, dtype: torch.dtype, window: tuple[int, int] | None) -> Tensor:
        """The decode mask [n, 1, 1, keys] as an additive bias (0 / -inf) in the queries'
        dtype, built once per bind: SDPA on a CPU would convert the bool mask in every
        layer (1.7x the attention's time for 8 sequences of 256 positions in bf16). The
        mask applies to a row's every query head alike. Every row sees at
        least its own position, so no row is all -inf. While a CUDA graph is captured it
        is built in every layer, so that the graph recomputes it from the static mask."""
        bias = self._decode_biases.get(window)
        mask = self._decode_masks.get(window)
        if mask is None:
            keys = self._decode_tables.shape[1] * self.block_size
            mask = self._mask(self._decode_segments, 1, keys, chunk=False, window=window)
            self._decode_masks[window] = mask
        capturing = mask.is_cuda and torch.cuda.is_current_stream_capturing()
        if bias is None or bias.dtype != dtype or capturing:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            bias = self._decode_biases[window] = bias.masked_fill_(~mask, float("-inf"))
        return bias

    def _store(self, layer_index: int, key: Tensor, value: Tensor) -> None:
        """Write the step's keys/values [T, groups, d] of one layer into their slots."""
        keys, values = self.keys[layer_index], self.values[layer_index]
        groups, d = keys.shape[2], keys.shape[3]
        if not self.fp8:
            keys.view(-1, groups, d).index_copy_(0, self._slots, key.to(keys.dtype))
            values.view(-1, groups, d).index_copy_(0, self._slots, value.to(values.dtype))
            return
        for pool, scales, x in (
            (keys, self.key_scales[layer_index], key),
            (values, self.value_scales[layer_index], value),
        ):
            bits, scale = _to_fp8(x)
            pool.view(-1, groups, d).index_copy_(0, self._slots, bits)
            scales.view(-1, groups).index_copy_(0, self._slots, scale)

    def _read(self, layer_index: int, blocks: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Keys and values of `blocks` (any index shape) in `dtype`, [..., block_size,
        groups, d]; fp8 blocks are dequantized here."""
        keys, values = (
            _gather(self.keys[layer_index], blocks),
            _gather(self.values[layer_index], blocks),
        )
        if not self.fp8:
            return keys.to(dtype), values.to(dtype)
        k_scale = _gather(self.key_scales[layer_index], blocks)[..., None]
        v_scale = _gather(self.value_scales[layer_index], blocks)[..., None]
        k = (keys.view(FP8).float() * k_scale).to(dtype)
        v = (values.view(FP8).float() * v_scale).to(dtype)
        return k, v


def _gather(pool: Tensor, blocks: Tensor) -> Tensor:
    """pool[blocks] for a block index of any shape: one index_select over the flattened
    index (5x faster on a CPU than advanced indexing, which a decode step does twice per
    layer)."""
    return pool.index_select(0, blocks.reshape(-1)).view(*blocks.shape, *pool.shape[1:])
