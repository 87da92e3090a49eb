"""mg-convert reshard: TP/PP round trips bit-exact, the trainer's stage layout, refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from reshard_helpers import (  # noqa: E402
    CONFIGS,
    GPT2,
    TOKENIZER,
    assert_same_tensors,
    build,
    logits,
    megatron_tp_split,
    model_tensors,
    save_source,
)

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.ckpt_convert.errors import ConvertError  # noqa: E402
from mg.ckpt_convert.reshard import reshard  # noqa: E402
from mg.core.checkpoint import (  # noqa: E402
    describe,
    load_checkpoint,
    load_model,
    mg_metadata,
    save_checkpoint_shards,
)
from mg.core.models import GPTModel  # noqa: E402
from mg.core.parallel.pipeline import split_model  # noqa: E402

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tensor_parallel_round_trip_is_bit_exact(tmp_path, kind):
    model = build(CONFIGS[kind])
    save_source(tmp_path / "tp1", model)
    reference = logits(tmp_path / "tp1", IDS)
    previous = "tp1"
    for tp in (2, 4, 1):
        reshard(tmp_path / previous, tmp_path / f"to{tp}", tp, None, report=lambda _: None)
        previous = f"to{tp}"
        files = model_tensors(tmp_path / previous, tp, 1)
        expected = megatron_tp_split(model.state_dict(), tp, model.config.gated_linear_unit)
        for rank in range(tp):
            assert_same_tensors(files[(rank, 0)], expected[rank])
        assert torch.equal(logits(tmp_path / previous, IDS), reference)
    assert_same_tensors(files[(0, 0)], model.state_dict())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_pipeline_round_trip_matches_the_trainers_stages(tmp_path, kind):
    model = build(CONFIGS[kind])
    save_source(tmp_path / "pp1", model)
    reshard(tmp_path / "pp1", tmp_path / "pp2", None, 2, report=lambda _: None)
    files = model_tensors(tmp_path / "pp2", 1, 2)
    for stage in range(2):
        # what mg-train's PipelineChunk saves: local layer numbers, tied copy on the last
        (chunk,) = split_model(model, stage, 2)
        assert_same_tensors(files[(0, stage)], chunk.state_dict())
    if kind == "gpt2":
        assert "output_layer.weight" in files[(0, 1)]
    reshard(tmp_path / "pp2", tmp_path / "back", None, 1, report=lambda _: None)
    assert_same_tensors(model_tensors(tmp_path / "back", 1, 1)[(0, 0)], model.state_dict())
    assert torch.equal(logits(tmp_path / "back", IDS), logits(tmp_path / "pp1", IDS))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tp2_pp2_round_trip(tmp_path, kind):
    model = build(CONFIGS[kind])
    save_source(tmp_path / "src", model)
    reshard(tmp_path / "src", tmp_path / "tp2pp2", 2, 2, report=lambda _: None)
    files = model_tensors(tmp_path / "tp2pp2", 2, 2)
    for stage in range(2):
        (chunk,) = split_model(model, stage, 2)
        gated = model.config.gated_linear_unit
        for rank, shard in enumerate(megatron_tp_split(chunk.state_dict(), 2, gated)):
            assert_same_tensors(files[(rank, stage)], shard)
    reshard(tmp_path / "tp2pp2", tmp_path / "tp4pp4", 4, 4, report=lambda _: None)
    reshard(tmp_path / "tp4pp4", tmp_path / "back", 1, 1, report=lambda _: None)
    assert_same_tensors(model_tensors(tmp_path / "back", 1, 1)[(0, 0)], model.state_dict())


def test_virtual_pipeline_source_is_merged(tmp_path):
    """A PP=2 checkpoint with two model chunks per rank (model0, model1)."""
    model = build(GPT2)
    meta = mg_metadata(GPT2.to_dict(), None, pp=2)
    shards = {
        (0, rank): {f"model{c}": chunk.state_dict() for c, chunk in enumerate(chunks)}
        | {"mg": meta}
        for rank, chunks in ((r, split_model(model, r, 2, virtual_size=2)) for r in range(2))
    }
    save_checkpoint_shards(tmp_path / "vpp", 3, shards)
    reshard(tmp_path / "vpp", tmp_path / "flat", 1, 1, report=lambda _: None)
    assert_same_tensors(model_tensors(tmp_path / "flat", 1, 1)[(0, 0)], model.state_dict())


def test_keeps_iteration_args_configs_and_drops_optimizer(tmp_path, capsys):
    model = build(CONFIGS["llama"])
    save_source(tmp_path / "src", model)
    main(
        [
            "reshard",
            "--load",
            str(tmp_path / "src"),
            "--save",
            str(tmp_path / "out"),
            "--target-tensor-parallel-size",
            "2",
            "--target-pipeline-parallel-size",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert "TP=1, PP=1 → TP=2, PP=2" in out
    assert "optimizer and RNG state not carried over" in out
    info = describe(tmp_path / "out")
    assert info.iteration == 7 and str(info.layout) == "TP=2, PP=2"
    assert info.model_config == model.config.to_dict()
    assert info.tokenizer_config == TOKENIZER
    assert info.parallel == {"tp": 2, "pp": 2, "ep": 1}
    assert info.args["tensor_model_parallel_size"] == 2
    assert info.args["pipeline_model_parallel_size"] == 2 and info.args["lr"] == 0.1
    state, _ = load_checkpoint(tmp_path / "out", tp_rank=1, pp_rank=1)
    assert "optimizer" not in state and "rng_state" not in state
    assert state["opt_param_scheduler"] == {"num_steps": 56}
    assert state["num_floating_point_operations_so_far"] == 123.0
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no staging left


def test_vocabulary_is_repadded_when_tp_needs_it(tmp_path, capsys):
    import dataclasses

    config = dataclasses.replace(GPT2, vocab_size=130)
    model = build(config)
    save_source(tmp_path / "src", model)
    reshard(tmp_path / "src", tmp_path / "tp4", 4, None, divisible_by=2)
    assert "re-padded from 130 to 136" in capsys.readouterr().out
    out = logits(tmp_path / "tp4", IDS)
    assert out.shape[-1] == 136
    assert torch.equal(out[..., :130], logits(tmp_path / "src", IDS))
    merged, *_ = load_model(tmp_path / "tp4")
    rows = merged.embedding.word_embeddings.weight
    assert torch.equal(rows[130:], rows[129:130].expand(6, -1))  # Megatron copies the last row


@pytest.mark.parametrize(
    ("tp", "pp", "message"),
    [
        (3, 1, "does not divide the model's num_attention_heads \\(8\\)"),
        (8, 1, "num_query_groups \\(4\\)"),
        (1, 3, "does not divide the model's num_layers \\(4\\)"),
        (0, 1, "must be >= 1"),
    ],
)
def test_refuses_layouts_the_model_does_not_split_into(tmp_path, tp, pp, message):
    save_source(tmp_path / "src", build(CONFIGS["llama"]))
    with pytest.raises(ConvertError, match=message):
        reshard(tmp_path / "src", tmp_path / "out", tp, pp)
    assert not (tmp_path / "out").exists()


def test_refuses_bad_sources(tmp_path, capsys):
    save_source(tmp_path / "src", build(GPT2))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ConvertError, match="already exists"):
        reshard(tmp_path / "src", tmp_path / "taken", 2, 1)
    save_checkpoint_shards(tmp_path / "bare", 1, {(0, 0): {"model": {}}})
    with pytest.raises(ConvertError, match="records no model config"):
        reshard(tmp_path / "bare", tmp_path / "out", 2, 1)
    weights = GPTModel(GPT2).state_dict()
    weights["encoder.extra.weight"] = torch.zeros(1)
    meta = mg_metadata(GPT2.to_dict(), None)
    save_checkpoint_shards(tmp_path / "odd", 1, {(0, 0): {"model": weights, "mg": meta}})
    with pytest.raises(ConvertError, match="do not fit the GPT model"):
        reshard(tmp_path / "odd", tmp_path / "out", 2, 1)
    with pytest.raises(SystemExit) as exit_info:
        main(["reshard", "--load", str(tmp_path / "nowhere"), "--save", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mg-convert reshard: error:") and "does not exist" in err


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_moe_reshards_between_expert_parallel_layouts(tmp_path, grouped, capsys):
    """An MoE checkpoint to TP2 x PP2 x EP2 (mp_rank_TT_PPP_EEE, each rank's two experts
    numbered from 0 and split over TP as the MLP is) and back: bit-exact, same logits."""
    import dataclasses

    config = dataclasses.replace(
        CONFIGS["llama"],
        num_moe_experts=4,
        moe_ffn_hidden_size=16,
        moe_layer_freq=2,
        moe_shared_expert_intermediate_size=32,
        moe_grouped_gemm=grouped,
    )
    model = build(config)
    save_source(tmp_path / "ours", model)
    reshard(tmp_path / "ours", tmp_path / "split", 2, 2, ep=2, report=lambda _: None)
    info = describe(tmp_path / "split")
    assert (info.layout.tp, info.layout.pp, info.layout.ep) == (2, 2, 2)
    assert len(info.files) == 8

    # EP rank 1, TP rank 0, stage 1 (layers 2, 3): its expert 0 is layer 2's expert 2,
    # rows [gate_0; up_0] of linear_fc1 (ffn 16: 8 rows of each half per TP rank)
    state, _ = load_checkpoint(tmp_path / "split", tp_rank=0, pp_rank=1, ep_rank=1)
    whole = model.state_dict()
    if grouped:
        local, glob = "linear_fc1.weight0", "linear_fc1.weight2"
    else:
        local, glob = "local_experts.0.linear_fc1.weight", "local_experts.2.linear_fc1.weight"
    gate, up = whole[f"decoder.layers.2.mlp.experts.{glob}"].chunk(2)
    expected = torch.cat([gate[:8], up[:8]])
    assert torch.equal(state["model"][f"decoder.layers.0.mlp.experts.{local}"], expected)
    assert not any("local_experts.2" in k or "weight2" in k for k in state["model"])

    assert torch.equal(logits(tmp_path / "split", IDS), logits(tmp_path / "ours", IDS))
    reshard(tmp_path / "split", tmp_path / "back", 1, 1, ep=1, report=lambda _: None)
    assert_same_tensors(model_tensors(tmp_path / "back", 1, 1)[(0, 0)], model.state_dict())

    with pytest.raises(SystemExit):
        main(["reshard", "--load", str(tmp_path / "ours"), "--save", str(tmp_path / "x")]
             + ["--target-expert-parallel-size", "3"])  # fmt: skip
    assert "--target-expert-parallel-size 3 does not divide the model's num_moe_experts (4)" in (
        capsys.readouterr().err
    )
