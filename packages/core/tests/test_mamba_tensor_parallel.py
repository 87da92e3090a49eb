"""A Mamba mixer's tensor-parallel shards are Megatron-Core's: rank r's in_proj rows are
[z_r; x_r; B_r; C_r; dt_r], its conv1d channels [x_r; B_r; C_r]; `torch` checkpoint
shards merge back into the whole tensors and split into them again (mg.core.parallel.
row_blocks, mg.core.checkpoint.tp_merge / tp_split). The training runs under TP and PP
are in packages/trainer/tests/test_mamba_family.py."""

from __future__ import annotations

import pytest
import torch

from mg.core.checkpoint.tp_merge import mamba_row_blocks, merge_tensor_parallel, partition_dim
from mg.core.checkpoint.tp_split import split_tensor_parallel
from mg.core.models.mamba import MambaConfig, MambaModel
from mg.core.parallel.row_blocks import local_rows, merge_rows, row_runs, split_rows

CONFIG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=128,
    mamba_head_dim=8,  # 8 heads, d_inner 64
    mamba_num_groups=4,
    mamba_state_dim=4,
    hybrid_override_pattern="M*",
)


def test_row_blocks_take_each_blocks_slice_and_merge_back() -> None:
    blocks = (4, 4, 2, 2, 6)
    full = torch.arange(18.0)[:, None].expand(18, 3).contiguous()
    shards = split_rows(full, blocks, 2)
    assert shards[1][:, 0].tolist() == [2, 3, 6, 7, 9, 11, 15, 16, 17]
    assert torch.equal(merge_rows(shards, blocks), full)
    assert torch.equal(local_rows(full, blocks, 2, 0), shards[0])
    assert row_runs(blocks, 2, 1) == [(0, 2, 2), (2, 2, 6), (4, 1, 9), (5, 1, 11), (6, 3, 15)]
    with pytest.raises(ValueError, match="does not split over 4 ranks"):
        row_runs(blocks, 4, 0)


def test_torch_checkpoint_shards_are_megatron_mixer_slices() -> None:
    torch.manual_seed(0)
    config = MambaConfig(**CONFIG)
    whole = MambaModel(config).state_dict()
    shards = split_tensor_parallel(whole, 2, config.gated_linear_unit, config)
    d, bc, h = config.mamba_d_inner, config.mamba_num_groups * config.mamba_state_dim, 8
    in_proj = whole["decoder.layers.0.mixer.in_proj.weight"]
    z, x, B, C, dt = in_proj.split([d, d, bc, bc, h])
    r = 1
    expected = torch.cat([t.chunk(2)[r] for t in (z, x, B, C, dt)])
    assert torch.equal(shards[r]["decoder.layers.0.mixer.in_proj.weight"], expected)
    conv = whole["decoder.layers.0.mixer.conv1d.bias"]
    cx, cB, cC = conv.split([d, bc, bc])
    expected = torch.cat([t.chunk(2)[r] for t in (cx, cB, cC)])
    assert torch.equal(shards[r]["decoder.layers.0.mixer.conv1d.bias"], expected)
    for name in ("A_log", "D", "dt_bias", "norm.weight"):
        full = whole[f"decoder.layers.0.mixer.{name}"]
        assert torch.equal(shards[r][f"decoder.layers.0.mixer.{name}"], full.chunk(2)[r])
    assert partition_dim("decoder.layers.0.mixer.out_proj.weight") == 1
    assert partition_dim("decoder.layers.0.norm.weight") is None  # the layer's norm: replicated

    merged = merge_tensor_parallel(shards, config.gated_linear_unit, config)
    assert merged.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(merged[name], tensor), name


def test_mixer_blocks_need_the_config() -> None:
    with pytest.raises(ValueError, match="needs its MambaConfig"):
        mamba_row_blocks("decoder.layers.0.mixer.in_proj.weight", None)
