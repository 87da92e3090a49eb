"""`mg-train retro --sft`'s data: `mg-prep sft` conversations with retrieved neighbours.

InstructRetro (Megatron's tools/retro/sft) finetunes a Retro model on instruction
data. Here a sample is one conversation of the `--sft` data (sft_data.py: the same
files, split, per-epoch shuffle, masks and positions, the loss on the assistant's
tokens only), padded to `--seq-length`, and its neighbours [l, k, r] are those that
generation retrieves for the same tokens (`Retriever.neighbor_tokens`: the complete
chunks embedded with the project's BERT and searched in its index, an incomplete last
chunk and the padding's chunks end-of-document rows), so a model meets in
finetuning what `mg-eval qa` and `mg-serve` give it.

One conversation a sample, not packed as `gpt --sft` packs them: Retro's chunks
are cut from the start of the sequence and a chunk's encoded neighbours (whose
encoder attends to that chunk's hidden states) are seen by the next chunk's tokens,
so a packed conversation would start off the chunk grid generation uses and its
first tokens would see neighbours of the conversation before it. Megatron's
InstructRetro also has one question-answer pair a sample.

The neighbours are retrieved lazily, sample by sample, through the Retriever's
cache: a run reads only the conversations it trains and validates on, each chunk is
searched once per process (later epochs are cache hits), and training starts at
once instead of after a pass of BERT over the whole data. BERT runs on the CPU
(data loader workers cannot use the GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.arguments.retro import read_project_config
from mg.trainer.sft_data import PackedConversations, sft_datasets


class ConversationSamples(PackedConversations):
    """`PackedConversations` with one conversation a sample (shuffled per epoch alike)."""

    def _pack(self, num_samples: int | None, seed: int) -> list[list[tuple[int, int]]]:
        bins: list[list[tuple[int, int]]] = []
        epoch = 0
        while self._conversations and (num_samples is None or len(bins) < num_samples):
            order = np.random.RandomState(seed + epoch).permutation(len(self._conversations))
            bins += [[self._conversations[k]] for k in order]
            epoch += 1
            if num_samples is None:
                break
        return bins if num_samples is None else bins[:num_samples]

    @classmethod
    def of(cls, packed: PackedConversations, num_samples: int | None, seed: int):
        """The conversations of `packed` (one split of `sft_datasets`), one a sample."""
        return cls(packed._sources, packed.seq_length, num_samples, seed)

    def conversation_length(self, idx: int) -> int:
        """How many of sample idx's `tokens` are its conversation (the rest is padding)."""
        return min(self._length(self._bins[idx][0]), self.seq_length)


class RetroConversations:
    """Conversation samples, each with `neighbor_tokens` [l, k, r] retrieved for it."""

    def __init__(self, samples: ConversationSamples, retriever: Any) -> None:
        self.samples, self.retriever = samples, retriever
        self.num_chunks = samples.seq_length // retriever.chunk_length

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = self.samples[idx]
        conversation = sample["tokens"][: self.samples.conversation_length(idx)]
        found = self.retriever.neighbor_tokens(conversation.tolist())
        r = self.retriever
        neighbours = np.full(
            (self.num_chunks, r.num_neighbors, r.retrieved_length),
            r.database.eod_token_id,
            dtype=np.int64,
        )
        neighbours[: len(found)] = found  # the padding's chunks: end-of-document rows
        sample["neighbor_tokens"] = neighbours
        return sample


def open_sft_retriever(args: Args, tokenizer: Any) -> Any:
    """The project's retriever for the model being trained, as mg-eval qa opens it."""
    from mg.core.retro.project import RetroProjectError  # lazy: Retro --sft runs only
    from mg.core.retro.retrieval import open_retriever
    from mg.indexed_dataset import IndexedDataset

    r = args.retro
    chunk_length = int(read_project_config(r.retro_project_dir)["retro_gpt_chunk_length"])
    try:
        return open_retriever(
            r.retro_project_dir,
            tokenizer,
            chunk_length,
            r.retro_num_neighbors,
            r.retro_num_retrieved_chunks,
            IndexedDataset,
        )
    except RetroProjectError as err:
        raise ArgumentError(f"--sft: {err}") from None


def retro_sft_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    """(train, valid, test): the `--data-path` conversations of each split, one a sample,
    with the neighbours the project's index gives their chunks."""
    packed = sft_datasets(args, [None, None, None])  # the data's checks and splits
    retriever = None
    out = []
    for split, (data, wanted) in enumerate(zip(packed, num_samples, strict=True)):
        if data is None or wanted == 0:
            out.append(None)
            continue
        if retriever is None:  # one retriever, one cache, for every split
            retriever = open_sft_retriever(args, tokenizer)
        samples = ConversationSamples.of(data, max(wanted, 1), args.training.seed + split)
        out.append(RetroConversations(samples, retriever))
    return tuple(out)
