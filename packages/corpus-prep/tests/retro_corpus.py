"""Test data for `mg-prep retro`: a real English text as an indexed dataset, a small random
BERT and the real MiniLM BERT as checkpoints, and the command line that ties them together."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mg.core.checkpoint.model_io import save_model
from mg.core.fixtures import fixture_path, gpt2_bpe_tokenizer_config
from mg.core.models.bert import BertModel
from mg.core.models.config import TransformerConfig
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.indexed_dataset import IndexedDatasetBuilder


def botchan_documents(first: int = 0, count: int | None = None, lines: int = 12) -> list[str]:
    """Soseki's Botchan (public domain), ``lines`` lines of it per document."""
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8-sig")
    rows = [r.strip() for r in text.splitlines() if r.strip()]
    docs = [" ".join(rows[i : i + lines]) for i in range(0, len(rows), lines)]
    return docs[first : None if count is None else first + count]


def write_dataset(prefix: Path, documents: list[str]) -> str:
    """GPT-2 BPE token ids of each document + <|endoftext|>, as mg-prep tokenize writes them."""
    tokenizer = build_tokenizer(gpt2_bpe_tokenizer_config())
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetBuilder(f"{prefix}.bin", np.uint16) as builder:
        for doc in documents:
            ids = [*tokenizer.tokenize(doc), tokenizer.eod]
            builder.add_document(ids, [len(ids)])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def bert_vocab() -> str:
    return str(fixture_path("minilm-bert", "vocab.txt"))


def tiny_bert(folder: Path, vocab_file: str | None = None, seed: int = 0) -> str:
    """A 2-layer random BERT over the MiniLM WordPiece vocabulary (fast to run)."""
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=30592,
        seq_length=128,
        max_position_embeddings=128,
        transformer_layer_order="post_ln",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = BertModel(config, add_binary_head=True, num_tokentypes=2)
    tokenizer = TokenizerConfig("BertWordPieceLowerCase", vocab_file=vocab_file or bert_vocab())
    save_model(folder, model, config, tokenizer)
    return str(folder)


def minilm_bert(folder: Path, num_layers: int = 6) -> str:
    """The real MiniLM-L6 weights (FIXTURES.md) as an mg BERT checkpoint (no MLM head);
    with ``num_layers`` < 6 only the first layers (real weights, cheaper to run)."""
    import json

    from safetensors.torch import load_file

    from mg.core.models.bert import bert_config_from_hf, bert_state_dict_from_hf

    hf_config = json.loads(fixture_path("minilm-bert", "config.json").read_text())
    config = bert_config_from_hf(hf_config, num_layers=num_layers)
    weights = bert_state_dict_from_hf(
        load_file(fixture_path("minilm-bert", "model.safetensors")), config
    )
    tokenizer = TokenizerConfig("BertWordPieceLowerCase", vocab_file=bert_vocab())
    save_model(folder, weights, config, tokenizer)
    return str(folder)


def retro_argv(project: Path, data: list[str], bert: str, **flags: object) -> list[str]:
    """`mg-prep retro` arguments for a small project; keyword flags override (None drops)."""
    gpt = gpt2_bpe_tokenizer_config()
    values: dict[str, object] = {
        "retro-project-dir": project,
        "retro-tasks": "build",
        "retro-gpt-tokenizer-type": "GPT2BPETokenizer",
        "retro-gpt-vocab-file": gpt.vocab_file,
        "retro-gpt-merge-file": gpt.merge_file,
        "retro-gpt-split": "90,10,0",
        "retro-gpt-seq-length": 128,
        "retro-gpt-chunk-length": 32,
        "retro-gpt-train-samples": 16,
        "retro-gpt-global-batch-size": 4,
        "retro-gpt-eval-interval": 4,
        "retro-gpt-eval-iters": 1,
        "load": bert,
        "retro-bert-max-chunk-length": 64,
        "retro-bert-batch-size": 32,
        "retro-block-size": 200,
        "retro-doc-block-size": 40,
        "retro-index-str": "Flat",
        "retro-index-ntrain": 100,
        "retro-query-num-neighbors-query": 40,
        "retro-query-num-neighbors-save": 4,
    }
    for key, value in flags.items():
        values[key.replace("_", "-")] = value
    argv = ["retro", "--retro-gpt-data-path", *data]
    for key, value in values.items():
        if value is not None:
            argv += [f"--{key}", str(value)]
    return argv
