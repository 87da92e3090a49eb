"""Tiny randomly initialised transformers models saved to disk (FIXTURES.md: no hub).

Every parameter is perturbed so norms and biases (HF inits them to 1/0) are
not trivially equal; a small WordLevel tokenizer.json goes along.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 100  # not a multiple of 128: import pads, export slices


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["<unk>"] = 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


def build(kind: str):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    common = dict(
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    if kind == "gpt2":
        config = GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            n_positions=64,
            vocab_size=VOCAB,
            bos_token_id=1,
            eos_token_id=2,
            attn_implementation="eager",
        )
        model = GPT2LMHeadModel(config)
    elif kind == "llama3":
        config = LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            **common,
        )
        model = LlamaForCausalLM(config)
    elif kind == "mistral":
        config = MistralConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            tie_word_embeddings=False,
            **common,
        )
        model = MistralForCausalLM(config)
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save(kind: str, folder: Path, **save_kwargs) -> torch.nn.Module:
    model = build(kind)
    model.save_pretrained(folder, **save_kwargs)
    _tokenizer(folder)
    return model


@pytest.fixture
def make_hf():
    """make_hf(kind, folder, **save_pretrained_kwargs) → the transformers model it saved."""
    return save
