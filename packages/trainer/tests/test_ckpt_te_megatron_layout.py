"""The torch_dist key layout follows from the model's configuration, never from its names.

A Transformer Engine spec GPT (`--transformer-impl transformer_engine`: fused norms
`linear_qkv.layer_norm_weight`, TE's `_extra_state` entries; TE is the CPU stand-in,
mg.core.testing.te_standin) is saved in Megatron-Core's layout, as the local spec's is:
megatron-core 0.16.1's `dist_checkpointing.load` fills its GPTModel (local spec, whose
`sharded_state_dict_keys_map` names its norms as the TE spec does) from mg-train's
checkpoint, with logits equal to ours read from the same folder (1e-5), and mg-train
resumes it bitwise. What cannot be written is refused at start-up in one line naming the
flag; `checkpoint_io` saves and resumes both formats, finding the format on disk.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mg.core.checkpoint import CheckpointError, load_model
from mg.core.checkpoint.dist_format import stored_keys
from mg.core.checkpoint.formats import DistLayout
from mg.core.models import TransformerConfig
from mg.core.testing import te_standin
from mg.trainer import checkpoint_io
from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer

TE = ["--transformer-impl", "transformer_engine", "--distributed-backend", "gloo"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
SHAPES = {
    "gpt2": [],
    "llama": [
        *("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"),
        *("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
        *("--group-query-attention", "--num-query-groups", "2", "--qk-layernorm"),
    ],
}
TOL = 1e-5


@pytest.mark.compat
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_te_spec_gpt_saves_megatron_layout_megatron_core_loads(
    tmp_path, mock_argv, train, monkeypatch, shape
) -> None:
    pytest.importorskip("megatron.core")
    from mg.core.testing.megatron_dist_checkpoint import (
        dist_checkpointing_cpu_patches,
        load_into_megatron,
    )
    from mg.core.testing.megatron_reference import megatron_gpt_model, megatron_on_cpu

    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "3"]
    with monkeypatch.context() as te:  # megatron-core must not see the stand-in below
        te_standin.install(te)
        train(mock_argv(tmp_path, *TE, *NO_DROPOUT, *SHAPES[shape], *save, mbs=2, gbs=4, iters=3))
    folder = ckpt / "iter_0000003"
    keys = stored_keys(folder)
    assert not any(k.startswith("model.") for k in keys)  # not mg's per-parameter layout
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
    for module in ("linear_qkv", "linear_proj", "core_attention"):
        assert f"decoder.layers.self_attention.{module}._extra_state/shard_1_2" in keys
    assert "rng_state/shard_0.0_1.1" in keys

    ours, config, _, _ = load_model(ckpt)  # the TE spec's names, read from Megatron's keys
    assert config.transformer_impl == "transformer_engine"
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in ours.state_dict()
    ids = torch.randint(0, 127, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ours(ids)[..., :127]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
        with megatron_on_cpu(tmp_path), monkeypatch.context() as patches:
            dist_checkpointing_cpu_patches(patches)
            theirs = megatron_gpt_model(config)  # the local spec: its norms keyed as TE's
            load_into_megatron(folder, theirs)
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            with torch.no_grad():
                logits = theirs(ids, positions, None)[..., :127]
    assert (logits - expected).abs().max().item() <= TOL


def test_te_spec_megatron_layout_resumes_bitwise(tmp_path, mock_argv, train, monkeypatch) -> None:
    """2 + 2 iterations through the TE spec's Megatron-layout checkpoint equal 4 in one go
    (weights, Adam state, generators; TE's `_extra_state` handed back to its modules)."""
    te_standin.install(monkeypatch)
    restored = []
    monkeypatch.setattr(
        te_standin._Extra, "set_extra_state", lambda self, state: restored.append(state)
    )
    argv = mock_argv(tmp_path, *TE, *NO_DROPOUT, mbs=2, gbs=4, iters=4)
    whole = train(argv).losses
    ckpt = str(tmp_path / "ckpt")
    first = train([*argv, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"])
    assert "decoder.layers.self_attention.linear_qkv.weight" in stored_keys(
        tmp_path / "ckpt" / "iter_0000002"
    )
    second = train([*argv, "--load", ckpt])
    assert first.losses + second.losses == whole
    assert len(restored) == 2 * 5  # per layer: linear_qkv, linear_proj, core_attention, fc1, fc2


def _config(**fields) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, **fields
    )


def test_layout_follows_from_the_configuration() -> None:
    te = _config(transformer_impl="transformer_engine")
    assert checkpoint_io.check_savable("torch_dist", te, family="gpt") is DistLayout.MEGATRON
    assert checkpoint_io.check_savable("torch_dist", _config(), family="gpt") is (
        DistLayout.MEGATRON
    )
    moe = _config(num_moe_experts=4, moe_router_topk=2)
    assert checkpoint_io.check_savable("torch_dist", moe, family="gpt") is DistLayout.MEGATRON
    for family in ("bert", "t5", "mamba"):
        layout = checkpoint_io.check_savable("torch_dist", _config(), family=family)
        assert layout is DistLayout.MEGATRON
    assert checkpoint_io.check_savable("torch", te, family="gpt") is None


def test_a_format_without_a_writer_is_refused_at_start_up() -> None:
    with pytest.raises(CheckpointError) as refused:
        checkpoint_io.check_savable("zarr", _config(), family="gpt")
    (line,) = str(refused.value).splitlines()
    assert line.startswith("--ckpt-format zarr:") and "torch_dist" in line
    assert checkpoint_io.check_savable("fsdp_dtensor", _config(), family="gpt") is None


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_checkpoint_io_saves_and_resumes(tmp_path, mock_argv, fmt) -> None:
    """`save` writes the format asked for, `resume` finds it on disk: weights, optimizer
    state and counters come back."""
    argv = mock_argv(tmp_path, *NO_DROPOUT, mbs=2, gbs=4, iters=3)
    trained = Trainer(parse_args(argv))
    trained.train()
    load = str(tmp_path / fmt)
    assert checkpoint_io.saved_format(load) is None
    pending = checkpoint_io.save(
        load,
        trained.state,
        ckpt_format=fmt,
        model=trained.model,
        optimizer=trained.optimizer,
        scheduler=trained.scheduler,
        loss_scaler=trained.scaler,
        model_config=trained.model_config,
        tokenizer_config=trained.saved_tokenizer_config,
        args_flat=trained.args.flat(),
        layout=trained.layout,
    )
    assert (pending is None) == (fmt == "torch")
    if pending is not None:
        pending.wait()
    assert checkpoint_io.saved_format(load) == fmt

    fresh = Trainer(parse_args(argv))
    what = {
        "model": fresh.model,
        "optimizer": fresh.optimizer,
        "scheduler": fresh.scheduler,
        "loss_scaler": fresh.scaler,
        "layout": fresh.layout,
    }
    assert checkpoint_io.resume(str(tmp_path / "empty"), **what) is None
    state = checkpoint_io.resume(load, **what)
    assert state == trained.state
    weights = trained.model.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in fresh.model.state_dict().items())
    assert fresh.optimizer.state_dict()["state"].keys() == (
        trained.optimizer.state_dict()["state"].keys()
    )
