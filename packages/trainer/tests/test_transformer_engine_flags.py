"""Megatron's transformer-engine flags: recognised, mapped onto the model config and TE's FP8
recipe, refused by name where this machine or build cannot run them; the attention kernel
choice trains the same model; --fp16 with tensor parallelism matches one process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mg.core.models.te_spec import transformer_engine_installed
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.arguments.transformer_engine import fp8_options
from mg.trainer.families import gpt_config

BASE = [
    "gpt",
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--lr",
    "1e-3",
    "--train-iters",
    "10",
    "--mock-data",
]
TE = ["--transformer-impl", "transformer_engine"]
CUDA = torch.cuda.is_available()
TE_READY = CUDA and transformer_engine_installed()

# The FP8 flags of Megatron's examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.16.1).
LLAMA3_FP8 = [
    "--fp8-format",
    "hybrid",
    "--fp8-amax-history-len",
    "1024",
    "--fp8-amax-compute-algo",
    "max",
    "--fp8-param-gather",
    "--use-distributed-optimizer",
    "--attention-backend",
    "fused",
    "--transformer-impl",
    "transformer_engine",
]


def _error(argv: list[str], world_size: int = 1) -> str:
    with pytest.raises(ArgumentError) as err:
        parse_args(argv, world_size=world_size)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_defaults_and_config_fields() -> None:
    args = parse_args(BASE)
    te = args.transformer_engine
    assert (te.transformer_impl, te.attention_backend, te.fp8) == ("local", "auto", None)
    assert fp8_options(args) is None
    config = gpt_config(parse_args([*BASE, "--attention-backend", "unfused"]), 128)
    assert (config.attention_backend, config.transformer_impl) == ("unfused", "local")


def test_megatron_fp8_example_flags_plan_in_a_dry_run() -> None:
    args = parse_args([*BASE, *LLAMA3_FP8, "--dry-run", "--first-last-layers-bf16"])
    options = fp8_options(args)
    assert (options.format, options.recipe) == ("hybrid", "delayed")
    assert (options.amax_history_len, options.amax_compute_algo) == (1024, "max")
    assert options.param and options.wgrad and options.bf16_layers == (0, 3)
    config = gpt_config(args, 128)
    assert (config.attention_backend, config.transformer_impl) == ("fused", "transformer_engine")
    no_wgrad = parse_args([*BASE, *TE, "--fp8-format", "e4m3", "--no-fp8-wgrad", "--dry-run"])
    assert not fp8_options(no_wgrad).wgrad


def test_use_flash_attn_is_attention_backend_flash() -> None:
    args = parse_args([*BASE, "--use-flash-attn", "--dry-run"])
    assert args.transformer_engine.attention_backend == "flash"
    assert "contradicts --attention-backend unfused" in _error(
        [*BASE, "--use-flash-attn", "--attention-backend", "unfused", "--dry-run"]
    )


@pytest.mark.skipif(CUDA, reason="checks the refusals on a machine without CUDA")
def test_cuda_kernels_are_refused_by_name_without_cuda() -> None:
    assert "--use-flash-attn selects a CUDA kernel" in _error([*BASE, "--use-flash-attn"])
    message = _error([*BASE, "--attention-backend", "fused"])
    assert message.startswith("--attention-backend fused selects a CUDA kernel")


def test_flash_needs_16_bit_where_cuda_is(monkeypatch) -> None:
    from mg.core.models import attention_backend

    monkeypatch.setattr(attention_backend, "cuda_available", lambda: True)
    assert "--use-flash-attn needs --bf16 or --fp16" in _error([*BASE, "--use-flash-attn"])
    assert parse_args([*BASE, "--use-flash-attn", "--bf16"]).transformer_engine.use_flash_attn


@pytest.mark.skipif(TE_READY, reason="checks the message where TE or CUDA is missing")
def test_transformer_engine_missing_is_one_line_naming_the_extra() -> None:
    message = _error([*BASE, *TE])
    assert message.startswith("--transformer-impl transformer_engine needs")
    if not transformer_engine_installed():
        assert "pip install 'mg-core[gpu]'" in message


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--enable-cuda-graph"], "--enable-cuda-graph is not supported"),
        (["--external-cuda-graph"], "--external-cuda-graph is not supported"),
        (["--cuda-graph-impl", "local"], "--cuda-graph-impl local is not supported"),
        ([*TE, "--fp8-format", "hybrid", "--fp8-dot-product-attention"], "--fp8-dot-product"),
        ([*TE, "--fp8-format", "hybrid", "--fp8-multi-head-attention"], "--fp8-multi-head"),
        ([*TE, "--fp8-format", "hybrid", "--fp8-recipe", "custom"], "--fp8-recipe custom"),
        (["--transformer-impl", "inference_optimized"], "inference_optimized is not supported"),
        (
            ["--transformer-impl", "local", "--fp8-format", "hybrid"],
            "--fp8-recipe delayed needs Transformer Engine",
        ),
        ([*TE, "--fp8-format", "hybrid", "--fp8-param-gather"], "--use-distributed-optimizer"),
        ([*TE, "--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
        ([*TE, "--reset-attention-mask"], "--reset-attention-mask needs --transformer-impl local"),
        ([*TE, "--fp8-format", "e4m3", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len"),
    ],
)
def test_refusals_name_their_flag(extra: list[str], expected: str) -> None:
    assert expected in _error([*BASE, *extra, "--dry-run"])


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--context-parallel-size", "2"],
    ],
)
def test_te_spec_takes_tensor_and_context_parallelism(layout: list[str]) -> None:
    """TE's modules are told the groups (mg.core.models.te_parallel; numbers in
    tests/test_te_parallel_training.py): the layouts plan in a dry run."""
    args = parse_args([*BASE, *TE, *layout, "--dry-run"], world_size=2)
    assert args.transformer_engine.transformer_impl == "transformer_engine"


def test_documented_no_ops_are_accepted() -> None:
    args = parse_args(
        [*BASE, *TE, "--fp8-format", "hybrid", "--fp8-interval", "1"]
        + ["--te-rng-tracker", "--cuda-graph-impl", "none", "--dry-run"]
    )
    assert args.transformer_engine.te_rng_tracker


def _megatron_rank_groups(sizes: dict[str, int], token: str) -> list[list[int]]:
    """Megatron's RankGenerator(order="tp-cp-ep-dp-pp", ep=1).get_ranks(token), restated:
    the groups of ranks that differ only along the dims in `token`, each listed with
    its first dim varying fastest, the groups ordered the same way by the other dims."""
    order = ["tp", "cp", "dp", "pp"]
    stride, step = {}, 1
    for name in order:
        stride[name], step = step, step * sizes[name]

    def offsets(names: list[str]) -> list[int]:
        points = [0]
        for name in names:  # earlier names vary fastest
            points = [p + i * stride[name] for i in range(sizes[name]) for p in points]
        return points

    inside = [name for name in order if name in token.split("-")]
    outside = [name for name in order if name not in inside]
    return [[g + r for r in offsets(inside)] for g in offsets(outside)]


AMAX_LAYOUTS = [  # (tp, pp, cp, dp)
    (2, 2, 1, 2),
    (2, 2, 2, 1),
    (2, 2, 2, 2),
    (1, 4, 2, 2),
    (4, 1, 1, 2),
    (2, 3, 1, 1),
]


@pytest.mark.parametrize(("tp", "pp", "cp", "dp"), AMAX_LAYOUTS)
def test_amax_reduction_ranks_are_megatrons(tp: int, pp: int, cp: int, dp: int) -> None:
    """The FP8 amax-reduction groups are Megatron's get_amax_reduction_group(
    with_context_parallel=True): tp-cp-dp (one pipeline stage), or tp-cp with
    --tp-only-amax-red, in RankGenerator's order."""
    from mg.core.parallel.layout import ParallelLayout
    from mg.trainer.model_parallel import amax_reduction_rank_groups

    layout = ParallelLayout(tp=tp, pp=pp, cp=cp, dp=dp)
    sizes = {"tp": tp, "pp": pp, "cp": cp, "dp": dp}
    assert amax_reduction_rank_groups(layout) == _megatron_rank_groups(sizes, "tp-cp-dp")
    assert amax_reduction_rank_groups(layout, tp_only=True) == _megatron_rank_groups(sizes, "tp-cp")


def test_amax_reduction_ranks_at_tp2_pp2_dp2() -> None:
    from mg.core.parallel.layout import ParallelLayout
    from mg.trainer.model_parallel import amax_reduction_rank_groups

    layout = ParallelLayout(tp=2, pp=2, dp=2)
    assert amax_reduction_rank_groups(layout) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert amax_reduction_rank_groups(layout, tp_only=True) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def _fake_groups(monkeypatch) -> list[tuple[int, ...]]:
    """dist.new_group recorded: each call's ranks, the group returned as that tuple."""
    from mg.trainer import model_parallel

    created: list[tuple[int, ...]] = []

    def new_group(ranks):
        created.append(tuple(ranks))
        return tuple(ranks)

    monkeypatch.setattr(model_parallel.dist, "new_group", new_group)
    return created


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("dp_rank", [0, 1])
@pytest.mark.parametrize("pp_rank", [0, 1])
def test_amax_reduction_group_is_this_ranks_stage(monkeypatch, tp_rank, dp_rank, pp_rank):
    """At TP=2 x PP=2 x DP=2 every rank creates both stages' groups, in the same order
    (new_group is collective), and keeps its own stage's; --tp-only-amax-red gives the
    layout's tensor-parallel group and creates none."""
    from types import SimpleNamespace

    from mg.core.parallel.layout import ParallelLayout
    from mg.trainer.model_parallel import amax_reduction_group

    created = _fake_groups(monkeypatch)
    layout = ParallelLayout(tp=2, pp=2, dp=2, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank)
    layout.tp_mesh = SimpleNamespace(get_group=lambda: "tp group")
    rank = (pp_rank * 2 + dp_rank) * 2 + tp_rank
    group = amax_reduction_group(layout)
    assert created == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert group == created[pp_rank] and rank in group
    created.clear()
    assert amax_reduction_group(layout, tp_only=True) == "tp group" and created == []


def test_amax_reduction_group_without_new_groups(monkeypatch) -> None:
    """One pipeline stage: the whole world; one process: None; TP x CP with
    --tp-only-amax-red: tensor x context blocks; the MoE stage group when there."""
    import torch.distributed as dist

    from mg.core.parallel.layout import ParallelLayout
    from mg.trainer.model_parallel import amax_reduction_group

    created = _fake_groups(monkeypatch)
    assert amax_reduction_group(ParallelLayout()) is None
    assert amax_reduction_group(ParallelLayout(tp=2, dp=2)) is dist.group.WORLD
    moe = ParallelLayout(tp=2, pp=2, dp=2, pp_rank=1, stage_group="stage")
    assert amax_reduction_group(moe) == "stage" and created == []
    tp_cp = ParallelLayout(tp=2, cp=2, dp=2, cp_rank=1, dp_rank=1)  # rank 6
    assert amax_reduction_group(tp_cp, tp_only=True) == (4, 5, 6, 7)
    assert created == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_trainer_gives_fp8_autocast_the_amax_group(tmp_path, mock_argv, train, monkeypatch) -> None:
    """Every forward's fp8_autocast gets the group amax_reduction_group built once for
    the run, with --tp-only-amax-red read from the flag."""
    from mg.core.testing import te_standin
    from mg.trainer import model_parallel

    recorder = te_standin.install(monkeypatch)
    asked = []

    def fake(layout, tp_only=False):
        asked.append(tp_only)
        return "amax group"

    monkeypatch.setattr(model_parallel, "amax_reduction_group", fake)
    argv = mock_argv(tmp_path, *TE, "--fp8-format", "hybrid", "--tp-only-amax-red", iters=3)
    train(argv)
    assert asked == [True]
    assert recorder.fp8_groups == ["amax group"] * len(recorder.autocasts)
    assert recorder.autocasts


def test_bert_takes_no_transformer_engine_spec() -> None:
    argv = ["bert", *BASE[1:], *TE]
    assert "for gpt here, not bert" in _error(argv)


def test_attention_backends_train_the_same_model(tmp_path, mock_argv, train) -> None:
    """auto (SDPA's choice on this CPU) and unfused (the math kernel) give the same losses."""
    argv = mock_argv(tmp_path, "--attention-dropout", "0", "--hidden-dropout", "0", iters=4)
    auto = train(argv).losses
    unfused = train([*argv, "--attention-backend", "unfused"]).losses
    assert unfused == pytest.approx(auto, rel=1e-5)


def test_te_spec_and_fp8_train_through_transformer_engines_api(
    tmp_path, mock_argv, train, monkeypatch
) -> None:
    """With a stand-in TE (mg.core.testing.te_standin: TE's API in plain PyTorch) on CPU:
    TE's modules are swapped in, every micro-batch's forward runs under fp8_autocast with
    Megatron's delayed recipe, the losses are the local spec's (the same math), and the
    checkpoint (with TE's _extra_state) loads for mg-eval under Megatron's TE-spec names."""
    from mg.core.checkpoint import load_model
    from mg.core.testing import te_standin

    recorder = te_standin.install(monkeypatch)
    common = ["--bf16", "--distributed-backend", "gloo", "--attention-dropout", "0"]
    common += ["--hidden-dropout", "0"]
    ckpt = tmp_path / "ckpt"
    fp8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16"]
    save = ["--save", str(ckpt), "--save-interval", "4"]  # torch_dist, the default
    te = train(mock_argv(tmp_path, *common, *TE, *fp8, *save, mbs=2, gbs=4, iters=4))
    assert len(recorder.built) == 2 * 2 * 2  # (LayerNormLinear + Linear) x 2 per layer
    assert len(recorder.autocasts) == 4 * 2 and all(on for on, _ in recorder.autocasts)
    assert recorder.fp8_groups == [None] * 8  # one process: no group
    recipe = recorder.autocasts[0][1]
    assert recipe.kind == "DelayedScaling" and recipe.kwargs["amax_history_len"] == 16
    local = train(mock_argv(tmp_path, *common, mbs=2, gbs=4, iters=4))
    assert te.losses == pytest.approx(local.losses, rel=1e-5)
    model, config, _, _ = load_model(ckpt)
    assert config.transformer_impl == "transformer_engine"
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in model.state_dict()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_te_fp8_training_resumes_bitwise(tmp_path, mock_argv, train, monkeypatch, fmt) -> None:
    """3 + 3 iterations through a checkpoint (TE's _extra_state saved and restored) equal
    6 in one go, with the stand-in TE."""
    from mg.core.testing import te_standin

    te_standin.install(monkeypatch)
    monkeypatch.setenv(te_standin.UNSAFE_PICKLE_ENV, "1")  # TE 2.x's opt-in for delayed scaling
    common = [*TE, "--fp8-format", "hybrid", "--bf16", "--distributed-backend", "gloo"]
    common += ["--attention-dropout", "0", "--hidden-dropout", "0", "--ckpt-format", fmt]
    ckpt = str(tmp_path / "ckpt")
    whole = train(mock_argv(tmp_path, *common, iters=6)).losses
    save = ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"]
    first = train(mock_argv(tmp_path, *common, *save, iters=6)).losses
    second = train(mock_argv(tmp_path, *common, "--save", ckpt, "--load", ckpt, iters=6)).losses
    assert first + second == whole


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_te_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp16_with_tensor_parallelism_matches_one_process(tmp_path, mock_argv, train) -> None:
    """--fp16 at TP=2 (2 gloo ranks): dynamic loss scaling (from 2^16, hysteresis 1), the
    found-inf flag reduced over both ranks so they skip alike; the losses follow the
    single-process fp16 run (measured 1.8e-6 relative over 8 steps; fp16 sums split over
    two ranks round differently, hence 1e-4)."""
    fp16 = ["--fp16", "--initial-loss-scale", str(2.0**16), "--hysteresis", "1"]
    argv = mock_argv(
        tmp_path, "--attention-dropout", "0", "--hidden-dropout", "0", *fp16, mbs=2, gbs=4, iters=8
    )
    tp2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
    run_ranks = _sibling("test_ddp.py").run_ranks
    two = run_ranks([[*argv, *tp2]], 2, tmp_path / "two.json")[0]
    one = train([*argv, "--make-vocab-size-divisible-by", "128"])
    assert two["losses"] == pytest.approx(one.losses, rel=1e-4)
    assert one.losses[-1] < one.losses[0]


def test_fp8_without_transformer_impl_takes_megatron_default(
    tmp_path, mock_argv, capsys, monkeypatch
) -> None:
    """Megatron's default --transformer-impl is transformer_engine: an FP8 flag alone is not
    refused but runs in TE's layers, said in one line; without FP8 the default stays local."""
    from mg.core.testing import te_standin
    from mg.trainer.arguments import parse_args

    te_standin.install(monkeypatch)
    args = parse_args(mock_argv(tmp_path, "--fp8-format", "hybrid", "--bf16"))
    assert args.transformer_engine.transformer_impl == "transformer_engine"
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--fp8-format without --transformer-impl: using transformer_engine" in line
    assert parse_args(mock_argv(tmp_path)).transformer_engine.transformer_impl == "local"
