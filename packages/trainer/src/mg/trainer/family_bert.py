"""`mg-train bert`: Megatron's pretrain_bert.py on `_text_sentence` data.

Loss (Megatron's `loss_func`): the masked-LM loss, a mean over the masked
positions (`loss_mask`), plus, with the binary head (default; off with
`--bert-no-binary-head`), the sentence-order loss: cross entropy of the binary
logits against `is_random`, a mean over the micro-batch. Both are logged,
as `lm loss` and `sop loss`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mg.core.models import BertModel
from mg.indexed_dataset import IndexedDataset
from mg.indexed_dataset.bert_dataset import BertDataset
from mg.indexed_dataset.blend_builder import BlendBuilder, as_blend
from mg.indexed_dataset.masking import MaskingConfig
from mg.indexed_dataset.split import (
    check_prefixes_exist,
    parse_split,
    read_blend_file,
    split_matrix,
    split_range,
)
from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.family_gpt import gpt_config
from mg.trainer.model_parallel import PipelineSteps


def masked_lm_config(args: Args, vocab_size: int, **extra: Any):
    """The GPT flags onto `TransformerConfig` (BERT and T5 share them), plus `extra`."""
    d = args.data
    if d.mock_data or not (d.data_path or d.data_args_path):
        raise ArgumentError(
            f"mg-train {args.family} needs --data-path of a sentence-split dataset "
            "(mg-prep tokenize --split-sentences); --mock-data is GPT only"
        )
    tp = args.distributed.tensor_model_parallel_size
    if args.distributed.sequence_parallel:
        lengths = [("--seq-length", args.model.seq_length)]
        lengths.append(("--decoder-seq-length", extra.get("decoder_seq_length")))
        for flag, length in lengths:
            if length and length % tp:
                raise ArgumentError(
                    f"--sequence-parallel: {flag} ({length}) is not divisible by "
                    f"--tensor-model-parallel-size ({tp})"
                )
    config = gpt_config(args, vocab_size)
    if args.checkpoint_model_config is not None or not extra:
        return config
    return dataclasses.replace(config, **extra)


def bert_config(args: Args, vocab_size: int):
    return masked_lm_config(args, vocab_size)


def bert_model(config, args: Args | None = None) -> nn.Module:
    binary_head = True if args is None else args.model.bert_binary_head
    return BertModel(config, add_binary_head=binary_head)


def build_masked_datasets(
    args: Args, tokenizer: Any, num_samples: Sequence[int], dataset_class: type, **kwargs: Any
) -> tuple[Any, Any, Any]:
    """Train/valid/test datasets of `_text_sentence` prefixes, each split by documents.

    `--data-path` takes one prefix or a blend (`w1 P1 w2 P2 ...`, or a blend
    file via `--data-args-path`), mixed as Megatron's BlendedMegatronDatasetBuilder
    mixes them for GPT."""
    d = args.data
    blend = read_blend_file(d.data_args_path) if d.data_args_path else as_blend(d.data_path)
    check_prefixes_exist(blend)
    default = dataset_class.default_masking()
    masking = MaskingConfig(
        masking_probability=d.mask_prob,
        short_sequence_probability=d.short_seq_prob,
        masking_max_ngram=default.masking_max_ngram,
        masking_do_full_word=default.masking_do_full_word,
        masking_use_longer_ngrams=default.masking_use_longer_ngrams,
        masking_use_geometric_distribution=default.masking_use_geometric_distribution,
    )
    cache = d.data_cache_path
    index_cache = None if cache is None else f"{cache}/{dataset_class.__name__}_indices"

    def splits_of(prefix: str, bookends, counts) -> list[Any]:
        source = IndexedDataset(prefix)
        num_documents = len(source.document_indices) - 1
        out: list[Any] = []
        for name, ends, count in zip(("train", "valid", "test"), bookends, counts, strict=True):
            documents = split_range(ends, num_documents) if ends is not None else []
            if len(documents) == 0 or count == 0:
                out.append(None)
                continue
            out.append(
                dataset_class(
                    source,
                    prefix,
                    documents,
                    count,
                    args.model.seq_length,
                    tokenizer,
                    masking=masking,
                    seed=args.training.seed,
                    cache_dir=index_cache,
                    split_name=name,
                    **kwargs,
                )
            )
        return out

    builder = BlendBuilder(splits_of, surplus=0.005, cache_dir=cache)
    train, valid, test = builder.blend_split(
        blend, split_matrix(parse_split(d.split)), list(num_samples)
    )
    return train, valid, test


def bert_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    return build_masked_datasets(
        args, tokenizer, num_samples, BertDataset, classification_head=args.model.bert_binary_head
    )


def bert_loss_terms(model: nn.Module, batch: dict[str, torch.Tensor]):
    """(masked LM loss sum, masked tokens, {"sop loss": mean CE}) of one micro-batch."""
    output = model(
        batch["text"],
        attention_mask=batch["padding_mask"],
        tokentype_ids=batch["types"],
        lm_labels=batch["labels"].clamp(min=0),  # -1 where not masked; the mask drops them
    )
    return bert_output_loss_terms(output, batch)


def bert_output_loss_terms(output: tuple, batch: dict[str, torch.Tensor]):
    """The loss terms of the model's (or last pipeline stage's) (per-token loss, binary logits)."""
    losses, binary_logits = output
    mask = batch["loss_mask"].float()
    extra: dict[str, torch.Tensor] = {}
    if binary_logits is not None:
        extra["sop loss"] = F.cross_entropy(binary_logits.float(), batch["is_random"].long())
    return (losses.float() * mask).sum(), mask.sum(), extra


def bert_stage_forward(chunk: nn.Module, received: torch.Tensor | None, batch: dict):
    """A BERT pipeline chunk's forward: every stage masks padding, the last one scores."""
    return chunk(
        received if received is not None else batch["text"],
        batch["padding_mask"],
        batch["types"],
        batch["labels"].clamp(min=0) if chunk.is_last else None,
    )


def bert_extra_losses(args: Args) -> tuple[str, ...]:
    return ("sop loss",) if args.model.bert_binary_head else ()


BERT_PIPELINE_STEPS = PipelineSteps(
    "text", bert_stage_forward, bert_output_loss_terms, bert_extra_losses
)


# --- --dry-run ---------------------------------------------------------------------------------

# Weights and column-parallel biases that tensor parallelism shards (Megatron's layout; the
# row-parallel layers' biases, norms, position/token-type embeddings and BERT's heads are
# replicated).
