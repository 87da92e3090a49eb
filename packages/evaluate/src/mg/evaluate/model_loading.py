"""Checkpoint → (model, tokenizer), for every mg-eval task.

GPT checkpoints load through core's ``load_model``; BERT checkpoints (mg-train
bert, or a Hugging Face BERT through mg-convert import-hf) through
:func:`load_bert_for_finetune`, which rebuilds the BertModel the weights describe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mg.core.checkpoint import CheckpointError, find_rank_file, load_checkpoint
from mg.core.checkpoint.model_io import load_model
from mg.core.checkpoint.model_part import load_model_part
from mg.core.checkpoint.torch_format import iteration_dir, resolve_iteration
from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.bert import BertModel, bert_from_state_dict
from mg.core.models.vocab_mask import set_real_vocab_size, unpadded_vocab_size
from mg.core.parallel.layout import ParallelLayout
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError
from mg.evaluate.model_parallel import layout_errors

TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


@dataclass
class LoadedModel:
    model: GPTModel
    config: TransformerConfig
    tokenizer: BaseTokenizer
    iteration: Any


def load_for_eval(
    load_dir: str | Path,
    iteration: int | str | None = None,
    tokenizer_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """The checkpoint's model in eval mode (fp32, CPU or the first GPU) and its tokenizer.

    ``tokenizer_overrides`` (from ``--tokenizer-type`` / ``--vocab-file`` / ...)
    replace the fields the checkpoint recorded; a checkpoint without a tokenizer
    needs ``--tokenizer-type`` and its files.
    """
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise EvalInputError("no such checkpoint folder (--load)", load_dir)
    model, config, tok_config, info = load_model(load_dir, iteration)
    tokenizer = eval_tokenizer(tok_config, tokenizer_overrides, load_dir, config.vocab_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=torch.float32).eval()
    # Megatron's padding rows take no probability
    set_real_vocab_size(model, unpadded_vocab_size(config, tokenizer.vocab_size))
    return LoadedModel(model, config, tokenizer, info.iteration)


def load_part_for_eval(
    load_dir: str | Path,
    layout: ParallelLayout,
    iteration: int | str | None = None,
    tokenizer_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """This rank's part of the checkpoint's GPT in a tensor/pipeline-parallel ``layout``
    (fp32, eval mode): the model's TP shards, or its pipeline stage. Only that part is
    read from the checkpoint (core's ``load_model_part``)."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise EvalInputError("no such checkpoint folder (--load)", load_dir)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    with layout_errors():
        part = load_model_part(load_dir, layout, iteration, device=device, dtype=torch.float32)
    tokenizer = eval_tokenizer(
        part.tokenizer_config, tokenizer_overrides, load_dir, part.config.vocab_size
    )
    # Megatron's padding rows take no probability
    set_real_vocab_size(part.module, unpadded_vocab_size(part.config, tokenizer.vocab_size))
    return LoadedModel(part.module, part.config, tokenizer, part.info.iteration)


@dataclass
class LoadedBert:
    model: BertModel
    config: TransformerConfig
    tokenizer: BaseTokenizer
    iteration: Any


def load_bert_for_finetune(
    load_dir: str | Path,
    iteration: int | str | None = None,
    tokenizer_overrides: dict[str, Any] | None = None,
    config_overrides: dict[str, Any] | None = None,
    flag: str = "--pretrained-checkpoint",
) -> LoadedBert:
    """The BertModel of a BERT checkpoint (fp32, train mode) and its tokenizer.

    ``config_overrides`` (``--hidden-dropout``, ``--attention-dropout``) change
    the recorded config before the model is built. A GPT checkpoint is refused
    by name: the RACE/GLUE recipes finetune a bidirectional encoder."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise EvalInputError(f"no such checkpoint folder ({flag})", load_dir)
    iteration = resolve_iteration(load_dir, iteration)
    path, layout = find_rank_file(iteration_dir(load_dir, iteration))
    if layout.tp * layout.pp * layout.ep != 1:
        raise CheckpointError(
            f"{load_dir} was saved with {layout}; BERT finetuning reads single-shard "
            "checkpoints (TP=1 PP=1)"
        )
    state, iteration = load_checkpoint(load_dir, iteration)
    meta = state.get("mg") or {}
    if not meta.get("model_config"):
        raise EvalInputError(
            "the checkpoint records no model config; it was not written by mg tools", path
        )
    weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
    if "lm_head.dense.weight" not in weights or not any(
        k.startswith("encoder.layers.") for k in weights
    ):
        raise EvalInputError(
            "not a BERT checkpoint (no encoder.layers / lm_head weights); RACE, MNLI and QQP "
            "finetune a BERT (mg-train bert, or mg-convert import-hf of a BertModel)",
            path,
        )
    config = TransformerConfig.from_dict(dict(meta["model_config"]))
    for name, value in (config_overrides or {}).items():
        if value is not None:
            setattr(config, name, value)
    try:
        model = bert_from_state_dict(weights, config)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: weights do not fit the recorded config: {exc}") from None
    tok_config = None
    if meta.get("tokenizer_config"):
        tok_config = TokenizerConfig.from_dict(dict(meta["tokenizer_config"]))
    tokenizer = eval_tokenizer(
        tok_config, tokenizer_overrides, load_dir, config.vocab_size, text_only=True
    )
    for special in ("cls", "sep", "pad"):
        if getattr(tokenizer, special, None) is None or getattr(tokenizer, special) < 0:
            raise EvalInputError(
                f"the tokenizer {tokenizer.name} has no [{special.upper()}] token; BERT tasks "
                "need a WordPiece tokenizer (--tokenizer-type BertWordPieceLowerCase --vocab-file)"
            )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=torch.float32)
    return LoadedBert(model, config, tokenizer, iteration)


def eval_tokenizer(
    tok_config: TokenizerConfig | None,
    tokenizer_overrides: dict[str, Any] | None,
    load_dir: Path,
    model_vocab_size: int,
    text_only: bool = False,
) -> BaseTokenizer:
    """The recorded tokenizer with the ``--tokenizer-*`` overrides applied, checked
    against the model's vocabulary.

    `text_only`: the model only ever sees tokenized text between [CLS] and [SEP] (BERT
    tasks, ICT), so the ids WordPiece adds past its vocabulary ([BOS], [EOS], extra ids)
    may lie past the embedding table (a BERT imported from Hugging Face has none of
    them), as the Retro chunk embedder allows."""
    overrides = {k: v for k, v in (tokenizer_overrides or {}).items() if v is not None}
    if tok_config is None:
        if "tokenizer_type" not in overrides:
            raise EvalInputError(
                "the checkpoint records no tokenizer; give --tokenizer-type and its files "
                "(--vocab-file/--merge-file or --tokenizer-model)",
                load_dir,
            )
        tok_config = TokenizerConfig(**overrides)
    elif overrides:
        tok_config = dataclasses.replace(tok_config, **overrides)
    _resolve_relative(tok_config, load_dir)
    try:
        tokenizer = build_tokenizer(tok_config)
    except (ValueError, OSError) as exc:
        raise EvalInputError(f"cannot build the tokenizer: {exc}") from None
    beyond = set(range(model_vocab_size, tokenizer.vocab_size))
    if text_only:
        beyond -= {tokenizer.bos, tokenizer.eos, *tokenizer.additional_special_tokens_ids}
    if beyond:
        raise EvalInputError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{model_vocab_size}; wrong --tokenizer-type/--vocab-file?"
        )
    return tokenizer


def _resolve_relative(config: TokenizerConfig, root: Path) -> None:
    """Paths recorded relative to the checkpoint folder (what mg-convert writes) resolve there."""
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        value = getattr(config, name)
        if value and not Path(value).exists() and (root / value).exists():
            setattr(config, name, str(root / value))
