"""`mg-train retro`: a Retro model (Megatron's pretrain_retro.py) on a `mg-prep retro` project.

The config is the GPT family's plus the Retro fields (arguments/retro.py, the chunk
length from the project). A sample is a GPT sample of the data the project was
queried for (its data path, split, seed and sequence length, and its sample counts,
so sample i here is the project's sample i) plus `neighbor_tokens` [l, k, r]: for
each of its l chunks the first k saved neighbours, each with its continuation, read
from the project's chunk database (`mg.core.retro`; a missing neighbour reads as
end-of-document tokens). A run that reads more samples than the project queried
cycles over them, as Megatron's cyclic Retro training does. Loss: GPT's masked
per-token cross entropy, logged as `lm loss`.

With `--sft` (InstructRetro) the samples are `mg-prep sft` conversations instead, with
the neighbours retrieved for them as generation retrieves them (retro_sft_data.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from mg.core.models import TransformerConfig
from mg.core.models.retro import RetroConfig, RetroModel
from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.arguments.retro import read_project_config
from mg.trainer.family_gpt import gpt_config
from mg.trainer.retro_sft_data import retro_sft_datasets


def retro_config(args: Args, vocab_size: int) -> RetroConfig:
    """GPT's config with the Retro encoder and chunked cross-attention fields."""
    if args.checkpoint_model_config is not None:
        return RetroConfig.from_dict(dict(args.checkpoint_model_config))
    r = args.retro
    project = read_project_config(r.retro_project_dir)
    base = gpt_config(args, vocab_size)
    shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig)}
    return RetroConfig(
        **shared,
        retro_chunk_length=int(project["retro_gpt_chunk_length"]),
        retro_encoder_num_layers=r.retro_encoder_layers,
        retro_encoder_hidden_dropout=r.retro_encoder_hidden_dropout,
        retro_encoder_attention_dropout=r.retro_encoder_attention_dropout,
        retro_num_neighbors=r.retro_num_neighbors,
        retro_num_retrieved_chunks=r.retro_num_retrieved_chunks,
        retro_attention_gate=r.retro_attention_gate,
    )


def retro_model(config: RetroConfig, args: Args | None = None) -> nn.Module:
    return RetroModel(config)


class RetroSampleDataset:
    """The project's GPT samples of one split, each with its chunks' neighbour tokens."""

    def __init__(
        self,
        samples: Any,
        neighbors: np.ndarray,
        database: Any,
        size: int,
        num_neighbors: int,
        num_retrieved_chunks: int,
    ) -> None:
        self.samples, self.database, self.size = samples, database, size
        self.chunks_per_sample = len(samples[0]["tokens"]) // database.chunk_length
        self.queried = len(neighbors) // self.chunks_per_sample
        self.neighbors = neighbors[: self.queried * self.chunks_per_sample, :num_neighbors]
        self.num_retrieved_chunks = num_retrieved_chunks

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample_index = int(index) % self.queried  # cyclic over the queried samples
        sample = dict(self.samples[sample_index])
        first = sample_index * self.chunks_per_sample
        rows = self.neighbors[first : first + self.chunks_per_sample]
        sample["neighbor_tokens"] = np.stack(
            [self.database.retrieved_tokens(ids, self.num_retrieved_chunks) for ids in rows]
        )
        return sample


def retro_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    """(train, valid, test): the project's queried samples with their neighbours; with
    --sft, the conversations with theirs."""
    if args.sft.sft:
        return retro_sft_datasets(args, tokenizer, num_samples)
    from mg.core.retro.chunk_db import ChunkDatabase  # lazy: Retro runs only
    from mg.core.retro.files import load_array, read_json
    from mg.core.retro.project import SPLITS, ProjectPaths, RetroProjectError, read_neighbors
    from mg.indexed_dataset import (
        GPTDatasetConfig,
        IndexedDataset,
        build_gpt_datasets,
        samples_per_split,
    )

    r = args.retro
    paths = ProjectPaths.of(r.retro_project_dir)
    project = read_project_config(r.retro_project_dir)
    counts = samples_per_split(
        global_batch_size=project["retro_gpt_global_batch_size"],
        eval_interval=project["retro_gpt_eval_interval"],
        eval_iters=project["retro_gpt_eval_iters"],
        train_samples=project["retro_gpt_train_samples"],
    )
    config = GPTDatasetConfig(
        seq_length=project["retro_gpt_seq_length"],
        seed=project["retro_gpt_seed"],
        split=project["retro_gpt_split"],
        path_to_cache=str(paths.root / "gpt_cache"),
        eod_token_id=tokenizer.eod,
        pad_token_id=tokenizer.pad,
    )
    words = list(project["retro_gpt_data_path"])
    if len(words) == 2:  # one dataset, as the project's query read it
        words = words[1:]
    samples = build_gpt_datasets(words, counts, config)
    try:
        infos = read_json(paths.datasets)
        sources = [IndexedDataset(info["prefix"]) for info in infos]
        database = ChunkDatabase(
            load_array(paths.chunks, mmap=True),
            sources,
            int(project["retro_gpt_chunk_length"]),
            tokenizer.eod,
        )
    except (OSError, KeyError, ValueError) as err:
        raise ArgumentError(f"--retro-project-dir {paths.root}: {err}") from None
    out = []
    for split, dataset, wanted in zip(SPLITS, samples, num_samples, strict=True):
        if dataset is None or wanted == 0 or not paths.query_manifest(split).is_file():
            out.append(None)
            continue
        try:
            neighbors = read_neighbors(paths, split)
        except RetroProjectError as err:
            raise ArgumentError(str(err)) from None
        chunks = config.seq_length // database.chunk_length
        queried = len(neighbors) // chunks
        verify = r.retro_verify_neighbor_count and r.retro_cyclic_train_iters is None
        if queried < wanted and verify and split == "train":
            raise ArgumentError(
                f"--retro-project-dir {paths.root}: {queried} {split} samples have neighbours, "
                f"the run reads {wanted}; query more (--retro-gpt-train-samples) or pass "
                "--retro-no-verify-neighbor-count (or --retro-cyclic-train-iters) to cycle "
                "over them"
            )
        out.append(
            RetroSampleDataset(
                dataset,
                neighbors,
                database,
                max(wanted, 1),
                r.retro_num_neighbors,
                r.retro_num_retrieved_chunks,
            )
        )
    return tuple(out)


def retro_loss_terms(model: nn.Module, batch: dict[str, torch.Tensor]):
    """Masked sum of the per-token loss and its token count; the neighbours [b, l, k, r]
    go in Megatron's [b·l·k, r] order."""
    neighbours = batch["neighbor_tokens"]
    losses = model(
        batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        context_input_ids=neighbours.reshape(-1, neighbours.shape[-1]),
        labels=batch["labels"],
    )
    mask = batch["loss_mask"].float()
    return (losses.float() * mask).sum(), mask.sum()
