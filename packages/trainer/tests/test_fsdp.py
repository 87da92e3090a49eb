"""mg-train --use-megatron-fsdp / --use-torch-fsdp2 (FSDP2) on gloo ranks equals one process.

Tolerance (fp32): 1e-5 relative on losses and 1e-4 on grad norms, as for DDP and the
distributed optimizer (test_ddp.py, test_dist_opt.py): the reduce-scatter sums the
micro-batches' gradients in another order than one process accumulating them, a
~1e-7 relative difference per step that AdamW carries through the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mg.core.checkpoint.fsdp_dtensor import is_fsdp_dtensor
from mg.core.checkpoint.megatron_dist import checkpoint_is_megatron_layout
from mg.core.checkpoint.model_io import load_model
from mg.core.testing.launch import launch_workers
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.dry_run import report
from mg.trainer.fsdp_dry_run import per_rank_bytes

WORKER = Path(__file__).with_name("fsdp_worker.py")
FLAGS = ["--attention-dropout", "0", "--hidden-dropout", "0"]
FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4


def _run_ranks(argvs: list[list[str]], world_size: int, out: Path) -> list[dict]:
    launch_workers(str(WORKER), world_size, [str(out), json.dumps(argvs)], timeout=600)
    return json.loads(out.read_text())


def _assert_close(reference: list[float], got: list[float], rtol: float) -> None:
    assert len(reference) == len(got)
    for a, b in zip(reference, got, strict=True):
        assert abs(a - b) <= rtol * abs(a), (reference, got)


def _strategy(name: str) -> list[str]:
    return [*FSDP, "--data-parallel-sharding-strategy", name]


def test_dp2_fsdp_matches_one_process(tmp_path, mock_argv, train) -> None:
    """Global batch 8: one process (4 micro-batches of 2) vs DP=2 (2 micro-batches each,
    the first without gradient sync) with parameters sharded (ZeRO-3, prefetching the
    next layer's all-gather) and not sharded at all: the same losses and grad norms;
    each rank holds half the parameters, or all of them; 4 units sharded (the learned
    positions, 2 layers, the root: the tied weight is sharded by vocabulary rows outside
    them) and 5 replicated (the tied embedding too)."""
    argv = mock_argv(
        tmp_path, *FLAGS, "--eval-interval", "3", "--eval-iters", "1", mbs=2, gbs=8, iters=6
    )
    one = train(argv)
    zero3, replicated = _run_ranks(
        [[*argv, *_strategy("optim_grads_params")], [*argv, *_strategy("no_shard")]],
        2,
        tmp_path / "two.json",
    )
    for run in (zero3, replicated):
        _assert_close(one.losses, run["losses"], LOSS_RTOL)
        _assert_close(one.grad_norms, run["grad_norms"], NORM_RTOL)
        _assert_close([v for _, v in one.validation], [v for _, v in run["validation"]], LOSS_RTOL)
        assert len(run["validation"]) == 2
    # sharded: the tied weight stays sharded by vocabulary rows, in no unit
    assert zero3["units"] == 4 and zero3["vocab_shards"] and not zero3["tied_gradient"]
    # replicated: a unit of the tied embedding, the head's and the lookup's gradient parts
    # summed in one tensor
    assert replicated["units"] == 5 and replicated["tied_gradient"]
    assert sum(zero3["shares"]) == zero3["numel"]
    assert max(zero3["shares"]) - min(zero3["shares"]) <= zero3["numel"] // 10
    assert zero3["prefetching"] == 1  # layer 1 starts layer 2's gather
    assert replicated["shares"] == [replicated["numel"]] * 2
    assert replicated["prefetching"] == 0
    # the dry run's plan of a rank's weights is what each rank holds (to the uneven chunk)
    planned = per_rank_bytes("optim_grads_params", zero3["numel"], 2, 4, 0, 0, prefetch=True)
    assert abs(planned["weights"] - 4 * max(zero3["shares"])) <= 4 * zero3["numel"] // 100


@pytest.mark.slow
def test_dp4_each_strategy_tp_and_hsdp_match_one_process(tmp_path, mock_argv, train) -> None:
    """20 iterations on 4 ranks, one launch: DP=4 at each strategy, DP=2 × TP=2 with
    sequence parallelism, HSDP (2 replicas of 2 shards), and ZeRO-3 with full activation
    recompute and an untied output layer (its own unit, the embedding another) under
    --use-torch-fsdp2: every run equals one process."""
    # the vocabulary padded alike at TP=1 and TP=2 (127 -> 128), so the models are equal
    padding = ["--make-vocab-size-divisible-by", "64"]
    argv = mock_argv(tmp_path, *FLAGS, *padding, mbs=2, gbs=16, iters=20)
    untied = [*argv, "--untie-embeddings-and-output-weights"]
    one = train(argv)
    one_untied = train(untied)
    strategies = ("no_shard", "optim", "optim_grads", "optim_grads_params")
    runs = _run_ranks(
        [
            *([*argv, *_strategy(s)] for s in strategies),
            [
                *argv,
                *_strategy("optim_grads_params"),
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
            [*argv, *_strategy("optim_grads"), "--num-distributed-optimizer-instances", "2"],
            [
                *untied,
                "--use-torch-fsdp2",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
        ],
        4,
        tmp_path / "four.json",
    )
    for run in runs[:-1]:
        _assert_close(one.losses, run["losses"], LOSS_RTOL)
        _assert_close(one.grad_norms, run["grad_norms"], NORM_RTOL)
    _assert_close(one_untied.losses, runs[-1]["losses"], LOSS_RTOL)
    _assert_close(one_untied.grad_norms, runs[-1]["grad_norms"], NORM_RTOL)
    no_shard, optim, optim_grads, zero3, tp, hsdp, untied_run = runs
    assert no_shard["shares"] == [no_shard["numel"]] * 4
    for run in (optim, optim_grads, zero3, untied_run):
        assert sum(run["shares"]) == run["numel"]
    # a quarter each; what TP replicates (norms, biases) is sharded over DP only
    assert max(tp["shares"]) < tp["numel"] // 3
    assert sum(hsdp["shares"]) == 2 * hsdp["numel"]  # two replicas of the shards
    assert untied_run["units"] == 6  # 2 layers, the embedding, its positions, the output, root


@pytest.mark.slow
def test_dp2_fsdp_with_mtp_matches_one_process(tmp_path, mock_argv, train) -> None:
    """Multi-token prediction runs the output head once per depth, so the tied embedding
    is gathered for each head's backward (not kept from the head's forward as without
    MTP); tied and untied, ZeRO-3 at DP=2 equals one process."""
    mtp = ["--position-embedding-type", "rope", "--mtp-num-layers", "1"]
    argv = mock_argv(tmp_path, *FLAGS, *mtp, mbs=2, gbs=8, iters=4)
    untied = [*argv, "--untie-embeddings-and-output-weights"]
    one, one_untied = train(argv), train(untied)
    runs = _run_ranks(
        [[*argv, *_strategy("optim_grads_params")], [*untied, *_strategy("optim_grads_params")]],
        2,
        tmp_path / "two.json",
    )
    for reference, run in zip((one, one_untied), runs, strict=True):
        _assert_close(reference.losses, run["losses"], LOSS_RTOL)
        _assert_close(reference.grad_norms, run["grad_norms"], NORM_RTOL)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--use-megatron-fsdp"], "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor"),
        (
            ["--use-torch-fsdp2", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
            "cannot both be set",
        ),
        (["--data-parallel-sharding-strategy", "optim"], "needs --use-megatron-fsdp"),
        (["--num-distributed-optimizer-instances", "2"], "needs --use-megatron-fsdp"),
        (["--use-torch-fsdp2"], "--use-torch-fsdp2 needs --untie-embeddings-and-output-weights"),
        (
            [*FSDP, "--pipeline-model-parallel-size", "2"],
            "not supported with pipeline parallelism",
        ),
        (
            ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--fp16"],
            "--use-torch-fsdp2 is not supported with --fp16",
        ),
        (
            [
                "--use-torch-fsdp2",
                "--untie-embeddings-and-output-weights",
                "--use-distributed-optimizer",
            ],
            "--use-torch-fsdp2 is not supported with --use-distributed-optimizer",
        ),
        (
            [*FSDP, "--megatron-fsdp-main-params-dtype", "bf16"],
            "--megatron-fsdp-main-params-dtype bf16",
        ),
        (
            [*FSDP, "--num-experts", "4", "--expert-model-parallel-size", "2"]
            + ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
            "use --expert-tensor-parallel-size 1",
        ),
    ],
)
def test_refused_combinations(tmp_path, mock_argv, flags, message) -> None:
    with pytest.raises(ArgumentError, match=message):
        parse_args(mock_argv(tmp_path, *flags), world_size=4)


def test_strategy_implies_megatrons_overlap(tmp_path, mock_argv) -> None:
    """As in Megatron: optim_grads overlaps the gradient reduction, optim_grads_params also
    the parameter gather; --use-torch-fsdp2 shards everything unless told otherwise."""
    grads = parse_args(mock_argv(tmp_path, *_strategy("optim_grads")))
    assert grads.distributed.overlap_grad_reduce and not grads.distributed.overlap_param_gather
    params = parse_args(mock_argv(tmp_path, *_strategy("optim_grads_params")))
    assert params.distributed.overlap_param_gather
    torch2 = parse_args(
        mock_argv(tmp_path, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights")
    )
    assert torch2.fsdp.data_parallel_sharding_strategy == "optim_grads_params"
    assert parse_args(mock_argv(tmp_path)).fsdp.data_parallel_sharding_strategy == "no_shard"


def test_fsdp_dtensor_resumes_bitwise_and_loads_without_fsdp(tmp_path, mock_argv, train) -> None:
    """DP=2 ZeRO-3 saves --ckpt-format fsdp_dtensor at iterations 4 and 8; a DP=2 run
    resumed from iteration 4 repeats iterations 5-8 bit for bit; one process without FSDP
    loads the same shards (resharded by DCP) and continues as the uninterrupted run; the
    readers of mg-eval and mg-serve read the weights."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=8)
    ckpt = str(tmp_path / "ckpt")
    zero3 = [*argv, *_strategy("optim_grads_params")]
    saving = [*zero3, "--save", ckpt, "--save-interval", "4"]
    resuming = [*zero3, "--load", ckpt, "--ckpt-step", "4"]
    whole, resumed = _run_ranks([saving, resuming], 2, tmp_path / "two.json")
    assert resumed["losses"] == whole["losses"][4:]
    assert resumed["grad_norms"] == whole["grad_norms"][4:]
    plain = train([*argv, "--load", ckpt, "--ckpt-step", "4"])
    assert sum(p.numel() for p in load_model(ckpt)[0].parameters()) == whole["numel"]  # mg-eval's
    _assert_close(whole["losses"][4:], plain.losses, LOSS_RTOL)
    _assert_close(whole["grad_norms"][4:], plain.grad_norms, NORM_RTOL)


def test_torch_fsdp2_saves_and_resumes_torch_dist(tmp_path, mock_argv, train) -> None:
    """--use-torch-fsdp2 (ZeRO-3, DP=2) saves --ckpt-format torch_dist in Megatron-Core's key
    layout, every rank writing its own shards: a DP=2 FSDP run resumed from iteration 4
    repeats iterations 5-8 bit for bit, and one process without FSDP loads the same
    checkpoint and continues as the uninterrupted run."""
    argv = mock_argv(
        tmp_path, *FLAGS, "--untie-embeddings-and-output-weights", mbs=2, gbs=8, iters=8
    )
    ckpt = str(tmp_path / "ckpt")
    fsdp2 = [*argv, "--use-torch-fsdp2", "--ckpt-format", "torch_dist"]
    saving = [*fsdp2, "--save", ckpt, "--save-interval", "4"]
    resuming = [*fsdp2, "--load", ckpt, "--ckpt-step", "4"]
    whole, resumed = _run_ranks([saving, resuming], 2, tmp_path / "two.json")
    assert resumed["losses"] == whole["losses"][4:]
    assert resumed["grad_norms"] == whole["grad_norms"][4:]
    folder = Path(ckpt) / "iter_0000004"
    assert not is_fsdp_dtensor(folder) and checkpoint_is_megatron_layout(folder)
    plain = train([*argv, "--load", ckpt, "--ckpt-step", "4"])
    _assert_close(whole["losses"][4:], plain.losses, LOSS_RTOL)
    _assert_close(whole["grad_norms"][4:], plain.grad_norms, NORM_RTOL)


@pytest.mark.slow
def test_fsdp_with_expert_parallelism_resumes_and_loads_in_one_process(
    tmp_path, mock_argv, train
) -> None:
    """DP=4 ZeRO-3 with EP=2 (4 experts: each rank keeps 2, sharded over its expert
    data-parallel pair) saves fsdp_dtensor at iteration 3 with the experts under their
    global numbers: the same layout resumes bit for bit, and one process (every expert,
    no FSDP) loads it and continues as the uninterrupted run."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=16, iters=6)
    argv += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
    ckpt = str(tmp_path / "ckpt")
    ep = [*argv, *_strategy("optim_grads_params"), "--expert-model-parallel-size", "2"]
    saving = [*ep, "--save", ckpt, "--save-interval", "3"]
    whole, resumed = _run_ranks(
        [saving, [*ep, "--load", ckpt, "--ckpt-step", "3"]], 4, tmp_path / "four.json"
    )
    assert resumed["losses"] == whole["losses"][3:]
    assert resumed["grad_norms"] == whole["grad_norms"][3:]
    one = train([*argv, "--load", ckpt, "--ckpt-step", "3"])
    _assert_close(whole["losses"][3:], one.losses, LOSS_RTOL)
    _assert_close(whole["grad_norms"][3:], one.grad_norms, NORM_RTOL)


def test_dry_run_plans_each_strategy(tmp_path, mock_argv) -> None:
    """WORLD_SIZE=8 (DP 8), ZeRO-3: the weights, gradients and optimizer state of the
    sharded strategies are no_shard's / 8; what is gathered shrinks at ZeRO-3 only."""
    flags = [*_strategy("optim_grads_params"), "--dry-run", "--num-layers", "4"]
    flags += ["--hidden-size", "256", "--ffn-hidden-size", "1024"]
    text = report(parse_args(mock_argv(tmp_path, *flags, mbs=2, gbs=16), world_size=8))
    assert (
        "fully sharded data parallel (--use-megatron-fsdp, optim_grads_params): shards over 8"
        in text
    )
    rows = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
            rows[words[0]] = [float(w) for w in words[1:6]]
    no_shard, optim, optim_grads, zero3 = (rows[k] for k in rows)
    for sharded in (optim, optim_grads, zero3):
        for part in range(3):  # weights, grads, optimizer state: 1/8 (to the printed digit)
            assert abs(sharded[part] - no_shard[part] / 8) <= 0.051
    assert optim[3] == optim_grads[3] == no_shard[3] > zero3[3]
    assert no_shard[4] > optim[4] == optim_grads[4] > zero3[4]


@pytest.mark.slow
def test_dp4_fsdp_dtensor_loads_at_dp2_and_in_one_process(tmp_path, mock_argv, train) -> None:
    """A DP=4 ZeRO-3 save at iteration 3, loaded at DP=2 with FSDP and by one process
    without it: both continue as the uninterrupted DP=4 run."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=16, iters=6)
    ckpt = str(tmp_path / "ckpt")
    zero3 = [*argv, *_strategy("optim_grads_params")]
    (four,) = _run_ranks([[*zero3, "--save", ckpt, "--save-interval", "3"]], 4, tmp_path / "4.json")
    (two,) = _run_ranks([[*zero3, "--load", ckpt, "--ckpt-step", "3"]], 2, tmp_path / "2.json")
    one = train([*argv, "--load", ckpt, "--ckpt-step", "3"])
    for run in (two, {"losses": one.losses, "grad_norms": one.grad_norms}):
        _assert_close(four["losses"][3:], run["losses"], LOSS_RTOL)
        _assert_close(four["grad_norms"][3:], run["grad_norms"], NORM_RTOL)


@pytest.mark.slow
def test_dp4_fsdp_with_context_parallel_moe_and_mamba_match_one_process(
    tmp_path, mock_argv, train
) -> None:
    """One 4-rank launch: ZeRO-3 over data × context ranks (CP=2 × DP=2), an MoE GPT
    (4 experts, top-2, aux loss) with the experts on every rank and at EP=2 (each rank's
    experts sharded over the expert data-parallel pair), EP=2 beside CP=2 and beside
    TP=2 + SP (experts whole on their ranks: --expert-tensor-parallel-size 1), and a
    Mamba hybrid (M*M-), each equal to one process."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=16, iters=10)
    moe = [*argv, "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
    mamba = ["mamba", *argv[1:], "--hybrid-override-pattern", "M*M-", "--num-layers", "4"]
    mamba += ["--mamba-num-groups", "1", "--mamba-head-dim", "16"]
    zero3 = _strategy("optim_grads_params")
    ep2 = ["--expert-model-parallel-size", "2"]
    moe_tp = [*moe, "--make-vocab-size-divisible-by", "64"]  # 128 rows at TP=1 and TP=2
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    runs = _run_ranks(
        [
            [*argv, *zero3, "--context-parallel-size", "2"],
            [*moe, *zero3],
            [*moe, *zero3, *ep2],
            [*mamba, *zero3],
            [*moe, *zero3, *ep2, "--context-parallel-size", "2"],
            [*moe_tp, *zero3, *ep2, *tp2, "--expert-tensor-parallel-size", "1"],
        ],
        4,
        tmp_path / "four.json",
    )
    ones = {id(reference): train(reference) for reference in (argv, moe, mamba, moe_tp)}
    references = (argv, moe, moe, mamba, moe, moe_tp)
    for reference, run in zip(references, runs, strict=True):
        one = ones[id(reference)]
        _assert_close(one.losses, run["losses"], LOSS_RTOL)
        _assert_close(one.grad_norms, run["grad_norms"], NORM_RTOL)
    for run in (runs[0], runs[1], runs[3]):
        assert sum(run["shares"]) == run["numel"]


@pytest.mark.slow
def test_dp2_tp2_fsdp_dtensor_loads_in_one_process(tmp_path, mock_argv, train) -> None:
    """DP=2 × TP=2 + SP, ZeRO-3: a save at iteration 3 (shards strided over the 2-D mesh)
    loads into one process, which continues as the 4-rank run did."""
    padding = ["--make-vocab-size-divisible-by", "64"]  # 128 rows at TP=1 and TP=2
    argv = mock_argv(tmp_path, *FLAGS, *padding, mbs=2, gbs=8, iters=6)
    ckpt = str(tmp_path / "ckpt")
    tp = [*argv, *_strategy("optim_grads_params"), "--tensor-model-parallel-size", "2"]
    tp += ["--sequence-parallel", "--save", ckpt, "--save-interval", "3"]
    (four,) = _run_ranks([tp], 4, tmp_path / "four.json")
    one = train([*argv, "--load", ckpt, "--ckpt-step", "3"])
    _assert_close(four["losses"][3:], one.losses, LOSS_RTOL)
    _assert_close(four["grad_norms"][3:], one.grad_norms, NORM_RTOL)


BF16_RTOL = 5e-4
"""FSDP gathers and computes in bf16 (MixedPrecisionPolicy), one process under bf16
autocast with fp32 weights: the matmuls see the same bf16 inputs, the rest differs in
rounding (~1e-6 relative after 3 iterations, measured)."""


@pytest.mark.slow
def test_dp2_fsdp_bf16_matches_one_process(tmp_path, mock_argv, train) -> None:
    """--bf16 at DP=2, ZeRO-3, gradients reduced in fp32 and in bf16 (--grad-reduce-in-bf16):
    within BF16_RTOL of one process's bf16 run."""
    argv = mock_argv(tmp_path, *FLAGS, "--bf16", mbs=2, gbs=8, iters=10)
    one = train(argv)
    zero3 = [*argv, *_strategy("optim_grads_params")]
    runs = _run_ranks([zero3, [*zero3, "--grad-reduce-in-bf16"]], 2, tmp_path / "two.json")
    for run in runs:
        _assert_close(one.losses, run["losses"], BF16_RTOL)


# Megatron's examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh: its FSDP block
LLAMA3_FSDP_RECIPE = [
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--no-gradient-accumulation-fusion",
    "--calculate-per-token-loss",
    "--init-model-with-meta-device",
    "--ckpt-format",
    "fsdp_dtensor",
    "--use-nccl-ub",
    "--fsdp-double-buffer",
    "--fsdp-manual-registration",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--untie-embeddings-and-output-weights",
    "--bf16",
]


def test_megatron_fsdp_recipe_flags_plan(tmp_path, mock_argv) -> None:
    text = report(
        parse_args(mock_argv(tmp_path, *LLAMA3_FSDP_RECIPE, "--dry-run", mbs=1), world_size=8)
    )
    assert "fully sharded data parallel (--use-megatron-fsdp, optim_grads_params)" in text
    with pytest.raises(ArgumentError, match="--fsdp-double-buffer.* need --use-megatron-fsdp"):
        parse_args(mock_argv(tmp_path, "--fsdp-double-buffer"))


# Megatron-LM core_v0.19.0's examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh, every
# flag of its mock-data FP8 run (paths replaced), as the script passes them
_LLAMA3_FSDP_SCRIPT = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion
--no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235 --use-megatron-fsdp --data-parallel-sharding-strategy
optim_grads_params --no-gradient-accumulation-fusion --calculate-per-token-loss
--init-model-with-meta-device --ckpt-format fsdp_dtensor --use-nccl-ub --fsdp-double-buffer
--fsdp-manual-registration --fp8-format hybrid --fp8-amax-history-len 1024
--fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1
--context-parallel-size 1 --sequence-parallel --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --mock-data --tokenizer-type NullTokenizer
--vocab-size 128256 --tiktoken-pattern v2 --split 99,1,0
--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
--logging-level 20 --distributed-timeout-minutes 60
"""
LLAMA3_FSDP_SCRIPT = _LLAMA3_FSDP_SCRIPT.split()


def test_megatron_llama3_fsdp_script_is_accepted_by_the_dry_run(tmp_path) -> None:
    """Every flag of the script (8 GPUs, FP8 without --transformer-impl: Megatron's TE
    default), planned per GPU at each sharding strategy."""
    paths = ["--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "ckpt")]
    paths += ["--load", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb")]
    args = parse_args(["gpt", *LLAMA3_FSDP_SCRIPT, *paths, "--dry-run"], world_size=8)
    assert args.transformer_engine.transformer_impl == "transformer_engine"
    text = report(args)
    assert "number of parameters: 8.0313 B" in text
    assert "fully sharded data parallel (--use-megatron-fsdp, optim_grads_params)" in text
    planned = next(line for line in text.splitlines() if line.startswith("  optim_grads_params"))
    assert planned.endswith("<")  # the run's strategy, its MiB per GPU on the line
