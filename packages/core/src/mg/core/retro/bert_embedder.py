"""A BERT checkpoint (``mg-train bert``, or a Hugging Face BERT through ``mg-convert``)
as a text embedder: Retro embeds its chunks with it, ICT starts both towers from it.

A text's embedding is what Megatron's ``BertEmbedder`` computes: the text in
WordPiece ids, cut to ``max_length - 2``, framed by [CLS] and [SEP]; the mean of
the encoder's last hidden states over the tokens between them (an empty text is
one [PAD] token, Megatron's stand-in). Texts are batched longest-first so that a
batch holds texts of similar length, and the rows come back in input order.

With ``normalize`` each embedding is scaled to unit length, so that inner products
are cosine similarities. Retro searches by inner product and needs this: a mean
over few tokens is longer than a mean over many (their directions do not cancel),
so over raw means the one-token tail chunks ("." at a document's end) are every
query's best inner product.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mg.core.checkpoint import CheckpointError, load_checkpoint
from mg.core.checkpoint.model_io import resolve_tokenizer_paths
from mg.core.models.bert import BertModel
from mg.core.models.config import TransformerConfig
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.core.tokenizers.base import BaseTokenizer

# Weights a BERT checkpoint may lack (MiniLM has no MLM head) or hold without the heads
# they belong to (MiniLM's pooler without a binary head); the encoder needs none of them.
_HEAD_PREFIXES = ("lm_head.", "output_layer.", "pooler.", "binary_head.")


class BertCheckpointError(ValueError):
    """A checkpoint that cannot embed text: not a BERT, or not this vocabulary."""


@dataclass
class BertCheckpoint:
    """A BERT encoder from a checkpoint, its config and the tokenizer it records (if any)."""

    model: BertModel
    config: TransformerConfig
    tokenizer_config: TokenizerConfig | None
    load_dir: Path


def load_bert_checkpoint(load_dir: str | Path, flag: str = "--load") -> BertCheckpoint:
    """The BertModel of a single-shard BERT checkpoint, fp32, eval mode, on the CPU.

    Heads the encoder does not use may be missing; anything else that does not
    fit the recorded config, or a checkpoint that is not a BERT, is refused by a
    one-line :class:`BertCheckpointError` naming ``flag``.
    """
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise BertCheckpointError(f"{flag} {load_dir}: no such checkpoint folder")
    try:
        state, _ = load_checkpoint(load_dir)
    except CheckpointError as err:
        raise BertCheckpointError(f"{flag} {load_dir}: {err}") from None
    meta = state.get("mg") or {}
    if not meta.get("model_config"):
        raise BertCheckpointError(
            f"{flag} {load_dir}: the checkpoint records no model config (not written by mg tools)"
        )
    weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
    if "embedding.word_embeddings.weight" not in weights or not any(
        k.startswith("encoder.layers.") for k in weights
    ):
        raise BertCheckpointError(
            f"{flag} {load_dir}: not a BERT checkpoint (no encoder.layers weights); give one "
            "from `mg-train bert` or `mg-convert import-hf` of a BertModel"
        )
    config = TransformerConfig.from_dict(dict(meta["model_config"]))
    config.hidden_dropout = config.attention_dropout = 0.0
    tokentypes = weights.get("embedding.tokentype_embeddings.weight")
    model = BertModel(
        config,
        add_binary_head="binary_head.weight" in weights,
        num_tokentypes=0 if tokentypes is None else tokentypes.shape[0],
    )
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise BertCheckpointError(f"{flag} {load_dir}: weights do not fit: {first}") from None
    missing = [k for k in missing if not k.startswith(_HEAD_PREFIXES)]
    unexpected = [k for k in unexpected if not k.startswith(_HEAD_PREFIXES)]
    if missing or unexpected:
        raise BertCheckpointError(
            f"{flag} {load_dir}: weights do not fit the recorded config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    tokenizer_config = None
    if meta.get("tokenizer_config"):
        tokenizer_config = resolve_tokenizer_paths(
            TokenizerConfig.from_dict(dict(meta["tokenizer_config"])), load_dir
        )
    return BertCheckpoint(model.float().eval(), config, tokenizer_config, load_dir)


def vocabulary_mismatch(
    tokenizer: BaseTokenizer, checkpoint: BertCheckpoint, flag: str = "--load"
) -> str | None:
    """Why ``checkpoint`` cannot embed text in ``tokenizer``'s ids, or None when it can.

    The model's embedding table must cover the ids text is tokenized into, and where the
    checkpoint records its own tokenizer, the two must give every id the same
    token.
    """
    rows = checkpoint.model.embedding.word_embeddings.weight.shape[0]
    where = f"{flag} {checkpoint.load_dir}"
    # tokens the tokenizer adds past its vocabulary ([BOS], [EOS]) never come out of text
    added = {tokenizer.bos, tokenizer.eos, *tokenizer.additional_special_tokens_ids}
    if set(range(rows, tokenizer.vocab_size)) - added:
        return (
            f"{where} embeds {rows} token ids but the database's BERT tokenizer has "
            f"{tokenizer.vocab_size}; give the BERT checkpoint trained on that vocabulary"
        )
    if checkpoint.tokenizer_config is None:
        return None
    own = build_tokenizer(checkpoint.tokenizer_config)
    if own.vocab_size != tokenizer.vocab_size:
        return (
            f"{where} was trained with a {own.vocab_size}-token vocabulary, the database's BERT "
            f"tokenizer has {tokenizer.vocab_size}; give the matching --retro-bert-vocab-file "
            "or BERT checkpoint"
        )
    for i in range(own.vocab_size):
        if own.id_to_token(i) != tokenizer.id_to_token(i):
            return (
                f"{where} was trained with another vocabulary than the database's BERT tokenizer "
                f"(id {i} is {own.id_to_token(i)!r} there, {tokenizer.id_to_token(i)!r} here); "
                "give the matching --retro-bert-vocab-file or BERT checkpoint"
            )
    return None


class BertEmbedder:
    """Texts → float32 embeddings [n, hidden] with a BERT encoder, batch by batch, on the
    device the model is on (move the model to a GPU to embed there)."""

    def __init__(
        self,
        model: BertModel,
        tokenizer: BaseTokenizer,
        max_length: int = 256,
        batch_size: int = 128,
        normalize: bool = False,
    ) -> None:
        if max_length < 3:
            raise ValueError(f"max_length must leave room for [CLS] x [SEP], got {max_length}")
        for special in ("cls", "sep", "pad"):
            if getattr(tokenizer, special, None) is None:
                raise ValueError(f"the tokenizer {tokenizer.name} has no [{special.upper()}] token")
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = min(max_length, model.config.max_position_embeddings)
        self.batch_size = batch_size
        self.normalize = normalize

    @property
    def dimension(self) -> int:
        return self.model.config.hidden_size

    def token_ids(self, text: str) -> list[int]:
        """[CLS] + the text's ids (cut to fit) + [SEP], as Megatron's BertEmbeddingDataset."""
        ids = self.tokenizer.tokenize(text.replace("<|endoftext|>", ""))[: self.max_length - 2]
        return [self.tokenizer.cls, *(ids or [self.tokenizer.pad]), self.tokenizer.sep]

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        sequences = [self.token_ids(t) for t in texts]
        order = sorted(range(len(texts)), key=lambda i: -len(sequences[i]))
        for first in range(0, len(order), self.batch_size):
            rows = order[first : first + self.batch_size]
            out[rows] = self._embed_batch([sequences[i] for i in rows])
        return out

    def _embed_batch(self, sequences: list[list[int]]) -> np.ndarray:
        longest = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), longest), self.tokenizer.pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        device = self.model.embedding.word_embeddings.weight.device  # where the model lives
        ids, mask = ids.to(device), mask.to(device)
        hidden = self.model.encode(ids, mask).float()
        # the mean over the text's tokens: [CLS] (position 0) and [SEP] (the last) left out
        inner = mask.clone()
        inner[:, 0] = 0
        inner[torch.arange(len(sequences)), mask.sum(1) - 1] = 0
        weights = inner.unsqueeze(-1).to(hidden.dtype)
        means = (hidden * weights).sum(1) / weights.sum(1)
        if self.normalize:
            means = torch.nn.functional.normalize(means, dim=-1)
        return means.cpu().numpy()
