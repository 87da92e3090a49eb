"""mg-train gpt with gpt-oss's flags: core's config fields, refusals by name, the flag list
of Megatron-LM core_v0.19.0's examples/gptoss/02_train.sh through --dry-run, and TP = 2
training equal to one process."""

from __future__ import annotations

import re

import pytest

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.cli import main
from mg.trainer.families import gpt_config

GPT_OSS = [
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--quick-geglu",
    "--glu-linear-offset",
    "1.0",
    "--activation-func-clamp-value",
    "7.0",
    "--softmax-type",
    "learnable",
    "--window-size",
    "7,0",  # seq 32: the sliding layers see 8 keys
    "--window-attn-skip-freq",
    "2",
    "--enable-gpt-oss",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "48",
    "--moe-aux-loss-coeff",
    "1e-3",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]

# examples/gptoss/02_train.sh at core_v0.19.0: MODEL_ARGS, MOE_ARGS, the mock DATA_ARGS,
# TRAINING_ARGS, MODEL_PARALLEL_ARGS and LOGGING_ARGS verbatim, with PP = the world size
# (4: the script's 12 layers split over 4 stages) and its paths as {placeholders}.
GPTOSS_02_TRAIN = """
--no-masked-softmax-fusion --transformer-impl transformer_engine --disable-bias-linear
--untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm
--num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 64
--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192
--use-mcore-models --rotary-percent 1.0 --rope-type rope --position-embedding-type rope
--rotary-base 10000 --no-bias-gelu-fusion --export-force-local-attention
--no-bias-dropout-fusion --quick-geglu --glu-linear-offset 1.0 --softmax-type learnable
--window-attn-skip-freq 2 --activation-func-clamp-value 7.0 --window-size 127,0
--enable-gpt-oss
--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-3 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--overlap-param-gather --overlap-grad-reduce --moe-ffn-hidden-size 2048
--moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 --moe-permute-fusion
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {cache}
--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1
--micro-batch-size 1 --global-batch-size 128 --lr 1.0e-5 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-decay-style cosine --min-lr 1.0e-6 --weight-decay 0.1
--lr-warmup-fraction 0.05 --clip-grad 1.0 --bf16 --use-flash-attn --attention-softmax-in-fp32
--accumulate-allreduce-grads-in-fp32 --disable-bf16-reduced-precision-matmul
--recompute-activations
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
--expert-model-parallel-size 1 --sequence-parallel --context-parallel-size 1
--use-distributed-optimizer --fp8-format hybrid --fp8-param-gather --fp8-amax-compute-algo max
--fp8-amax-history-len 1024
--log-interval 1 --save-interval 10000 --eval-interval 50000000 --eval-iters 0 --save {ckpt}
--tensorboard-dir {ckpt}/tensorboard --moe-per-layer-logging --no-load-optim --no-load-rng
--log-throughput
"""


def _value(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return float(match.group(1))


def test_gpt_oss_flags_become_core_config_fields(tmp_path, mock_argv):
    config = gpt_config(parse_args(mock_argv(tmp_path, *GPT_OSS)), 128)
    assert config.softmax_type == "learnable"
    assert config.activation == "quick_geglu" and config.gated_linear_unit
    assert (config.glu_linear_offset, config.activation_func_clamp_value) == (1.0, 7.0)
    assert [config.is_window_layer(i) for i in (1, 2)] == [True, False]
    assert config.add_bias_linear  # the experts' and the router's biases too
    # Megatron's --enable-gpt-oss (megatron/post_training/model_builder.py)
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == 32.0
    assert config.original_max_position_embeddings == 131072
    assert (config.beta_fast, config.beta_slow, config.mscale, config.mscale_all_dim) == (
        32.0,
        1.0,
        1.0,
        0.0,
    )
    assert config.yarn_correction_range_round_to_int is False


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--glu-linear-offset", "1"], "--glu-linear-offset applies to a gated MLP"),
        (["--quick-geglu", "--swiglu"], "--quick-geglu with --swiglu"),
        (["--swiglu", "--activation-func-clamp-value", "0"], "must be positive"),
        (
            ["--softmax-type", "learnable", "--transformer-impl", "transformer_engine"],
            "--softmax-type learnable with --transformer-impl transformer_engine",
        ),
        (
            ["--softmax-type", "off-by-one", "--attention-backend", "flash"],
            "--softmax-type off-by-one with --attention-backend flash",
        ),
    ],
)
def test_bad_gpt_oss_flags_are_refused_in_one_line(tmp_path, mock_argv, extra, message):
    with pytest.raises(ArgumentError, match=message) as info:
        parse_args(mock_argv(tmp_path, *extra))
    assert "\n" not in str(info.value)


def test_gptoss_02_train_sh_dry_run_plan(tmp_path, monkeypatch, capsys):
    """Every flag of 02_train.sh is accepted; the plan counts the sinks, the biases-free
    experts and the router, and says the KV bytes per token."""
    argv = GPTOSS_02_TRAIN.format(cache=tmp_path / "cache", ckpt=tmp_path / "ckpt").split()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["gpt", "--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    h, heads, groups, d, layers, ffn, experts, vocab = 512, 64, 8, 8, 12, 2048, 4, 128384
    attention = h * (heads * d + 2 * groups * d) + heads * d * h + heads  # qkv, proj, sinks
    expert = h * 2 * ffn + ffn * h  # no biases (--disable-bias-linear)
    per_layer = 2 * h + attention + experts * h + experts * expert  # norms, router
    total = layers * per_layer + h + 2 * vocab * h  # final norm, untied embeddings
    active = layers * (2 * h + attention + experts * h + 2 * expert) + h + 2 * vocab * h
    assert _value(r"number of parameters: ([\d.]+) B", out) == pytest.approx(total / 1e9, abs=1e-4)
    assert "meta-device model: " in out and " !)" not in out
    assert _value(r"active per token: ([\d.]+) B", out) == pytest.approx(active / 1e9, abs=1e-4)
    assert f"KV cache per token: {2 * groups * d * layers * 2} bytes in bf16" in out


def _off_by_one(flags: list[str]) -> list[str]:
    """`flags` with --softmax-type off-by-one (a zero sink logit) for learnable."""
    i = flags.index("--softmax-type")
    return [*flags[: i + 1], "off-by-one", *flags[i + 2 :]]


@pytest.mark.slow  # two ranks and one process, 10 iterations each: about a minute
@pytest.mark.parametrize(
    ("layout", "softmax"),
    [
        (["--tensor-model-parallel-size", "2"], "learnable"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "learnable"),
        (["--expert-model-parallel-size", "2"], "learnable"),
        (["--context-parallel-size", "2"], "learnable"),
        (["--context-parallel-size", "2"], "off-by-one"),
    ],
    ids=["tp2", "tp2-sp", "ep2", "cp2", "cp2-off-by-one"],
)
def test_gpt_oss_parallel_matches_one_process(tmp_path, mock_argv, train, layout, softmax):
    """TP = 2 (each rank its heads with their sinks and windows, the experts split, the
    biased router replicated), with sequence parallelism, EP = 2 (each rank two biased
    experts) and CP = 2 (the ring attention: each rank two of four 8-token chunks, the
    7-token windows masked by global position across chunks and ranks, each sink counted
    once in the merged softmax; learnable and off-by-one) on two gloo ranks equal one
    process, fp32, 10 iterations."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_gpt_oss_ddp", Path(__file__).with_name("test_ddp.py")
    )
    ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp)
    flags = GPT_OSS if softmax == "learnable" else _off_by_one(GPT_OSS)
    base = mock_argv(tmp_path, *flags, mbs=2, gbs=4, iters=10)
    tp = 2 if "--tensor-model-parallel-size" in layout else 1
    two_ranks = [*base, *layout, "--make-vocab-size-divisible-by", str(128 // tp)]
    (two,) = ddp.run_ranks([two_ranks], 2, tmp_path / "two.json")
    one = train([*base, "--make-vocab-size-divisible-by", "128"])
    assert two["losses"] == pytest.approx(one.losses, rel=1e-5)
    assert one.losses[-1] < one.losses[0]


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_gpt_oss_trains_and_resumes_bitwise(tmp_path, mock_argv, train, ckpt_format):
    """The sinks, the router and expert biases and the config's new fields survive a save
    and load in both formats: 4 + 4 iterations equal 8 straight."""
    flags = [*GPT_OSS, "--ckpt-format", ckpt_format]
    straight = train(mock_argv(tmp_path, *flags, iters=8))
    assert straight.losses[-1] < straight.losses[0] - 0.05
    ckpt = str(tmp_path / "ckpt")
    first = train(mock_argv(tmp_path, *flags, "--save", ckpt, "--exit-interval", "4", iters=8))
    second = train(mock_argv(tmp_path, *flags, "--load", ckpt, iters=8))
    assert first.losses + second.losses == straight.losses  # bitwise
