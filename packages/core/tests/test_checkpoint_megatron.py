"""A checkpoint laid out and pickled as Megatron-LM writes it (torch format) is readable.

The state dict is built by hand the way megatron/training/checkpointing.py's
generate_state_dict + save_checkpoint do: ``args`` an ``argparse.Namespace``,
``checkpoint_version`` 3.0, Megatron-Core parameter names, the optimizer's
state dict, ``rng_state`` as a one-entry list, written with a plain
``torch.save`` to ``iter_XXXXXXX/mp_rank_TT_PPP/model_optim_rng.pt`` and the
tracker holding ``str(iteration)``.
"""

import argparse
import enum
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mg.core.checkpoint import CheckpointError, Layout, describe, load_checkpoint


def _megatron_args(**extra: object) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=64,
        max_position_embeddings=32,
        padded_vocab_size=64,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=1,
        params_dtype=torch.float32,
        tokenizer_type="GPT2BPETokenizer",
        iteration=100,
        **extra,
    )


def _megatron_model(pp_rank: int) -> dict[str, torch.Tensor]:
    layer = "decoder.layers.0"
    sd = {
        f"{layer}.self_attention.linear_qkv.layer_norm_weight": torch.ones(16),
        f"{layer}.self_attention.linear_qkv.weight": torch.randn(48, 16),
        f"{layer}.self_attention.linear_qkv.bias": torch.zeros(48),
        f"{layer}.self_attention.linear_proj.weight": torch.randn(16, 16),
        f"{layer}.mlp.linear_fc1.layer_norm_weight": torch.ones(16),
        f"{layer}.mlp.linear_fc1.weight": torch.randn(64, 16),
        f"{layer}.mlp.linear_fc2.weight": torch.randn(16, 64),
    }
    if pp_rank == 0:
        sd["embedding.word_embeddings.weight"] = torch.randn(64, 16)
        sd["embedding.position_embeddings.weight"] = torch.randn(32, 16)
    else:
        sd["decoder.final_layernorm.weight"] = torch.ones(16)
        sd["output_layer.weight"] = torch.randn(64, 16)
    return sd


def _write_megatron_checkpoint(root: Path, args: argparse.Namespace) -> dict[int, dict]:
    states = {}
    for pp_rank in range(2):
        model = _megatron_model(pp_rank)
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": 100,
            "model": model,
            "optimizer": {
                "optimizer": {
                    "state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(100.0)}},
                    "param_groups": [{"lr": 1e-4, "params": [0]}],
                },
                "fp32_from_fp16_params": [],
            },
            "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 3200, "decay_style": "cosine"},
            "rng_state": [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "cuda_rng_state": torch.get_rng_state(),  # stand-in: no CUDA here
                    "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()},
                }
            ],
            "num_floating_point_operations_so_far": 1.5e15,
        }
        path = root / "iter_0000100" / f"mp_rank_00_{pp_rank:03d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save(state, path)
        states[pp_rank] = state
    (root / "latest_checkpointed_iteration.txt").write_text("100")
    return states


def test_megatron_checkpoint_plain_namespace_loads_weights_only(tmp_path: Path) -> None:
    states = _write_megatron_checkpoint(tmp_path, _megatron_args())
    for pp_rank in range(2):
        state, it = load_checkpoint(tmp_path, pp_rank=pp_rank)
        assert it == 100
        assert isinstance(state["args"], argparse.Namespace)
        assert state["args"].pipeline_model_parallel_size == 2
        assert state["checkpoint_version"] == 3.0
        assert "mg" not in state
        for name, tensor in states[pp_rank]["model"].items():
            assert torch.equal(state["model"][name], tensor), name
        assert state["rng_state"][0]["np_rng_state"][0] == "MT19937"
    info = describe(tmp_path)
    assert info.layout == Layout(tp=1, pp=2)
    assert info.format_version is None and info.model_config is None
    assert info.args.hidden_size == 16
    assert info.checkpoint_version == 3.0


class AttnBackend(enum.Enum):
    """Stands in for megatron.core.transformer.enums.AttnBackend, which real args carry."""

    auto = 5


def test_megatron_checkpoint_with_enums_needs_allow_pickle(tmp_path: Path) -> None:
    _write_megatron_checkpoint(tmp_path, _megatron_args(attention_backend=AttnBackend.auto))
    with pytest.raises(CheckpointError, match=r"AttnBackend.*allow_pickle=True") as info:
        load_checkpoint(tmp_path)
    assert "mp_rank_00_000/model_optim_rng.pt" in str(info.value)
    state, _ = load_checkpoint(tmp_path, pp_rank=1, allow_pickle=True)
    assert state["args"].attention_backend is AttnBackend.auto
    assert "output_layer.weight" in state["model"]
    assert describe(tmp_path, allow_pickle=True).layout == Layout(tp=1, pp=2)


def test_megatron_checkpoint_from_missing_module(tmp_path: Path) -> None:
    """args pickled with a class whose module is not installed: a clear message."""
    import sys
    import types

    module = types.ModuleType("fake_megatron_enums")

    class Flag(enum.Enum):
        on = 1

    Flag.__module__ = "fake_megatron_enums"
    Flag.__qualname__ = "Flag"
    module.Flag = Flag  # type: ignore[attr-defined]
    sys.modules["fake_megatron_enums"] = module
    try:
        _write_megatron_checkpoint(tmp_path, _megatron_args(flag=Flag.on))
    finally:
        del sys.modules["fake_megatron_enums"]
    with pytest.raises(
        CheckpointError, match="need the module 'fake_megatron_enums', which is not installed"
    ):
        load_checkpoint(tmp_path, allow_pickle=True)
