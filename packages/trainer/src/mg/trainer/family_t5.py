"""`mg-train t5`: Megatron's pretrain_t5.py on `_text_sentence` data.

`--encoder-seq-length` (or `--seq-length`) is the encoder's length and
`--decoder-seq-length` the decoder's; the tokenizer needs sentinels
(`--vocab-extra-ids 100`). Loss: the decoder's per-token cross entropy, a mean
over `loss_mask`, logged as `lm loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mg.core.models import T5Model
from mg.indexed_dataset.t5_dataset import T5Dataset
from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.family_bert import build_masked_datasets, masked_lm_config


def t5_config(args: Args, vocab_size: int):
    m = args.model
    if args.checkpoint_model_config is None and m.decoder_seq_length is None:
        raise ArgumentError("mg-train t5 needs --decoder-seq-length")
    if args.checkpoint_tokenizer_config is None and not args.data.vocab_extra_ids:
        raise ArgumentError("mg-train t5 needs sentinel tokens: add --vocab-extra-ids 100")
    if m.decoder_seq_length is not None and m.decoder_seq_length > m.max_position_embeddings:
        raise ArgumentError(
            f"--decoder-seq-length ({m.decoder_seq_length}) is longer than "
            f"--max-position-embeddings ({m.max_position_embeddings})"
        )
    return masked_lm_config(args, vocab_size, decoder_seq_length=m.decoder_seq_length)


def t5_model(config, args: Args | None = None) -> nn.Module:
    return T5Model(config)


def t5_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    return build_masked_datasets(
        args,
        tokenizer,
        num_samples,
        T5Dataset,
        decoder_sequence_length=args.model.decoder_seq_length,
    )


def t5_loss_terms(model: nn.Module, batch: dict[str, torch.Tensor]):
    """(decoder loss sum over loss_mask, tokens) of one micro-batch."""
    mask = batch["loss_mask"].float()
    losses = model(
        batch["text_enc"],
        batch["text_dec"],
        encoder_attn_mask=batch["enc_mask"],
        decoder_attn_mask=batch["dec_mask"],
        encoder_decoder_attn_mask=batch["enc_mask"],
        lm_labels=batch["labels"].clamp(min=0),  # -1 on padding; the mask drops it
    )
    return (losses.float() * mask).sum(), mask.sum()
