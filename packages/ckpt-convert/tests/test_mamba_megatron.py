"""import-megatron / export-megatron of Megatron-LM hybrid (pretrain_mamba.py) checkpoints:
its Namespace args give a MambaConfig with the same layer pattern, its Transformer Engine
spec names (`mixer.in_proj.layer_norm_weight`, ...) become ours, pipeline stages merge,
tensor-parallel shards join (each mixer's heads and groups, as core's TP split cuts
them); export writes the args, the TE names and the shards back, bit-exact.
megatron-core's own MambaModel names are checked in core's test_mamba_megatron.py;
the checkpoint here is written the way Megatron-LM's save_checkpoint writes one, from
those names."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from mg.ckpt_convert.megatron_lm import export_megatron, import_megatron, megatron_args_from_config
from mg.core.checkpoint import load_checkpoint, load_model
from mg.core.checkpoint.dist_format import stored_keys
from mg.core.checkpoint.pp_split import split_pipeline
from mg.core.checkpoint.tp_split import split_tensor_parallel
from mg.core.models.mamba import MambaConfig, MambaModel, megatron_te_names

QUIET = {"report": lambda *_: None}
MAMBA_SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]


def _config() -> MambaConfig:
    return MambaConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=128,
        seq_length=32,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=16,
        normalization="RMSNorm",
        activation="squared_relu",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        hybrid_override_pattern="M*M-",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _megatron_args(config: MambaConfig, tp: int = 1, pp: int = 1) -> argparse.Namespace:
    """pretrain_mamba.py's args: the GPT flags plus the Mamba / hybrid ones and the spec."""
    args = megatron_args_from_config(config, None, tp=tp, pp=pp)
    args.spec = MAMBA_SPEC
    args.mamba_state_dim, args.mamba_head_dim = config.mamba_state_dim, config.mamba_head_dim
    args.mamba_num_groups, args.mamba_num_heads = config.mamba_num_groups, None
    args.hybrid_attention_ratio, args.hybrid_mlp_ratio = 0.0, 0.0
    args.hybrid_override_pattern = config.hybrid_override_pattern
    args.group_query_attention = True
    return args


def _write(folder: Path, model: MambaModel, args: argparse.Namespace, pp: int, tp: int = 1):
    stages = split_pipeline(model.state_dict(), 4, pp, tied=False)
    for p, chunks in enumerate(stages):
        shards = split_tensor_parallel(chunks[0], tp, False, model.config)
        for t, shard in enumerate(shards):
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            rank_dir = folder / "iter_0000020" / name
            rank_dir.mkdir(parents=True)
            state = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": 20,
                "model": megatron_te_names(shard),
            }
            torch.save(state, rank_dir / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text("20")


@pytest.mark.parametrize("pp", [1, 2])
def test_import_of_a_megatron_hybrid(tmp_path, pp):
    config = _config()
    torch.manual_seed(0)
    model = MambaModel(config).eval()
    _write(tmp_path / "megatron", model, _megatron_args(config, pp=pp), pp)
    assert (
        "decoder.layers.0.mixer.in_proj.layer_norm_weight"
        in torch.load(next((tmp_path / "megatron").rglob("*.pt")), weights_only=False)["model"]
    )

    import_megatron(tmp_path / "megatron", tmp_path / "ours", pp=1, **QUIET)
    loaded, ours, _, info = load_model(tmp_path / "ours")
    assert isinstance(loaded, MambaModel) and info.iteration == 20
    assert ours.layer_pattern == "M*M-" and ours.mamba_num_groups == 2
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    export_megatron(tmp_path / "ours", tmp_path / "back", **QUIET)
    state, _ = load_checkpoint(tmp_path / "back", allow_pickle=True)
    args = state["args"]
    assert args.hybrid_override_pattern == "M*M-" and "mamba_stack_spec" in args.spec
    assert (args.mamba_head_dim, args.mamba_num_groups, args.mamba_state_dim) == (16, 2, 16)
    expected = megatron_te_names(model.state_dict())
    assert list(state["model"]) == list(expected)
    assert all(torch.equal(state["model"][k], v) for k, v in expected.items())
    if pp == 2:  # kept as two pipeline stages, then read whole again
        import_megatron(tmp_path / "megatron", tmp_path / "staged", **QUIET)
        assert (tmp_path / "staged" / "iter_0000020" / "mp_rank_00_001").is_dir()
        staged, *_ = load_model(tmp_path / "staged")
        with torch.no_grad():
            assert torch.equal(staged(ids), model(ids))


@pytest.mark.parametrize("tp", [2])
def test_tensor_parallel_megatron_hybrid(tmp_path, tp):
    """TP=2 files (each mixer's in_proj [z; x; B; C; dt] and conv1d rows per rank, A_log,
    D, dt_bias and its norm by heads, out_proj by columns) import with the model's logits
    and export back to the very files, and to a torch_dist checkpoint in Megatron-Core's
    keys that reads back to the same model."""
    config = _config()
    torch.manual_seed(0)
    model = MambaModel(config).eval()
    _write(tmp_path / "megatron", model, _megatron_args(config, tp=tp), 1, tp=tp)
    import_megatron(tmp_path / "megatron", tmp_path / "ours", tp=1, **QUIET)
    loaded, *_ = load_model(tmp_path / "ours")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))

    export_megatron(tmp_path / "ours", tmp_path / "back", tp=tp, **QUIET)
    for rank in range(tp):
        ours, _ = load_checkpoint(tmp_path / "back", tp_rank=rank, allow_pickle=True)
        theirs, _ = load_checkpoint(tmp_path / "megatron", tp_rank=rank, allow_pickle=True)
        assert ours["args"].tensor_model_parallel_size == tp
        assert list(ours["model"]) == list(theirs["model"])
        for name, tensor in theirs["model"].items():
            assert torch.equal(ours["model"][name], tensor), name
    # torch_dist in Megatron-Core's keys (layers by number, the mixer's row blocks apart)
    export_megatron(tmp_path / "ours", tmp_path / "dist", ckpt_format="torch_dist", **QUIET)
    (folder,) = (tmp_path / "dist").glob("iter_*")
    assert "decoder.layers.0.mixer.in_proj.weight.dt" in stored_keys(folder)
    assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in stored_keys(folder)
    dist, *_ = load_model(tmp_path / "dist")
    with torch.no_grad():
        assert torch.equal(dist(ids), model(ids))
