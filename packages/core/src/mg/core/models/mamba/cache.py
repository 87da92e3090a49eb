"""Decoding state of a hybrid model: a constant-size recurrent state per Mamba layer,
a KV cache for the attention layers only.

Same slots-and-starts interface as `KVCache` (kv_cache.py), so a server that
batches rows of different lengths drives both the same way:

    cache = HybridCache.for_model(model, num_slots=8, max_length=1024)
    cache.bind(slots=torch.tensor([3]), starts=torch.tensor([0]))
    logits = model(prompt_ids, position_ids, inference_cache=cache)     # prefill
    cache.bind(slots=torch.tensor([3, 5]), starts=torch.tensor([7, 12]))
    logits = model(next_ids[:, None], positions[:, None], inference_cache=cache)

Per slot and Mamba layer the state is the convolution window (the last
d_conv − 1 inputs of the causal conv1d) and the SSM state [heads, P, N]: its
size does not grow with the sequence. A row bound with start 0 begins a new
sequence, so its slot's recurrent state is reset to zero. A recurrent state,
unlike a KV cache, cannot ignore padding after the fact: for right-padded
rows pass `lengths` (real tokens per row) to `bind`, and the state is taken
after each row's last real token.

Attention layers get a `KVCache` with one layer per attention layer; `attend`
maps the model's layer index onto it, so `SelfAttention` uses this object as
it uses a plain KVCache.

`PagedHybridCache` is the serving engine's version: packed steps of many
sequences, keys/values in a paged pool, each sequence's recurrent state in a slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mg.core.models.kv_cache import KVCache
from mg.core.models.mamba.pattern import ATTENTION, MAMBA
from mg.core.models.paged_kv_cache import PagedKVCache, PagedSegment


class _SlotStates:
    """Each Mamba layer's convolution window and SSM state per slot, and the layer-index
    maps both caches share; `_slots` (the rows being run) is set by the subclass."""

    def __init__(
        self,
        layer_pattern: str,
        num_slots: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        self.layer_pattern = layer_pattern
        self.num_slots = num_slots
        self._mamba_index = _index_of(layer_pattern, MAMBA)
        self._attention_index = _index_of(layer_pattern, ATTENTION)
        num_mamba = len(self._mamba_index)
        self.conv_states = torch.zeros(
            (num_mamba, num_slots, *conv_shape), dtype=dtype, device=device
        )
        # the SSM state is carried in fp32 at least, as mamba_ssm's kernels carry it
        self.ssm_states = torch.zeros(
            (num_mamba, num_slots, *ssm_shape),
            dtype=torch.promote_types(dtype, torch.float32),
            device=device,
        )
        self.kv: KVCache | PagedKVCache | None = None
        self._slots: Tensor | None = None

    def mamba_state(self, layer_index: int) -> tuple[Tensor, Tensor]:
        """The running rows' (conv window [b, conv_dim, d_conv-1], SSM state [b, heads, P, N])
        of the model's layer `layer_index`."""
        i = self._mamba_index[layer_index]
        return self.conv_states[i, self._slots], self.ssm_states[i, self._slots]

    def store_mamba_state(self, layer_index: int, conv: Tensor, ssm: Tensor) -> None:
        """Write the running rows' new states back to their slots."""
        i = self._mamba_index[layer_index]
        self.conv_states[i, self._slots] = conv.to(self.conv_states.dtype)
        self.ssm_states[i, self._slots] = ssm.to(self.ssm_states.dtype)

    def attend(self, layer_index: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The KV cache's `attend` for an attention layer, by the model's layer index."""
        return self.kv.attend(self._attention_index[layer_index], query, key, value)


class HybridCache(_SlotStates):
    """Recurrent states for the Mamba layers, keys/values for the attention layers."""

    def __init__(
        self,
        layer_pattern: str,
        num_slots: int,
        max_length: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
        num_groups: int = 1,
        head_dim: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window_size: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(layer_pattern, num_slots, conv_shape, ssm_shape, dtype, device)
        self.max_length = max_length
        self.kv = (
            KVCache(
                len(self._attention_index),
                num_slots,
                max_length,
                num_groups,
                head_dim,
                dtype=dtype,
                device=device,
                window_size=window_size,
            )
            if self._attention_index
            else None
        )
        self._starts: Tensor | None = None
        self._lengths: Tensor | None = None

    @classmethod
    def for_model(cls, model: nn.Module, num_slots: int, max_length: int) -> HybridCache:
        """A cache shaped for `model` (a MambaModel, possibly tensor-parallel: the
        shapes are read from its local modules), in its parameters' dtype and device."""
        layers = model.decoder.layers
        pattern = model.decoder.layer_pattern
        weight = next(model.parameters())
        mixer = next((layer.mixer for layer in layers if hasattr(layer, "mixer")), None)
        conv_shape, ssm_shape = mixer.state_shapes() if mixer is not None else ((0,), (0,))
        attention = next(
            (layer.self_attention for layer in layers if hasattr(layer, "self_attention")), None
        )
        return cls(
            pattern,
            num_slots,
            max_length,
            conv_shape,
            ssm_shape,
            num_groups=attention.num_groups if attention is not None else 1,
            head_dim=attention.head_dim if attention is not None else 1,
            dtype=weight.dtype,
            device=weight.device,
            window_size=model.config.window_size,
        )

    def bind(self, slots: Tensor, starts: Tensor, lengths: Tensor | None = None) -> None:
        """Set each batch row's slot, start position and (optionally) real length for
        the next forward. A row starting at 0 begins a new sequence in its slot."""
        device = self.conv_states.device
        self._slots = slots.to(device, torch.long)
        self._starts = starts.to(device, torch.long)
        self._lengths = None if lengths is None else lengths.to(device, torch.long)
        fresh = self._slots[self._starts == 0]
        if fresh.numel():
            self.conv_states[:, fresh] = 0
            self.ssm_states[:, fresh] = 0
        if self.kv is not None:
            self.kv.bind(slots, starts)

    def lengths(self, batch: int, seq: int) -> Tensor:
        """Real tokens of each row in this forward ([batch]; all `seq` unless bound)."""
        self._check_bound(batch)
        if self._lengths is None:
            return torch.full((batch,), seq, dtype=torch.long, device=self.conv_states.device)
        return self._lengths

    def _check_bound(self, batch: int) -> None:
        if self._slots is None:
            raise RuntimeError("HybridCache.bind(slots, starts) must be called before a forward")
        if self._slots.shape[0] != batch:
            raise ValueError(
                f"HybridCache is bound to {self._slots.shape[0]} rows, the batch has {batch}"
            )


def _index_of(pattern: str, letter: str) -> dict[int, int]:
    """Model layer index → index among the layers of one type."""
    return {layer: i for i, layer in enumerate(j for j, c in enumerate(pattern) if c == letter)}


class PagedHybridCache(_SlotStates):
    """A hybrid model's state for a serving engine's packed steps (`PagedSegment`s):
    the attention layers' keys/values in a `PagedKVCache`, each Mamba layer's
    convolution window and SSM state in the sequence's slot (`PagedSegment.slot`).

    A packed step lays every sequence's new tokens end to end in one row; a
    recurrence must not run across them, so `mix` runs the mixer on the decoding
    sequences together (one token each, [n, 1, h]) and on each prefill chunk
    alone ([1, length, h]), each from its own slot's state. A segment starting
    at position 0 begins a new sequence: its slot is zeroed by `bind`; a later
    chunk of the same prompt continues from the state the previous chunk left
    (chunked prefill). The state after a block of tokens is not kept, so a
    cached block prefix cannot restore it: an engine serving this cache runs
    without prefix caching and recomputes a preempted sequence from position 0.
    """

    def __init__(
        self,
        layer_pattern: str,
        num_slots: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
        kv: PagedKVCache | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(layer_pattern, num_slots, conv_shape, ssm_shape, dtype, device)
        self.kv = kv
        self._groups: list[tuple[Tensor | slice, Tensor]] = []

    @classmethod
    def for_model(
        cls, model: nn.Module, num_slots: int, num_blocks: int, block_size: int, fp8: bool = False
    ) -> PagedHybridCache:
        """Shaped for `model` (a MambaModel): `num_slots` recurrent states, and a pool of
        `num_blocks` blocks for its attention layers (none without attention; `fp8`: see
        `PagedKVCache`)."""
        layers = model.decoder.layers
        weight = next(model.parameters())
        mixer = next(layer.mixer for layer in layers if hasattr(layer, "mixer"))
        kv = None
        if any(hasattr(layer, "self_attention") for layer in layers):
            kv = PagedKVCache.for_model(model, num_blocks, block_size, fp8=fp8)
        conv_shape, ssm_shape = mixer.state_shapes()
        return cls(
            model.decoder.layer_pattern,
            num_slots,
            conv_shape,
            ssm_shape,
            kv,
            dtype=weight.dtype,
            device=weight.device,
        )

    def bind(self, segments: Sequence[PagedSegment]) -> None:
        """Describe the next packed step (see `PagedKVCache.bind`); zero the slots of the
        sequences that start at position 0."""
        device = self.conv_states.device
        fresh = [s.slot for s in segments if s.context_start == 0]
        if fresh:
            self.conv_states[:, fresh] = 0
            self.ssm_states[:, fresh] = 0
        decodes = [s for s in segments if s.query_length == 1]
        self._groups = []
        if decodes:
            rows = torch.tensor([s.query_start for s in decodes], device=device)
            slots = torch.tensor([s.slot for s in decodes], device=device)
            self._groups.append((rows, slots))
        for s in segments:
            if s.query_length > 1:
                rows = slice(s.query_start, s.query_start + s.query_length)
                self._groups.append((rows, torch.tensor([s.slot], device=device)))
        if self.kv is not None:
            self.kv.bind(segments)

    def mix(self, mixer: nn.Module, hidden: Tensor) -> Tensor:
        """The Mamba mixer over a packed row [1, T, h], each sequence from its own state."""
        out = torch.empty_like(hidden)
        for rows, slots in self._groups:
            self._slots = slots
            if isinstance(rows, slice):  # one prefill chunk: [1, length, h]
                out[:, rows] = mixer(hidden[:, rows], inference_cache=self)
            else:  # the decoding sequences, one token each: [n, 1, h]
                out[0, rows] = mixer(hidden[0, rows][:, None], inference_cache=self)[:, 0]
        self._slots = None
        return out

    def lengths(self, batch: int, seq: int) -> Tensor:
        """Every row of a group is all real tokens (no padding in a packed step)."""
        return torch.full((batch,), seq, dtype=torch.long, device=self.conv_states.device)
