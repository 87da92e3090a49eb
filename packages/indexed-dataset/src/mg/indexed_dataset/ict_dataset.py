"""Inverse Cloze Task samples (Megatron's ICTDataset, REALM): a sentence and the block it
came from.

The corpus is sentence-split (`mg-prep tokenize --split-sentences`: one sequence
per sentence, documents over them). A block is a run of consecutive sentences of
one document, packed until it reaches the block length (``seq_length - 3 - len(title)`` with
titles: ``[CLS] title [SEP] block [SEP]``; ``seq_length - 2`` without) and holds
two sentences or more (one with ``use_one_sent_docs``); a document's last
sentences that cannot make such a block are left out, and a block is cut to the
block length when it is read.
Sample i is block ``order[i mod blocks]`` (the blocks shuffled once per epoch by
``seed``); one of its sentences is drawn as the query and, except with
probability ``query_in_block_prob``, removed from the block, so that the
retriever must find the block from its context rather than by copy. The draws of
sample i come from a generator seeded by (seed, i): every rank and every run
sees the same sample i.

Keys: ``query_tokens``, ``query_pad_mask``, ``context_tokens``,
``context_pad_mask`` (int64 [seq_length], 1 = token) and ``block_data``
(start sentence, end sentence, document, block number).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from mg.indexed_dataset.format import IndexedDataset


class SpecialTokens(Protocol):
    cls: int
    sep: int
    pad: int


def build_blocks(
    sentences: IndexedDataset,
    documents: np.ndarray,
    title_lengths: np.ndarray | None,
    seq_length: int,
    use_one_sent_docs: bool = False,
) -> np.ndarray:
    """[blocks, 4]: (start sentence, end sentence, document, block number), in corpus order."""
    lengths = sentences.sequence_lengths
    bounds = sentences.document_indices
    fewest = 1 if use_one_sent_docs else 2  # a query needs a block to be cut from
    rows = []
    for doc in documents:
        first, end = int(bounds[doc]), int(bounds[doc + 1])
        title = 0 if title_lengths is None else int(title_lengths[doc]) + 1
        target = seq_length - 2 - title
        start, size = first, 0
        for sentence in range(first, end):
            size += int(lengths[sentence])
            if (size >= target or sentence == end - 1) and sentence + 1 - start >= fewest:
                rows.append((start, sentence + 1, int(doc), len(rows)))
                start, size = sentence + 1, 0
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)


class ICTDataset:
    """(query, block) pairs of one split of a sentence-split corpus."""

    def __init__(
        self,
        sentences: IndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        tokenizer: SpecialTokens,
        *,
        titles: IndexedDataset | None = None,
        query_in_block_prob: float = 0.1,
        use_one_sent_docs: bool = False,
        seed: int = 1234,
    ) -> None:
        if titles is not None and len(titles) != sentences.num_documents:
            raise ValueError(
                f"the titles dataset has {len(titles)} sequences but the corpus has "
                f"{sentences.num_documents} documents; it needs one title per document"
            )
        self.sentences, self.titles, self.tokenizer = sentences, titles, tokenizer
        self.seq_length, self.seed = seq_length, seed
        self.query_in_block_prob = query_in_block_prob
        self.use_one_sent_docs = use_one_sent_docs
        title_lengths = None if titles is None else titles.sequence_lengths
        self.blocks = build_blocks(
            sentences, np.asarray(documents), title_lengths, seq_length, use_one_sent_docs
        )
        if len(self.blocks) == 0:
            raise ValueError(
                "no ICT block: the split's documents have fewer than two sentences each (a "
                "sentence-split corpus is needed; --use-one-sent-docs keeps one-sentence ones)"
            )
        self.num_samples = num_samples
        epochs = -(-num_samples // len(self.blocks))
        rng = np.random.RandomState(seed)
        self.order = np.concatenate([rng.permutation(len(self.blocks)) for _ in range(epochs)])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, Any]:
        start, end, doc, number = (int(v) for v in self.blocks[self.order[idx]])
        block = [self.sentences[i].tolist() for i in range(start, end)]
        rng = np.random.default_rng([self.seed, idx])
        pick = int(rng.integers(len(block)))
        if len(block) > 1 and rng.random() >= self.query_in_block_prob:
            query = block.pop(pick)
        else:
            query = list(block[pick])
        title = None if self.titles is None else self.titles[doc].tolist()
        room = self.seq_length - (2 if title is None else 3 + len(title))
        tok = self.tokenizer
        query_tokens, query_mask = self._pad([tok.cls, *query[: self.seq_length - 2], tok.sep])
        context = [t for sentence in block for t in sentence][:room]
        if title is None:
            framed = [tok.cls, *context, tok.sep]
        else:
            framed = [tok.cls, *title, tok.sep, *context, tok.sep]
        context_tokens, context_mask = self._pad(framed)
        return {
            "query_tokens": query_tokens,
            "query_pad_mask": query_mask,
            "context_tokens": context_tokens,
            "context_pad_mask": context_mask,
            "block_data": np.array([start, end, doc, number], dtype=np.int64),
        }

    def _pad(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        out = np.full(self.seq_length, self.tokenizer.pad, dtype=np.int64)
        mask = np.zeros(self.seq_length, dtype=np.int64)
        out[: len(tokens)] = tokens
        mask[: len(tokens)] = 1
        return out, mask
