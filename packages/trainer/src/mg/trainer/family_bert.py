"""`mg-train bert`: Megatron's pretrain_bert.py on `_text_sentence` data.

Loss (Megatron's `loss_func`): the masked-LM loss, a mean over the masked
positions (`loss_mask`), plus, with the binary head (default; off with
`--bert-no-binary-head`), the sentence-order loss: cross entropy of the binary
logits against `is_random`, a mean over the micro-batch. Both are logged,
as `lm loss` and `sop loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mg.trainer.arguments import Args, ArgumentError


def masked_lm_config(args: Args, vocab_size: int, **extra: Any):
    """The GPT flags onto `TransformerConfig` (BERT and T5 share them), plus `extra`."""
    import dataclasses

    from mg.trainer.families import gpt_config

    d = args.data
    if d.mock_data or not (d.data_path or d.data_args_path):
        raise ArgumentError(
            f"mg-train {args.family} needs --data-path of a sentence-split dataset "
            "(mg-prep tokenize --split-sentences); --mock-data is GPT only"
        )
    config = gpt_config(args, vocab_size)
    if args.checkpoint_model_config is not None or not extra:
        return config
    return dataclasses.replace(config, **extra)


def bert_config(args: Args, vocab_size: int):
    return masked_lm_config(args, vocab_size)


def bert_model(config, args: Args | None = None) -> nn.Module:
    from mg.core.models import BertModel

    binary_head = True if args is None else args.model.bert_binary_head
    return BertModel(config, add_binary_head=binary_head)


def build_masked_datasets(
    args: Args, tokenizer: Any, num_samples: Sequence[int], dataset_class: type, **kwargs: Any
) -> tuple[Any, Any, Any]:
    """Train/valid/test datasets of one `_text_sentence` prefix, split by documents."""
    from mg.indexed_dataset import IndexedDataset
    from mg.indexed_dataset.masking import MaskingConfig
    from mg.indexed_dataset.split import parse_split, split_matrix, split_range

    d = args.data
    if not d.data_path:
        raise ArgumentError(f"mg-train {args.family} takes --data-path (one prefix)")
    prefixes = [p for p in d.data_path if not _is_number(p)]
    if len(prefixes) != 1:
        raise ArgumentError(
            f"mg-train {args.family} takes one --data-path prefix, got {len(prefixes)}"
        )
    prefix = prefixes[0]
    source = IndexedDataset(prefix)
    num_documents = len(source.document_indices) - 1
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
    out: list[Any] = []
    for name, ends, count in zip(
        ("train", "valid", "test"), split_matrix(parse_split(d.split)), num_samples, strict=True
    ):
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
                cache_dir=None if cache is None else f"{cache}/{dataset_class.__name__}_indices",
                split_name=name,
                **kwargs,
            )
        )
    return out[0], out[1], out[2]


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def bert_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    from mg.indexed_dataset.bert_dataset import BertDataset

    return build_masked_datasets(
        args, tokenizer, num_samples, BertDataset, classification_head=args.model.bert_binary_head
    )


def bert_loss_terms(model: nn.Module, batch: dict[str, torch.Tensor]):
    """(masked LM loss sum, masked tokens, {"sop loss": mean CE}) of one micro-batch."""
    mask = batch["loss_mask"].float()
    losses, binary_logits = model(
        batch["text"],
        attention_mask=batch["padding_mask"],
        tokentype_ids=batch["types"],
        lm_labels=batch["labels"].clamp(min=0),  # -1 where not masked; the mask drops them
    )
    extra: dict[str, torch.Tensor] = {}
    if binary_logits is not None:
        extra["sop loss"] = F.cross_entropy(binary_logits.float(), batch["is_random"].long())
    return (losses.float() * mask).sum(), mask.sum(), extra
