"""`mg-train ict`: REALM's Inverse Cloze Task on a BERT bi-encoder (Megatron's pretrain_ict.py).

The model is `mg.core.models.biencoder.BiEncoderModel`; with `--bert-load` its
config is that BERT checkpoint's and both towers start from its encoder (the
model flags must then agree with it or be left out), otherwise it is built from
the model flags with Megatron's init. The bi-encoder's own settings
(`--biencoder-projection-dim`, `--biencoder-shared-query-context-model`,
`--retriever-score-scaling`) are kept in the config's ``extra["biencoder"]`` so
that a checkpoint rebuilds the same model. Data: `ICTDataset` over the
sentence-split `--data-path`, titles from `--titles-data-path`, split by documents
with `--split`. Loss: each query against every block of the micro-batch (in-batch
negatives), cross entropy with its own block, logged as `lm loss`.

With data parallelism the negatives are the blocks of the global micro-batch, as
Megatron's pretrain_ict.py: each rank all-gathers the block embeddings of every
rank (`mg.core.parallel.data_parallel_gather`) and scores its own queries against
them. With P ranks of b pairs (N = P·b, rank r's pairs I_r) and ℓ_i the cross
entropy of query i against all N blocks, one process's loss on that micro-batch
is L = (1/N) Σ_i ℓ_i; rank r backpropagates the loop's mean over its queries,
L_r = (1/b) Σ_{i∈I_r} ℓ_i, so L = (1/P) Σ_r L_r. Only ℓ_i holds q_i:
∂L_r/∂q_i = P·∂L/∂q_i. Every L_s holds every block: the gather's backward sums
∂L_s/∂c_j over the ranks s onto the rank of c_j, P·∂L/∂c_j. So each rank's
weight gradient is P times the part of ∂L/∂θ that flows through its own rows, and
the average over the P ranks (DDP, or the distributed optimizer's reduce-scatter)
is ∂L/∂θ, the one-process gradient; over micro-batches the loop's / num_micro is
the same on both. The reported loss adds Σ_{i∈I_r} ℓ_i and b over ranks and
micro-batches: the one-process mean. (Megatron gathers the queries too, computes
the whole L on every rank times P, and its gather's backward keeps only this
rank's slice: the same gradient, with N×N scores on every rank instead of b×N.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mg.core.models.biencoder import BiEncoderModel, ict_loss, retrieval_scores
from mg.core.models.config import TransformerConfig
from mg.core.parallel.data_parallel_gather import gather_from_data_parallel
from mg.core.retro.bert_embedder import BertCheckpointError, load_bert_checkpoint
from mg.indexed_dataset import IndexedDataset
from mg.indexed_dataset.ict_dataset import ICTDataset
from mg.indexed_dataset.split import parse_split, split_matrix, split_range
from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.family_bert import masked_lm_config

_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")


def ict_config(args: Args, vocab_size: int) -> TransformerConfig:
    """The towers' BERT config (--bert-load's, or the model flags') with the bi-encoder's."""
    i = args.ict
    if args.checkpoint_model_config is not None:
        return TransformerConfig.from_dict(dict(args.checkpoint_model_config))
    if i.bert_load:
        try:
            bert = load_bert_checkpoint(i.bert_load, flag="--bert-load")
        except BertCheckpointError as err:
            raise ArgumentError(str(err)) from None
        config = bert.config
        for name in _SHAPE_FIELDS:
            given = getattr(args.model, name, None)
            if given is not None and given != getattr(config, name):
                raise ArgumentError(
                    f"--{name.replace('_', '-')} {given} differs from the {getattr(config, name)} "
                    f"of --bert-load {i.bert_load}; leave it out or give the same"
                )
        if args.model.seq_length > config.max_position_embeddings:
            raise ArgumentError(
                f"--seq-length {args.model.seq_length} is more than the "
                f"{config.max_position_embeddings} positions of --bert-load {i.bert_load}"
            )
        config = dataclasses.replace(
            config,
            hidden_dropout=args.model.hidden_dropout,
            attention_dropout=args.model.attention_dropout,
        )
    else:
        config = masked_lm_config(args, vocab_size)
    extra = dict(config.extra or {})
    extra["biencoder"] = {
        "projection_dim": i.biencoder_projection_dim,
        "shared": i.biencoder_shared_query_context_model,
        "score_scaling": i.retriever_score_scaling,
    }
    return dataclasses.replace(config, extra=extra)


def ict_model(config: TransformerConfig, args: Args | None = None) -> nn.Module:
    settings = (config.extra or {}).get("biencoder", {})
    model = BiEncoderModel(
        config,
        projection_dim=settings.get("projection_dim", 0),
        shared=settings.get("shared", False),
    )
    if args is not None and args.ict.bert_load and args.checkpoint_model_config is None:
        model.load_bert(
            load_bert_checkpoint(args.ict.bert_load, flag="--bert-load").model.state_dict()
        )
    return model


def ict_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    """Train/valid/test ICT datasets of one sentence-split prefix, split by documents."""
    words = args.data.data_path
    if len(words) != 1:
        raise ArgumentError("mg-train ict takes one --data-path prefix (no blend yet)")
    sentences = IndexedDataset(words[0])
    titles = IndexedDataset(args.ict.titles_data_path) if args.ict.titles_data_path else None
    out = []
    for ends, count in zip(split_matrix(parse_split(args.data.split)), num_samples, strict=True):
        documents = split_range(ends, sentences.num_documents) if ends is not None else []
        if len(documents) == 0 or not count:
            out.append(None)
            continue
        try:
            out.append(
                ICTDataset(
                    sentences,
                    documents,
                    count,
                    args.model.seq_length,
                    tokenizer,
                    titles=titles,
                    query_in_block_prob=args.ict.query_in_block_prob,
                    use_one_sent_docs=args.ict.use_one_sent_docs,
                    seed=args.training.seed,
                )
            )
        except ValueError as err:
            raise ArgumentError(f"--data-path {words[0]}: {err}") from None
    return tuple(out)


def _unwrapped(model: nn.Module) -> nn.Module:
    while not isinstance(model, BiEncoderModel):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def _data_parallel_group() -> dist.ProcessGroup | None:
    """The ranks whose blocks are each query's negatives: the world (ICT runs without model
    parallelism, arguments/ict.py), None in one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def ict_loss_terms(model: nn.Module, batch: dict[str, torch.Tensor]):
    """(ICT loss × queries, queries) of this rank's queries against the blocks of every
    data-parallel rank: the loop's mean over queries is the ICT loss (module doc)."""
    query, context = model(
        batch["query_tokens"],
        batch["query_pad_mask"],
        batch["context_tokens"],
        batch["context_pad_mask"],
    )
    first_block = 0
    group = _data_parallel_group()
    if group is not None:  # every rank, every micro-batch (training and validation) alike
        context = gather_from_data_parallel(context, group)
        first_block = dist.get_rank(group) * query.shape[0]
    config = _unwrapped(model).config
    scaling = (config.extra or {}).get("biencoder", {}).get("score_scaling", False)
    scores = retrieval_scores(query, context, config.hidden_size if scaling else None)
    count = torch.tensor(float(query.shape[0]), device=query.device)
    return ict_loss(scores, first_block) * count, count
