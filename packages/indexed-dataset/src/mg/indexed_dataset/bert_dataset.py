"""BERT samples (Megatron-Core's BERTMaskedWordPieceDataset): `[CLS] A [SEP] B [SEP]`.

A sample is a run of consecutive sentences of one document (see
`masking.build_sentence_sample_index`). With the binary head it is cut into A
and B at a random sentence, and with probability 1/2 A and B are swapped
(`is_random` = 1: Megatron's sentence-order target). The longer half is
trimmed from a random end until the pair fits, then ~15% of the words are
masked: 80% [MASK], 10% a random token, 10% unchanged.
"""

from __future__ import annotations

import numpy as np

from mg.indexed_dataset.masking import MaskedWordPieceDataset


class BertDataset(MaskedWordPieceDataset):
    """Dict samples: text, types, labels (-1 where not masked), is_random,
    padding_mask, loss_mask, truncated — Megatron's keys and values."""

    reserved_tokens = 3  # [CLS], [SEP], [SEP]

    def __init__(self, *args, classification_head: bool = True, **kwargs) -> None:
        self.classification_head = classification_head
        super().__init__(*args, **kwargs)

    def min_sentences_per_sample(self) -> int:
        return 2 if self.classification_head else 1

    def _replacement(self, rng: np.random.RandomState) -> int | None:
        if rng.random() < 0.8:
            return self.tokenizer.mask
        if rng.random() >= 0.5:
            return self.token_lookup[rng.randint(0, len(self.token_lookup))]
        return None

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        sentences, target, rng = self._sentences(idx)
        pivot, is_random = len(sentences), False
        if self.classification_head:
            pivot = rng.randint(low=1, high=len(sentences)) if len(sentences) >= 3 else 1
            is_random = rng.random() < 0.5
        a = [t for s in sentences[:pivot] for t in s]
        b = [t for s in sentences[pivot:] for t in s]
        if is_random:
            a, b = b, a
        truncated = len(a) + len(b) > target
        while len(a) + len(b) > target:  # trim the longer half from a random end
            half = a if len(a) > len(b) else b
            del half[0 if rng.random() < 0.5 else -1]

        tok = self.tokenizer
        tokens = [tok.cls, *a, tok.sep]
        types = [0] * (len(a) + 2)
        if b:
            tokens += [*b, tok.sep]
            types += [1] * (len(b) + 1)
        masked = self._mask(tokens, target, rng)

        pad, length = self.pad_token_id, self.sequence_length
        text = np.full(length, pad, dtype=np.int64)
        text[: len(tokens)] = masked.tokens
        types_arr = np.full(length, pad, dtype=np.int64)  # Megatron pads types with pad id
        types_arr[: len(types)] = types
        padding_mask = np.ones(length, dtype=np.int64)
        padding_mask[text == pad] = pad  # Megatron's value: the pad id (0 for BERT vocabs)
        labels = np.full(length, -1, dtype=np.int64)
        labels[masked.positions] = masked.labels
        loss_mask = np.zeros(length, dtype=np.int64)
        loss_mask[masked.positions] = 1
        text[text == pad] = 0
        labels[labels == pad] = 0
        return {
            "text": text,
            "types": types_arr,
            "labels": labels,
            "is_random": int(is_random),
            "padding_mask": padding_mask,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }
