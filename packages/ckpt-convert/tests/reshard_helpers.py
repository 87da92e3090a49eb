"""Tiny GPT-2- and Llama-shaped checkpoints for the reshard/format tests."""

from __future__ import annotations

from pathlib import Path

import torch

from mg.core.checkpoint import load_checkpoint, mg_metadata, save_checkpoint_shards
from mg.core.checkpoint.model_io import load_model
from mg.core.models import GPTModel, TransformerConfig

GPT2 = TransformerConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=128,
    seq_length=16,
)
LLAMA = TransformerConfig(  # GQA (8 heads, 4 groups), SwiGLU, RMSNorm, rope, untied
    num_layers=4,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=96,
    vocab_size=128,
    seq_length=16,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA}
TOKENIZER = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tokenizer"}


def build(config: TransformerConfig) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    with torch.no_grad():  # norms and biases away from their 1/0 init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save_source(folder: Path, model: GPTModel, iteration: int | str = 7) -> dict:
    """A TP=1 PP=1 training checkpoint with optimizer, scheduler and RNG entries."""
    config = model.config
    state = {
        "model": model.state_dict(),
        "args": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "lr": 0.1},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}},
        "opt_param_scheduler": {"num_steps": 56},
        "rng_state": [{"random_rng_state": (3, (1, 2), None)}],
        "num_floating_point_operations_so_far": 123.0,
        "mg": mg_metadata(config.to_dict(), TOKENIZER),
    }
    save_checkpoint_shards(folder, iteration, {(0, 0): state})
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    return state


def model_tensors(folder: Path, tp: int, pp: int) -> dict[tuple[int, int], dict]:
    """Every rank file's `model` entry, keyed (tp_rank, pp_rank)."""
    return {
        (t, p): load_checkpoint(folder, tp_rank=t, pp_rank=p, pp_size=pp)[0]["model"]
        for t in range(tp)
        for p in range(pp)
    }


def assert_same_tensors(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model, *_ = load_model(folder)
    with torch.no_grad():
        return model(ids)


def megatron_tp_split(weights: dict, tp: int, gated: bool) -> list[dict]:
    """Megatron's per-rank shards, written independently of mg's split code: QKV, MLP-in
    (per [gate; up] half when gated), embeddings and output layer along dim 0; attention
    projection and MLP-out along dim 1; the rest replicated."""
    shards = [{} for _ in range(tp)]
    for name, tensor in weights.items():
        if gated and name.endswith("linear_fc1.weight"):
            gate, up = tensor.chunk(2)
            parts = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
        elif name.endswith(
            (
                "linear_qkv.weight",
                "linear_qkv.bias",
                "linear_fc1.weight",
                "linear_fc1.bias",
                "word_embeddings.weight",
                "output_layer.weight",
            )
        ):
            parts = list(tensor.chunk(tp, dim=0))
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = list(tensor.chunk(tp, dim=1))
        else:
            parts = [tensor] * tp
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part
    return shards
