"""Speculative decoding with the served model's own multi-token prediction layer (DeepSeek-V3's
use of MTP; Megatron's `--num-speculative-tokens` without a draft model).

MTP depth 1 predicts token i + 2 from the decoder's final hidden state at position i and the
embedding of token i + 1 (`mg.core.models.mtp`). So after the served model has produced
token t, its hidden state at t - 1 and token t give a guess for token t + 1: one draft token
per step, which the served model checks in its next step as it checks a draft model's
(`speculative.Drafter`); the output is the greedy output exactly, whatever the guesses.

Two pools sit beside the served model's paged KV cache, addressed by the same block tables
(position p in block table[p // size]), so the engine's block bookkeeping covers them:

- the served model's final hidden states, one per position, written after each of its
  steps by a forward hook on its decoder (the rows of a step are the cache's slots of that
  step, in order);
- the MTP layer's own keys and values: its position i is computed from hidden state i and
  token i + 1, with RoPE at position i, as in training. A sequence's MTP positions catch up
  from 0 (prompt included) before it proposes, at most `catch_up_tokens` per step.

Guesses are never written to either pool as if they were tokens: position i needs token
i + 1, which is only fed once the served model has accepted or produced it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from mg.core.models.paged_kv_cache import PagedKVCache, PagedSegment
from mg.generate_server.runner import ModelRunner
from mg.generate_server.speculative import Drafter, DraftingSequence


class _MTPLayerStack(nn.Module):
    """What `PagedKVCache.for_model` reads of a model: its config and its attention layers,
    here the MTP depth's transformer layer alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.config = model.config
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([model.mtp.layers[0].transformer_layer])


class _LayerOffset:
    """The MTP pool as the layer's attention sees it: it is numbered after the decoder's
    layers (`num_layers + 1`) and asks for that cache layer; the pool has one."""

    def __init__(self, pool: PagedKVCache, offset: int) -> None:
        self.pool, self.offset = pool, offset

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return self.pool.attend(layer - self.offset, query, key, value)


class _PoolSize:
    """The `runner` fields the engine checks of a drafter: its pool's blocks, no recurrence."""

    recurrent_state = False

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks


class MTPDrafter(Drafter):
    """Proposes one greedy token per sequence with the served model's first MTP depth.

    `target` is the served model's runner (a plain `ModelRunner`: its decoder must run op
    by op, the hidden states are taken from it)."""

    def __init__(self, target: ModelRunner, vocab_size: int, catch_up_tokens: int) -> None:
        model = target.model
        if getattr(model, "mtp", None) is None:
            raise ValueError("the served model has no multi-token prediction layers")
        super().__init__(_PoolSize(target.num_blocks), 1, vocab_size, catch_up_tokens)
        self.target = target
        self.model = model
        self.layer = model.mtp.layers[0]
        self.block_size = target.block_size
        self.pool = PagedKVCache.for_model(
            _MTPLayerStack(model), target.num_blocks, target.block_size
        )
        weight = next(model.parameters())
        slots = target.num_blocks * target.block_size
        self.hidden = torch.zeros(
            slots, model.config.hidden_size, dtype=weight.dtype, device=weight.device
        )
        self._hook = model.decoder.register_forward_hook(self._keep_hidden)

    def _keep_hidden(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        """After each of the served model's steps: its rows' final hidden states into the
        pool, at the cache slots the step wrote (`PagedKVCache.bind` lists them in row
        order)."""
        if len(args) < 4 or args[3] is not self.target.cache:
            return
        slots = self.target.cache._slots  # noqa: SLF001 - the step's slots, in row order
        self.hidden[slots] = output[0, : len(slots)].to(self.hidden.dtype)

    def close(self) -> None:
        self._hook.remove()

    def _slot(self, sequence: DraftingSequence, position: int) -> int:
        return sequence.blocks[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    @torch.inference_mode()
    def propose(self, work: Sequence[tuple[DraftingSequence, int]]) -> None:
        """Catch each sequence's MTP positions up to the one before its last token, and
        guess the token after it from there (k is 1 at most: one MTP depth)."""
        for sequence, _ in work:
            sequence.draft = []
        segments: list[PagedSegment] = []
        ids: list[int] = []
        positions: list[int] = []
        hidden_slots: list[int] = []
        rows: list[int] = []
        stepping = []
        for sequence, k in work:
            n = len(sequence.tokens)
            if k < 1 or n < 2:
                continue
            start = min(sequence.draft_computed, n - 2)  # position n - 2 gives the guess
            end = min(n - 1, start + self.catch_up_tokens)
            segments.append(PagedSegment(len(ids), end - start, start, list(sequence.blocks)))
            for i in range(start, end):  # position i: hidden state i, token i + 1
                ids.append(sequence.tokens[i + 1])
                positions.append(i)
                hidden_slots.append(self._slot(sequence, i))
            rows.append(len(ids) - 1)
            stepping.append((sequence, end, end == n - 1))
        if not segments:
            return
        device = self.hidden.device
        ids_t = torch.tensor([ids], dtype=torch.long, device=device)
        pos_t = torch.tensor([positions], dtype=torch.long, device=device)
        model = self.model
        # Megatron rolls the position ids with the tokens (learned positions see i + 1)
        embedded = model.embedding(ids_t, pos_t + 1)
        rotary = model.rotary_pos_emb(pos_t) if model.rotary_pos_emb is not None else None
        hidden = self.hidden[torch.tensor(hidden_slots, device=device)].unsqueeze(0)
        self.pool.bind(segments)
        cache = _LayerOffset(self.pool, model.config.num_layers)
        out = self.layer(hidden, embedded, rotary, None, cache)
        logits = model.output_and_loss(out[:, rows], None)[0][:, : self.vocab_size]
        guesses = torch.argmax(logits.float(), dim=-1).tolist()
        for (sequence, computed, proposes), guess in zip(stepping, guesses, strict=True):
            sequence.draft_computed = computed
            if proposes:
                sequence.draft = [guess]
