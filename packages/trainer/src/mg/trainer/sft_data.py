"""`mg-train gpt --sft`'s data: conversations from `mg-prep sft`, packed.

Each conversation is one document of the token dataset PREFIX and of PREFIX_loss_mask
(1 on the assistant's tokens). The conversations of a split (`--split`, by
conversation) are shuffled per epoch (`--seed`) and packed in that order into
sequences of `--seq-length` + 1 tokens, a longer one cut to that; the rest of a
sequence is padding. A sample then holds, as Megatron's packed SFT samples do:

- `tokens` / `labels`: the sequence without its last / first token;
- `loss_mask`: the mask of each label, so the loss falls on assistant tokens only
  (never on padding, nor on a next conversation's first token);
- `position_ids`: restarting at 0 with each conversation;
- `attention_mask`: block-diagonal causal (True where attention is not allowed), so
  no token sees another conversation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from mg.indexed_dataset import IndexedDataset, parse_data_path, parse_split, read_blend_file
from mg.indexed_dataset.split import split_matrix, split_range

LOSS_MASK_SUFFIX = "_loss_mask"
"""The loss mask of dataset PREFIX is dataset PREFIX + this (as `mg-prep sft` writes it)."""
RECORD_SUFFIX = "_sft.json"
"""PREFIX + this: how `mg-prep sft` rendered the data (its prompt format, its tokenizer)."""


class PackedConversations:
    """Conversations packed into fixed-length samples with their masks and positions."""

    def __init__(
        self,
        sources: list[tuple[IndexedDataset, IndexedDataset, np.ndarray]],
        seq_length: int,
        num_samples: int | None,
        seed: int,
    ) -> None:
        self.seq_length = seq_length
        # (source, document) of every conversation of this split
        self._conversations = [(s, int(d)) for s, (_, _, docs) in enumerate(sources) for d in docs]
        self._sources = sources
        self._bins = self._pack(num_samples, seed)

    def _length(self, conversation: tuple[int, int]) -> int:
        tokens, _, _ = self._sources[conversation[0]]
        return min(int(tokens.sequence_lengths[conversation[1]]), self.seq_length + 1)

    def _pack(self, num_samples: int | None, seed: int) -> list[list[tuple[int, int]]]:
        """Greedy packing in shuffled order, epoch after epoch until `num_samples` bins."""
        bins: list[list[tuple[int, int]]] = []
        if not self._conversations:
            return bins
        capacity, epoch = self.seq_length + 1, 0
        while True:
            order = np.random.RandomState(seed + epoch).permutation(len(self._conversations))
            current: list[tuple[int, int]] = []
            used = 0
            for k in order:
                conversation = self._conversations[k]
                length = self._length(conversation)
                if current and used + length > capacity:
                    bins.append(current)
                    current, used = [], 0
                current.append(conversation)
                used += length
            bins.append(current)
            epoch += 1
            if num_samples is None or len(bins) >= num_samples:
                return bins if num_samples is None else bins[:num_samples]

    def __len__(self) -> int:
        return len(self._bins)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        capacity = self.seq_length + 1
        ids = np.zeros(capacity, dtype=np.int64)
        mask = np.zeros(capacity, dtype=np.float32)
        segment = np.full(capacity, -1, dtype=np.int64)  # conversation number; -1 padding
        positions = np.arange(capacity, dtype=np.int64)
        filled = 0
        for number, (source, document) in enumerate(self._bins[idx]):
            tokens, masks, _ = self._sources[source]
            length = self._length((source, document))
            ids[filled : filled + length] = tokens.get(document, length=length)
            mask[filled : filled + length] = masks.get(document, length=length)
            segment[filled : filled + length] = number
            positions[filled : filled + length] = np.arange(length)
            filled += length
        positions[filled:] = np.arange(capacity - filled)
        same = segment[:-1, None] == segment[None, :-1]
        # A label from another conversation than its input token (or padding) has no loss.
        label_mask = mask[1:] * (segment[1:] == segment[:-1]) * (segment[1:] >= 0)
        return {
            "tokens": ids[:-1].copy(),
            "labels": ids[1:].copy(),
            "loss_mask": label_mask.astype(np.float32),
            "position_ids": positions[:-1].copy(),
            "attention_mask": ~(np.tri(self.seq_length, dtype=bool) & same)[None],
        }


def _open(prefix: str) -> tuple[IndexedDataset, IndexedDataset]:
    """The token dataset and its loss mask, checked to describe the same conversations."""
    tokens = IndexedDataset(prefix)
    mask_prefix = prefix + LOSS_MASK_SUFFIX
    try:
        masks = IndexedDataset(mask_prefix)
    except Exception as exc:  # noqa: BLE001 -- any failure to open it means the same
        raise ValueError(
            f"--sft: {mask_prefix}.idx/.bin cannot be read ({exc}); --sft data comes from "
            "mg-prep sft, which writes it beside the tokens"
        ) from None
    if not np.array_equal(tokens.sequence_lengths, masks.sequence_lengths):
        raise ValueError(
            f"--sft: {mask_prefix} does not match {prefix} conversation for conversation; "
            "make both again with mg-prep sft"
        )
    return tokens, masks


def check_prompt_format(prefix: str, wanted: str | None) -> None:
    """--sft-tokenizer-prompt-format, when given, is the one the data was rendered with."""
    if wanted is None:
        return
    record = prefix + RECORD_SUFFIX
    if not os.path.isfile(record):
        raise ValueError(
            f"--sft-tokenizer-prompt-format {wanted}: {record} (written by mg-prep sft) is "
            "missing, so the data's prompt format is unknown; drop the flag or prepare again"
        )
    with open(record, encoding="utf-8") as stream:
        made_with = json.load(stream).get("prompt_format")
    if made_with != wanted:
        raise ValueError(
            f"--sft-tokenizer-prompt-format {wanted}: {prefix} was rendered with {made_with} "
            f"(mg-prep sft --sft-tokenizer-prompt-format); give {made_with} or prepare again"
        )


def sft_datasets(args: Any, num_samples: Sequence[int | None]) -> tuple[Any, Any, Any]:
    """Train, valid and test `PackedConversations` of `--data-path` (unweighted prefixes)."""
    d = args.data
    blend = read_blend_file(d.data_args_path) if d.data_args_path else parse_data_path(d.data_path)
    if blend.weights is not None and len(set(blend.weights)) > 1:
        raise ValueError(
            "--sft: --data-path takes prefixes without weights here (every conversation "
            "of every prefix is used alike)"
        )
    for prefix in blend.prefixes:
        check_prompt_format(prefix, args.sft.sft_tokenizer_prompt_format)
    opened = [_open(prefix) for prefix in blend.prefixes]
    bookends = split_matrix(parse_split(d.split or "969, 30, 1"))
    out = []
    for split, ends in enumerate(bookends):
        if ends is None:
            out.append(None)
            continue
        sources = [(t, m, split_range(ends, len(t))) for t, m in opened]
        data = PackedConversations(
            sources, args.model.seq_length, num_samples[split], args.training.seed + split
        )
        out.append(data if len(data) else None)
    return out[0], out[1], out[2]
