"""FP8 without Transformer Engine: Megatron's FP8 flags onto torchao's float8 linears.

On a CPU there are no FP8 matmuls, so a run is refused by name; with `MG_FP8_EMULATE=1`
torchao rounds every operand to FP8 as on a GPU and multiplies in high precision, which
is what these tests train with (the GPU check runs the real `_scaled_mm`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mg.core.models.te_spec import FP8Options, transformer_engine_installed
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.arguments.transformer_engine import fp8_options

pytest.importorskip("torchao")
from torchao.float8.config import ScalingGranularity, ScalingType  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from mg.core.models.float8_training import convert_to_float8, float8_config  # noqa: E402

BASE = ["gpt", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
BASE += ["--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "4"]
BASE += ["--mock-data"]
LOCAL = ["--transformer-impl", "local"]
TENSORWISE = [*LOCAL, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def _error(argv: list[str]) -> str:
    with pytest.raises(ArgumentError) as err:
        parse_args(argv)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([*LOCAL, "--fp8-format", "hybrid"], "--fp8-recipe delayed needs Transformer Engine"),
        ([*TENSORWISE[:-1], "mxfp8"], "--fp8-recipe mxfp8 needs Transformer Engine"),
        ([*TENSORWISE[:-1], "blockwise"], "--fp8-recipe blockwise needs Transformer Engine"),
        ([*TENSORWISE, "--fp8-amax-history-len", "1024"], "drop --fp8-amax-history-len"),
        ([*TENSORWISE, "--fp8-amax-compute-algo", "max"], "drop --fp8-amax-compute-algo"),
        ([*TENSORWISE, "--fp8-margin", "1"], "drop --fp8-margin"),
        ([*TENSORWISE[:-1], "rowwise"], "use --fp8-format e4m3"),
    ],
)
def test_recipes_torchao_lacks_are_refused_by_name(extra: list[str], expected: str) -> None:
    assert expected in _error([*BASE, *extra, "--dry-run"])


def test_a_run_without_fp8_matmuls_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("MG_FP8_EMULATE", raising=False)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has FP8 matmuls")
    assert "--fp8-format needs FP8 matmuls" in _error([*BASE, *TENSORWISE])
    monkeypatch.setenv("MG_FP8_EMULATE", "1")
    assert parse_args([*BASE, *TENSORWISE]).transformer_engine.transformer_impl == "local"


@pytest.mark.skipif(transformer_engine_installed(), reason="checks the choice without TE")
def test_fp8_alone_without_te_takes_torchao(monkeypatch, capsys) -> None:
    """No --transformer-impl: a run uses local layers with torchao (said in one line); a dry
    run plans Megatron's default, Transformer Engine's layers."""
    monkeypatch.setenv("MG_FP8_EMULATE", "1")
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    assert parse_args([*BASE, *fp8]).transformer_engine.transformer_impl == "local"
    assert "local layers, FP8 through torchao" in capsys.readouterr().err
    dry = parse_args([*BASE, *fp8, "--dry-run"])
    assert dry.transformer_engine.transformer_impl == "transformer_engine"


def test_te_refuses_torchaos_rowwise(monkeypatch) -> None:
    from mg.core.testing import te_standin

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    te_standin.install(monkeypatch)
    argv = [*BASE, "--transformer-impl", "transformer_engine", "--fp8-format", "e4m3"]
    assert "rowwise is torchao's" in _error([*argv, "--fp8-recipe", "rowwise"])


def _casts(config) -> dict[str, tuple[ScalingType, ScalingGranularity, torch.dtype]]:
    names = ("input", "weight", "grad_output", "input_for_grad_weight")
    names += ("weight_for_grad_input", "grad_output_for_grad_weight")
    casts = {name: getattr(config, f"cast_config_{name}") for name in names}
    return {k: (c.scaling_type, c.scaling_granularity, c.target_dtype) for k, c in casts.items()}


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DYNAMIC, DISABLED = ScalingType.DYNAMIC, ScalingType.DISABLED
TENSOR, AXIS = ScalingGranularity.TENSORWISE, ScalingGranularity.AXISWISE


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
            {"input": (DYNAMIC, TENSOR, E4M3), "weight": (DYNAMIC, TENSOR, E4M3)}
            | {"grad_output": (DYNAMIC, TENSOR, E5M2)}
            | {"grad_output_for_grad_weight": (DYNAMIC, TENSOR, E5M2)},
        ),
        (
            ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--no-fp8-wgrad"],
            {"grad_output": (DYNAMIC, TENSOR, E4M3)}
            | {"input_for_grad_weight": (DISABLED, TENSOR, E4M3)}
            | {"grad_output_for_grad_weight": (DISABLED, TENSOR, E4M3)},
        ),
        (
            ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
            {"input": (DYNAMIC, AXIS, E4M3), "grad_output": (DYNAMIC, AXIS, E4M3)}
            | {"input_for_grad_weight": (DYNAMIC, AXIS, E4M3)},
        ),
        (
            ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--no-fp8-wgrad"],
            {"weight_for_grad_input": (DYNAMIC, TENSOR, E4M3)}
            | {"input_for_grad_weight": (DISABLED, TENSOR, E4M3)},
        ),
    ],
)
def test_each_flag_builds_torchaos_recipe(flags: list[str], expected: dict) -> None:
    options = fp8_options(parse_args([*BASE, *LOCAL, *flags, "--dry-run"]))
    casts = _casts(float8_config(options))
    assert {name: casts[name] for name in expected} == expected
    if "rowwise" in flags:
        assert float8_config(options).round_scales_to_power_of_2


def test_decoder_linears_convert_except_the_bf16_layers() -> None:
    """--first-last-layers-bf16 keeps layers 0 and 3 as they are; the embedding and the
    output layer are never converted; --fp8-param-gather under FSDP gathers FP8 weights."""
    args = parse_args([*BASE, *TENSORWISE, "--first-last-layers-bf16", "--dry-run"])
    from mg.core.models.gpt import GPTModel
    from mg.trainer.families import gpt_config

    model = GPTModel(gpt_config(args, 128))
    names = convert_to_float8(model, fp8_options(args), emulate=True, fsdp_all_gather=True)
    float8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert float8 == set(names) and len(names) == 2 * 4
    assert all(n.startswith(("decoder.layers.1.", "decoder.layers.2.")) for n in names)
    layer = model.decoder.layers[1].mlp.linear_fc1
    assert layer.config.enable_fsdp_float8_all_gather and layer.config.emulate


def test_emulated_fp8_trains_close_to_fp32(tmp_path, mock_argv, train, monkeypatch) -> None:
    """Through mg-train with emulated FP8 (tensorwise, hybrid): each of 12 losses within 2%
    of the same run in fp32 (measured: at most 0.03%), and learning."""
    monkeypatch.setenv("MG_FP8_EMULATE", "1")
    argv = mock_argv(tmp_path, *NO_DROPOUT, "--lr", "3e-3", mbs=2, gbs=4, iters=12)
    plain = train(argv).losses
    fp8 = train([*argv, *TENSORWISE]).losses
    assert fp8 == pytest.approx(plain, rel=0.02)
    assert fp8[-1] < fp8[0]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_fp8_training_resumes_bitwise(tmp_path, mock_argv, train, monkeypatch, fmt) -> None:
    """3 + 3 emulated-FP8 iterations through a checkpoint equal 6 in one go (torchao keeps
    no scaling state: its scales are computed from each tensor)."""
    monkeypatch.setenv("MG_FP8_EMULATE", "1")
    common = [*TENSORWISE, *NO_DROPOUT, "--ckpt-format", fmt]
    ckpt = str(tmp_path / "ckpt")
    whole = train(mock_argv(tmp_path, *common, iters=6)).losses
    save = ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"]
    first = train(mock_argv(tmp_path, *common, *save, iters=6)).losses
    second = train(mock_argv(tmp_path, *common, "--save", ckpt, "--load", ckpt, iters=6)).losses
    assert first + second == whole


def _run_ranks():
    path = Path(__file__).with_name("test_ddp.py")
    spec = importlib.util.spec_from_file_location("_fp8_test_ddp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_ranks


@pytest.mark.slow
def test_fp8_composes_with_tensor_parallelism_and_recompute(
    tmp_path, mock_argv, train, monkeypatch
) -> None:
    """Emulated FP8 at TP=2 with sequence parallelism (2 gloo ranks), and with full
    recompute: the losses follow one process's FP8 run (per-tensor scales over a DTensor's
    shards are the whole tensor's, so only the sums' rounding differs)."""
    monkeypatch.setenv("MG_FP8_EMULATE", "1")
    argv = mock_argv(tmp_path, *TENSORWISE, *NO_DROPOUT, mbs=2, gbs=4, iters=6)
    argv += ["--make-vocab-size-divisible-by", "128"]
    one = train(argv).losses
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    tp2 += ["--make-vocab-size-divisible-by", "64"]
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    recompute += ["--recompute-num-layers", "1"]
    configs = [[*argv, *tp2], [*argv, *recompute]]
    two, recomputed = _run_ranks()(configs, 2, tmp_path / "two.json")
    assert two["losses"] == pytest.approx(one, rel=1e-3)
    assert recomputed["losses"] == pytest.approx(one, rel=1e-3)


def test_fp8_options_record_the_flags() -> None:
    args = parse_args([*BASE, *TENSORWISE, "--no-fp8-wgrad", "--dry-run"])
    assert fp8_options(args) == FP8Options(format="hybrid", recipe="tensorwise", wgrad=False)


@pytest.mark.slow
def test_fp8_under_fsdp_with_and_without_fp8_weight_gather(
    tmp_path, mock_argv, train, monkeypatch
) -> None:
    """Emulated FP8 under --use-megatron-fsdp (ZeRO-3, 2 gloo ranks), with the weights
    gathered in high precision and, with --fp8-param-gather, in FP8 (torchao's FSDP2
    all-gather of each shard cast with the whole tensor's scale): both follow one
    process's FP8 run."""
    monkeypatch.setenv("MG_FP8_EMULATE", "1")
    argv = mock_argv(tmp_path, *TENSORWISE, *NO_DROPOUT, mbs=2, gbs=4, iters=6)
    one = train(argv).losses
    fsdp = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
    fsdp += ["--data-parallel-sharding-strategy", "optim_grads_params"]
    gather = ["--fp8-param-gather", "--use-distributed-optimizer"]
    plain, fp8_gather = _run_ranks()(
        [[*argv, *fsdp], [*argv, *fsdp, *gather]], 2, tmp_path / "fsdp.json"
    )
    assert plain["losses"] == pytest.approx(one, rel=1e-3)
    assert fp8_gather["losses"] == pytest.approx(one, rel=1e-2)
