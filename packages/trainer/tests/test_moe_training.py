"""mg-train with Megatron's MoE flags: parsed into core's config, refused when they cannot
apply, and a training run whose log line reports the balancing losses."""

from __future__ import annotations

import pytest

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.arguments.moe import parse_moe_layer_freq
from mg.trainer.families import gpt_config
from mg.trainer.moe_step import logged_losses

MOE = [
    "--swiglu",
    "--disable-bias-linear",
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "1e-2",
]


def test_flags_become_core_config_fields(tmp_path, mock_argv):
    argv = mock_argv(
        tmp_path,
        *MOE,
        "--moe-layer-freq",
        "[0]+[1]*1",
        "--moe-grouped-gemm",
        "--moe-z-loss-coeff",
        "1e-3",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--moe-shared-expert-intermediate-size",
        "24",
        "--moe-shared-expert-gate",
        "--moe-expert-capacity-factor",
        "1.5",
        "--moe-token-drop-policy",
        "position",
    )
    config = gpt_config(parse_args(argv), 128)
    assert config.num_moe_experts == 4
    assert config.moe_layer_pattern == [False, True]
    assert config.moe_grouped_gemm and config.moe_shared_expert_gate
    assert config.moe_token_dispatcher_type == "alltoall"
    assert (config.moe_expert_capacity_factor, config.moe_token_drop_policy) == (1.5, "position")
    assert logged_losses(config) == ["load_balancing_loss", "z_loss"]
    dense = gpt_config(parse_args(mock_argv(tmp_path)), 128)
    assert dense.num_moe_experts is None and logged_losses(dense) == []


def test_moe_layer_freq_forms():
    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("[0]+[1]*3") == [0, 1, 1, 1]
    with pytest.raises(Exception, match="0/1 list"):
        parse_moe_layer_freq("__import__('os')")


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (["--moe-router-topk", "4"], 1, "--moe-router-topk needs --num-experts"),
        ([*MOE, "--moe-router-topk", "5"], 1, r"--moe-router-topk \(5\) must be between 1"),
        ([*MOE, "--expert-model-parallel-size", "3"], 1, "not divisible by"),
        ([*MOE, "--expert-model-parallel-size", "2"], 1, "must divide the 1 ranks"),
        ([*MOE, "--moe-pad-expert-input-to-capacity"], 1, "needs --moe-expert-capacity-factor"),
        ([*MOE, "--moe-router-enable-expert-bias"], 1, "^--moe-router-enable-expert-bias"),
        ([*MOE, "--expert-tensor-parallel-size", "2"], 2, "splits experts over"),
        (
            [*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--expert-tensor-parallel-size", "4"],
            4,
            r"size 4: mg-train splits experts over a divisor of --tensor-model-parallel-size \(2\)",
        ),
        (
            [*MOE, "--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"],
            4,
            "size 2 with --tensor-model-parallel-size 4 needs --sequence-parallel",
        ),
        (
            [*MOE, "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
            2,
            "needs --sequence-parallel",
        ),
        (
            [*MOE, "--moe-layer-recompute", "--recompute-granularity", "full"]
            + ["--recompute-method", "uniform", "--recompute-num-layers", "1"],
            1,
            "already recomputes the MoE layers",
        ),
    ],
)
def test_bad_moe_flags_are_refused_in_one_line(tmp_path, mock_argv, extra, world, message):
    with pytest.raises(ArgumentError, match=message) as info:
        parse_args(mock_argv(tmp_path, *extra, gbs=4 * world), world_size=world)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "extra",
    [
        ["--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"],
        ["--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"]
        + ["--expert-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
        + ["--attention-dropout", "0", "--expert-tensor-parallel-size", "1"]
        + ["--expert-model-parallel-size", "2"],
    ],
)
def test_expert_tensor_parallel_sizes_megatron_takes_are_taken(tmp_path, mock_argv, extra):
    """An expert-tensor-parallel size between 1 and TP, and 1 with context parallelism."""
    args = parse_args(mock_argv(tmp_path, *MOE, "--sequence-parallel", *extra), world_size=4)
    given = int(extra[extra.index("--expert-tensor-parallel-size") + 1])
    assert args.moe.expert_tensor_parallel_size == given


def test_moe_flag_for_bert_is_refused(tmp_path, mock_argv):
    argv = ["bert", *mock_argv(tmp_path, *MOE)[1:]]
    with pytest.raises(ArgumentError, match="gpt family only"):
        parse_args(argv)


def test_moe_gpt_trains_and_logs_balancing_losses(tmp_path, mock_argv, train, capsys):
    argv = mock_argv(
        tmp_path,
        *MOE,
        "--moe-z-loss-coeff",
        "1e-3",
        "--log-interval",
        "5",
        iters=10,
    )
    result = train(argv)
    assert result.losses[-1] < result.losses[0]
    balance = result.extra_losses["load_balancing_loss"]
    # E·Σ f_i P_i is 1 for perfectly even routing and at least ~1 otherwise
    assert all(0.9 < value < 4.0 for value in balance)
    assert len(result.extra_losses["z_loss"]) == 10
    out = capsys.readouterr().out
    assert "load_balancing_loss:" in out and "z_loss:" in out


def test_expert_bias_moves_during_training(tmp_path, mock_argv):
    from mg.core.models.moe import TopKRouter
    from mg.trainer.training import Trainer

    argv = mock_argv(
        tmp_path,
        *MOE[:-2],
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.01",
        iters=3,
    )
    trainer = Trainer(parse_args(argv))
    trainer.train()
    router = next(m for m in trainer.model.modules() if isinstance(m, TopKRouter))
    # three steps of ±0.01: every entry moved, by a multiple of the rate
    assert (router.expert_bias.abs() > 0.005).all()
    assert router.local_tokens_per_expert.sum() == 0


# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh, its flags as written
# there (paths replaced by mock data and tmp folders)
MIXTRAL_SCRIPT = """
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
--position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 8 --no-masked-softmax-fusion --no-position-embedding
--rotary-base 1000000
--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--overlap-param-gather --overlap-grad-reduce
--tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --split 99990,8,2
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
--use-distributed-optimizer --sequence-parallel
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
--lr-warmup-iters 500 --clip-grad 1.0 --bf16
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
--no-load-optim --no-load-rng
""".split()  # noqa: SIM905  (kept as the script writes it)


def test_megatron_mixtral_script_dry_run_on_64_gpus(tmp_path):
    from mg.trainer.dry_run import report

    argv = [
        "gpt",
        "--dry-run",
        *MIXTRAL_SCRIPT,
        "--save",
        str(tmp_path / "ckpt"),
        "--load",
        str(tmp_path / "ckpt"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    text = report(parse_args(argv, world_size=64))
    assert "EP 8 x expert TP 1 x expert DP 2, 1 experts per GPU" in text
    assert "number of parameters active per token: 12.88" in text
    assert "number of parameters: 46.70" in text and "!" not in text  # meta model agrees
    # without --dry-run the same flags are a run (EP x PP, the distributed optimizer), in
    # either checkpoint format
    run = parse_args(argv[:1] + argv[2:], world_size=64)
    assert run.moe.expert_model_parallel_size == 8 and not run.training.dry_run
    legacy = parse_args([*argv[:1], *argv[2:], "--ckpt-format", "torch"], world_size=64)
    assert legacy.checkpoint.ckpt_format == "torch" and legacy.distributed.use_distributed_optimizer


@pytest.mark.slow  # two trainer ranks x two runs: ~40 s on 2 shared cores
def test_expert_parallel_training_matches_one_process(tmp_path, mock_argv, train):
    """EP = 2 on two gloo ranks (each rank half the experts and its own micro-batches, the
    alltoall and allgather dispatchers) vs one process with every expert accumulating the
    same micro-batches: same losses, grad norms and validation loss, aux and z-loss on."""
    import json
    from pathlib import Path

    from mg.core.testing.launch import launch_workers

    flags = [
        *MOE,
        "--moe-z-loss-coeff",
        "1e-3",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
        "--clip-grad",
        "0.05",  # small enough to clip: the norm must include the other rank's experts
    ]
    argv = mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=6)
    one = train(argv)
    runs = [
        [*argv, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", kind]
        for kind in ("alltoall", "allgather")
    ]
    out = tmp_path / "ep.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    launch_workers(str(worker), 2, [str(out), json.dumps(runs)], timeout=300)
    for two in json.loads(out.read_text()):
        assert two["losses"] == pytest.approx(one.losses, rel=1e-5)
        assert two["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4)
        assert max(one.grad_norms) > 0.05  # clipping happened
        for (i, a), (j, b) in zip(one.validation, two["validation"], strict=True):
            assert i == j and b == pytest.approx(a, rel=1e-5)


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_moe_resume_is_bitwise_identical(tmp_path, mock_argv, train, ckpt_format):
    """Experts, router and the aux-loss-free expert bias (a persistent buffer) survive a
    save and load: 4 + 4 iterations equal 8 straight."""
    flags = [
        *MOE[:-2],
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.3",  # large: a bias lost on load would change the routing and the losses
        "--moe-grouped-gemm",
        "--ckpt-format",
        ckpt_format,
    ]
    straight = train(mock_argv(tmp_path, *flags, iters=8))
    ckpt = str(tmp_path / f"ckpt-{ckpt_format}")
    first = train(mock_argv(tmp_path, *flags, "--save", ckpt, "--exit-interval", "4", iters=8))
    second = train(mock_argv(tmp_path, *flags, "--load", ckpt, iters=8))
    assert first.losses + second.losses == straight.losses  # bitwise


def test_expert_parallel_checkpoints_resume_and_reshard(tmp_path, mock_argv, train):
    """EP = 2 × DP = 2 on two gloo ranks saves at iteration 4 in both formats: `torch` writes
    Megatron's per-expert-rank files (`mp_rank_00_000`, `mp_rank_00_001`, each rank's
    experts as local_experts.0..), `torch_dist` each expert under its global number. Resumed
    at EP = 2 the next iterations equal the straight run's bitwise (both formats); the
    torch_dist one resumed at EP = 1 (each rank every expert) equals it to fp32 rounding,
    and the torch one at EP = 1 is refused naming the size. --overlap-grad-reduce at EP = 2
    equals the run without. The global aux loss at DP = 2 equals one process over 10
    iterations (losses and logged loss within 1e-6). A dense checkpoint upcycled at
    TP = 2 + SP and at EP = 2 starts at the dense run's next loss (1e-6)."""
    import json
    from pathlib import Path

    from mg.core.testing.launch import launch_workers

    flags = [*MOE, "--moe-grouped-gemm", "--moe-router-score-function", "sigmoid"]
    flags += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.3"]
    ep2 = ["--expert-model-parallel-size", "2"]
    base = mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=8)
    saves = {fmt: str(tmp_path / f"ckpt-{fmt}") for fmt in ("torch", "torch_dist")}
    runs = [[*base, *ep2]]
    for fmt, path in saves.items():
        runs.append([*base, *ep2, "--ckpt-format", fmt, "--save", path, "--exit-interval", "4"])
        runs.append([*base, *ep2, "--ckpt-format", fmt, "--load", path])
    runs.append([*base, "--load", saves["torch_dist"]])  # EP = 1
    runs.append([*base, *ep2, "--overlap-grad-reduce", "--ddp-bucket-size", "2000"])
    clipped = [*base, *ep2, "--clip-grad", "0.05"]
    sharded = [*clipped, "--use-distributed-optimizer", "--overlap-grad-reduce"]
    runs += [clipped, sharded]
    dist_opt = str(tmp_path / "ckpt-dist-opt")  # its state as the plain optimizer's tensors
    runs.append([*sharded, "--save", dist_opt, "--exit-interval", "4"])
    runs.append([*sharded, "--load", dist_opt])
    runs.append([*base, "--clip-grad", "0.05", "--use-distributed-optimizer", "--load", dist_opt])
    # the global aux loss at DP = 2 (no EP): token counts summed over the data-parallel ranks
    global_aux = [*MOE, "--moe-router-load-balancing-type", "global_aux_loss"]
    global_aux += ["--attention-dropout", "0", "--hidden-dropout", "0"]
    runs.append(mock_argv(tmp_path, *global_aux, mbs=2, gbs=8, iters=10))
    # --moe-use-upcycling from a one-process dense checkpoint at TP = 2 + SP (experts as
    # DTensors) and at EP = 2 (each rank its experts)
    dense_flags = ["--swiglu", "--disable-bias-linear", "--ffn-hidden-size", "64"]
    dense_flags += ["--attention-dropout", "0", "--hidden-dropout", "0"]
    dense_flags += ["--make-vocab-size-divisible-by", "64"]  # 128 rows at TP 1 and 2 alike
    dense_ckpt = str(tmp_path / "dense")
    dense = train(
        mock_argv(tmp_path, *dense_flags, "--save", dense_ckpt, "--save-interval", "2", iters=3)
    )
    upcycle = [*dense_flags, "--num-experts", "4", "--moe-aux-loss-coeff", "1e-2"]
    upcycle += ["--moe-use-upcycling", "--load", dense_ckpt, "--ckpt-step", "2"]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    for name, layout in (("tp", tp2), ("ep", ep2)):
        runs.append(mock_argv(tmp_path, *upcycle, "--save", str(tmp_path / name), *layout, iters=4))
    out = tmp_path / "ep_ckpt.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    launch_workers(str(worker), 2, [str(out), json.dumps(runs)], timeout=300)
    results = json.loads(out.read_text())
    straight, torch_first, torch_resumed, dist_first, dist_resumed, at_ep1, overlap = (
        r["losses"] for r in results[:7]
    )
    plain, sharded, _, sharded_resumed, sharded_at_ep1, global_dp2, up_tp, up_ep = results[7:]
    # upcycled: the first loss is the dense run's next one (same weights, same batch)
    assert up_tp["losses"][0] == pytest.approx(dense.losses[2], rel=1e-6, abs=0)
    assert up_ep["losses"][0] == pytest.approx(dense.losses[2], rel=1e-6, abs=0)
    assert up_tp["losses"] == pytest.approx(up_ep["losses"], rel=1e-5)
    # Megatron's global aux loss: each micro-batch balanced over the tokens of both ranks,
    # i.e. one process's micro-batch of twice the size. Each rank's loss is its tokens' part
    # and the gradient average over DP leaves 1/dp of it (as in Megatron-LM, its issue
    # #3672): one process with half the coefficient; the logged value (loss / coefficient)
    # is the same
    half = [*global_aux, "--moe-aux-loss-coeff", "5e-3"]
    one = train(mock_argv(tmp_path, *half, mbs=4, gbs=8, iters=10))
    # (measured 7.5e-8 and 1.2e-7; counted over one rank's tokens the losses were 6e-6 and
    # the logged loss 3e-4 off, and the same coefficient's losses are 9e-6 off)
    assert global_dp2["losses"] == pytest.approx(one.losses, rel=1e-6)
    logged = global_dp2["extra_losses"]["global_load_balancing_loss"]
    assert logged == pytest.approx(one.extra_losses["global_load_balancing_loss"], rel=1e-6)
    # the distributed optimizer: dense weights sharded over DP, experts over expert DP
    assert sharded["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert sharded["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-5)
    assert max(plain["grad_norms"]) > 0.05  # clipped: the norm adds the other rank's experts
    assert sharded_resumed["losses"] == sharded["losses"][4:]  # bitwise
    assert sharded_at_ep1["losses"] == pytest.approx(sharded["losses"][4:], rel=1e-5)
    # DDP's overlapped buckets for the dense weights, the experts over their own group
    assert overlap == pytest.approx(straight, rel=1e-6)
    assert torch_first == dist_first == straight[:4]
    assert torch_resumed == dist_resumed == straight[4:]  # bitwise
    assert at_ep1 == pytest.approx(straight[4:], rel=1e-5)
    iteration = Path(saves["torch"]) / "iter_0000004"
    assert sorted(p.name for p in iteration.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    import torch

    ranks = [
        torch.load(iteration / f"mp_rank_00_00{e}" / "model_optim_rng.pt", weights_only=False)
        for e in range(2)
    ]
    key = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    assert {f"{key}0", f"{key}1"} <= set(ranks[0]["model"]) and f"{key}2" not in ranks[0]["model"]
    assert not torch.equal(ranks[0]["model"][f"{key}0"], ranks[1]["model"][f"{key}0"])
    # mg-eval / mg-serve's reader: the torch files' experts merged, as the torch_dist ones
    from mg.core.checkpoint import load_model

    merged, from_dist = (load_model(saves[f])[0].state_dict() for f in ("torch", "torch_dist"))
    assert merged.keys() == from_dist.keys() and f"{key}3" in merged
    assert all(torch.equal(merged[k], from_dist[k]) for k in merged)
    with pytest.raises(
        ValueError, match="saved with expert-model-parallel-size 2, this run uses 1"
    ):
        train(mock_argv(tmp_path, *flags, "--load", saves["torch"], mbs=2, gbs=8, iters=8))


@pytest.mark.slow  # four trainer ranks on 2 shared cores
def test_expert_parallel_with_pipeline_matches_one_process(tmp_path, mock_argv, train):
    """PP = 2 × EP = 2 × DP = 2 on four gloo ranks (each stage's experts split over its two
    ranks) vs one process: same losses, validation and clipped grad norms (the norm sums
    each stage's dense squares and its EP group's experts, then the stages)."""
    import json
    from pathlib import Path

    from mg.core.testing.launch import launch_workers

    flags = [*MOE, "--attention-dropout", "0", "--hidden-dropout", "0", "--clip-grad", "0.05"]
    flags += ["--eval-interval", "3", "--eval-iters", "1"]
    argv = mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=6)
    one = train(argv)
    run = [*argv, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    out = tmp_path / "pp_ep.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    launch_workers(str(worker), 4, [str(out), json.dumps([run])], timeout=500)
    (four,) = json.loads(out.read_text())
    assert four["losses"] == pytest.approx(one.losses, rel=1e-5)
    assert four["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4)
    assert max(one.grad_norms) > 0.05  # clipping happened
    for (i, a), (j, b) in zip(one.validation, four["validation"], strict=True):
        assert i == j and b == pytest.approx(a, rel=1e-5)


@pytest.mark.slow  # two trainer ranks, two runs, and their one-process references
def test_moe_tensor_parallel_matches_one_process(tmp_path, mock_argv, train):
    """TP = 2 on two gloo ranks (experts and shared experts sharded as Megatron's MLP, the
    router replicated): with sequence parallelism (sequential experts), without (grouped
    GEMM, a gated shared expert) and with biases (grouped, shared expert, SP), losses,
    validation and clipped grad norms equal one process's; aux and z-loss on."""
    import json
    from pathlib import Path

    from mg.core.testing.launch import launch_workers

    flags = [*MOE, "--moe-z-loss-coeff", "1e-3", "--attention-dropout", "0", "--hidden-dropout"]
    flags += ["0", "--eval-interval", "3", "--eval-iters", "1", "--clip-grad", "0.05"]
    flags += ["--make-vocab-size-divisible-by", "64"]  # 128 rows at TP 1 and 2 alike
    shared = ["--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]
    variants = [
        ["--sequence-parallel"],
        ["--moe-grouped-gemm", *shared],
        ["--moe-grouped-gemm", "--sequence-parallel", *shared[:2], "biases"],
    ]
    flags_of = [
        [f for f in flags if not ("biases" in v and f == "--disable-bias-linear")]
        + [f for f in v if f != "biases"]
        for v in variants
    ]
    ones = [train(mock_argv(tmp_path, *f, mbs=2, gbs=8, iters=6)) for f in flags_of]
    runs = [
        mock_argv(tmp_path, *f, "--tensor-model-parallel-size", "2", mbs=2, gbs=8, iters=6)
        for f in flags_of
    ]
    out = tmp_path / "tp.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    launch_workers(str(worker), 2, [str(out), json.dumps(runs)], timeout=400)
    for one, two in zip(ones, json.loads(out.read_text()), strict=True):
        assert two["losses"] == pytest.approx(one.losses, rel=1e-5)
        assert two["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4)
        assert max(one.grad_norms) > 0.05  # clipped
        for (i, a), (j, b) in zip(one.validation, two["validation"], strict=True):
            assert i == j and b == pytest.approx(a, rel=1e-5)


@pytest.mark.slow  # nine two-rank runs
def test_moe_tensor_parallel_checkpoints_and_distributed_optimizer(tmp_path, mock_argv):
    """MoE at TP = 2 + SP on two gloo ranks: the distributed optimizer equals the plain one;
    saved at iteration 4 (torch, torch_dist, and torch_dist with the distributed optimizer)
    it resumes bitwise, and the torch_dist checkpoint resumes at TP = 1 × DP = 2 (1e-5)."""
    import json
    from pathlib import Path

    from mg.core.testing.launch import launch_workers

    flags = [*MOE, "--moe-z-loss-coeff", "1e-3", "--make-vocab-size-divisible-by", "64"]
    flags += ["--moe-grouped-gemm", "--attention-dropout", "0", "--hidden-dropout", "0"]
    one = mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=8)
    tp = [*one, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    dist_opt = [*tp, "--use-distributed-optimizer"]
    saves = {name: str(tmp_path / name) for name in ("torch", "torch_dist", "dist_opt")}
    runs = [tp, dist_opt]
    for name, argv in (("torch", tp), ("torch_dist", tp), ("dist_opt", dist_opt)):
        fmt = "torch" if name == "torch" else "torch_dist"
        runs.append([*argv, "--ckpt-format", fmt, "--save", saves[name], "--exit-interval", "4"])
        runs.append([*argv, "--ckpt-format", fmt, "--load", saves[name]])
    runs.append([*one, "--load", saves["torch_dist"]])  # TP = 1, DP = 2
    out = tmp_path / "tp_ckpt.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    launch_workers(str(worker), 2, [str(out), json.dumps(runs)], timeout=500)
    losses = [r["losses"] for r in json.loads(out.read_text())]
    straight, sharded = losses[:2]
    assert sharded == pytest.approx(straight, rel=1e-5)
    for first, resumed, reference in zip(
        losses[2:8:2], losses[3:8:2], [straight, straight, sharded], strict=True
    ):
        assert first == reference[:4] and resumed == reference[4:]  # bitwise
    assert losses[8] == pytest.approx(straight[4:], rel=1e-5)


@pytest.mark.slow  # four trainer ranks on 2 shared cores
def test_moe_tensor_and_expert_parallel_match_one_process(tmp_path, mock_argv, train):
    """TP = 2 (+SP) × EP = 2 on four gloo ranks (each TP rank's EP group carries the whole
    sequence, its experts' slices) vs one process: losses, validation and clipped grad
    norms, with the plain and the distributed optimizer."""
    import json
    from pathlib import Path

    from mg.core.testing.launch import launch_workers

    flags = [*MOE, "--moe-z-loss-coeff", "1e-3", "--make-vocab-size-divisible-by", "64"]
    flags += ["--attention-dropout", "0", "--hidden-dropout", "0", "--clip-grad", "0.05"]
    flags += ["--eval-interval", "3", "--eval-iters", "1"]
    argv = mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=6)
    one = train(argv)
    run = [*argv, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run += ["--expert-model-parallel-size", "2"]
    out = tmp_path / "tp_ep.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    runs = [run, [*run, "--use-distributed-optimizer"]]
    launch_workers(str(worker), 4, [str(out), json.dumps(runs)], timeout=500)
    for four in json.loads(out.read_text()):
        assert four["losses"] == pytest.approx(one.losses, rel=1e-5)
        assert four["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4)
        for (i, a), (j, b) in zip(one.validation, four["validation"], strict=True):
            assert i == j and b == pytest.approx(a, rel=1e-5)
    assert max(one.grad_norms) > 0.05  # clipped


def test_plain_optimizer_state_is_refused_for_the_expert_parallel_optimizer() -> None:
    """A torch-format save of the plain optimizer (its full state) cannot resume the
    distributed optimizer with the experts apart, nor Megatron's chained pair a plain
    optimizer; the flags cannot see which before the folder is read."""
    from mg.core.checkpoint import CheckpointError
    from mg.core.parallel.expert_optimizer import ExpertParallelDistributedOptimizer
    from mg.trainer.checkpointing import _load_optimizer

    optimizer = ExpertParallelDistributedOptimizer.__new__(ExpertParallelDistributedOptimizer)
    with pytest.raises(CheckpointError, match="--no-load-optim") as info:
        _load_optimizer(optimizer, {"state": {}}, None, "ckpt", 10, {})
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="with the experts apart.*--no-load-optim"):
        _load_optimizer(object(), [{}, {}], None, "ckpt", 10, {})


@pytest.mark.slow  # fifteen two-rank runs
def test_torch_format_with_whole_experts_and_the_expert_distributed_optimizer(tmp_path, mock_argv):
    """--ckpt-format torch on two gloo ranks, saved at iteration 3 and resumed to 6, equals
    the straight run bitwise: TP = 2 + SP with --expert-tensor-parallel-size 1 at EP = 1
    (files mp_rank_00, mp_rank_01, each with every expert whole) and EP = 2 (Megatron's
    legacy writers, data- or expert-data-parallel rank 0: mp_rank_00_000 and mp_rank_01_001
    only, experts 0-1 and 2-3 as local_experts.0-1); and the distributed optimizer with the
    experts apart, as Megatron's ChainedOptimizer writes it ([dense, experts] in
    distrib_optim.pt, each from its own group's rank 0) at EP = 2 x DP = 2 and at ETP = 1
    (experts sharded over the two TP ranks, their state in mp_rank_00's file only). The
    merged reader (mg-eval, mg-serve) gives the torch files' weights equal to a torch_dist
    save's."""
    import json
    from pathlib import Path

    import torch

    from mg.core.checkpoint import load_model
    from mg.core.testing.launch import launch_workers

    flags = [*MOE, "--make-vocab-size-divisible-by", "64", "--moe-grouped-gemm"]
    flags += ["--attention-dropout", "0", "--hidden-dropout", "0"]
    base = mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=6)
    etp1 = [*base, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    etp1 += ["--expert-tensor-parallel-size", "1"]
    ep2 = ["--expert-model-parallel-size", "2"]
    sharded = ["--use-distributed-optimizer"]
    variants = {
        "etp1": etp1,
        "etp1_ep2": [*etp1, *ep2],
        "ep2_dist_opt": [*base, *ep2, *sharded],
        "etp1_dist_opt": [*etp1, *sharded],
    }
    runs = []
    for name, argv in variants.items():
        save = str(tmp_path / name)
        runs.append([*argv, "--ckpt-format", "torch"])
        runs.append([*argv, "--ckpt-format", "torch", "--save", save, "--exit-interval", "3"])
        runs.append([*argv, "--ckpt-format", "torch", "--load", save])
    dist_save = str(tmp_path / "etp1_ep2_dist")
    runs.append([*variants["etp1_ep2"], "--save", dist_save, "--exit-interval", "3"])
    out = tmp_path / "torch_moe.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    launch_workers(str(worker), 2, [str(out), json.dumps(runs)], timeout=600)
    losses = [r["losses"] for r in json.loads(out.read_text())]
    for i, name in enumerate(variants):
        straight, first, resumed = losses[3 * i : 3 * i + 3]
        assert first + resumed == straight, name  # bitwise
    assert losses[3] == pytest.approx(losses[0], rel=1e-5)  # EP = 2 equals EP = 1
    folders = {
        name: sorted(p.name for p in (tmp_path / name / "iter_0000003").iterdir())
        for name in variants
    }
    assert folders["etp1"] == folders["etp1_dist_opt"] == ["mp_rank_00", "mp_rank_01"]
    assert folders["etp1_ep2"] == ["mp_rank_00_000", "mp_rank_01_001"]
    assert folders["ep2_dist_opt"] == ["mp_rank_00_000", "mp_rank_00_001"]
    files = {
        name: [
            torch.load(
                tmp_path / name / "iter_0000003" / f / "model_optim_rng.pt", weights_only=False
            )
            for f in folders[name]
        ]
        for name in variants
    }
    key = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    whole = files["etp1"][1]["model"][f"{key}3"]
    assert isinstance(whole, torch.Tensor) and whole.shape == (32, 32)  # 2 x 16 rows, whole
    assert torch.equal(whole, files["etp1"][0]["model"][f"{key}3"])
    ep_files = files["etp1_ep2"]
    assert f"{key}2" not in ep_files[1]["model"] and f"{key}1" in ep_files[1]["model"]
    assert all(vars(f["args"])["expert_tensor_parallel_size"] == 1 for f in ep_files)
    merged = load_model(str(tmp_path / "etp1_ep2"))[0].state_dict()
    from_dist = load_model(dist_save)[0].state_dict()
    assert merged.keys() == from_dist.keys()
    assert all(torch.equal(merged[k], from_dist[k]) for k in merged)
    assert torch.equal(merged[f"{key}3"], ep_files[1]["model"][f"{key}1"])

    # Megatron's ChainedOptimizer pair: [dense, experts] in each file, None where that
    # file's writer is not the group's rank 0
    def parts(name: str) -> list[list[bool]]:
        return [
            [part is not None for part in torch.load(path, weights_only=False)]
            for path in sorted((tmp_path / name / "iter_0000003").glob("*/distrib_optim.pt"))
        ]

    assert parts("ep2_dist_opt") == [[True, True], [False, True]]  # DP = 2, expert DP = 1
    assert parts("etp1_dist_opt") == [[True, True], [True, False]]  # expert DP over TP


@pytest.mark.slow  # four trainer ranks, fourteen runs on 2 shared cores
@pytest.mark.timeout(2400)
def test_moe_expert_tensor_parallel_below_tp_matches_one_process(tmp_path, mock_argv, train):
    """EP = 2 × TP = 2 (+SP) with --expert-tensor-parallel-size 1 on four gloo ranks (DP = 2):
    attention split over TP, the routed experts whole, each TP rank routing its own
    sequence slice over the EP group (the TP ranks), the gated shared expert split as the
    dense MLP; the experts' gradients averaged over expert DP (the DP replicas). 20
    iterations in fp32 equal one process's: losses (1e-5), clipped grad norms (1e-4, the
    experts' squares summed over EP), validation and the logged aux and z-losses (1e-5);
    the distributed optimizer saved at 10 in torch_dist and resumed to 20 equals it too, and
    so does CP = 2 × EP = 2 (the EP group across the CP ranks).

    Expert TP between 1 and TP: TP = 4 (+SP) with --expert-tensor-parallel-size 2, each
    pair of TP ranks routing its half of the sequence and splitting the experts in two,
    at EP = 2 (grouped GEMM; expert DP 1) and at EP = 1 with the distributed optimizer
    (expert DP 2) saved at 3 in torch_dist and resumed to 6, there and at TP = 2 × EP = 2
    × DP = 2 (expert TP = TP); at EP = 2 saved and resumed in --ckpt-format torch too; and
    with biases (the experts' linear_fc2 bias replicated over the expert TP pair), the
    sequence aux loss with the expert bias, and the global aux loss (a pair's two copies of
    its chunk both counted over TP, which leaves every ratio alike); and ETP = 1 with CP:
    TP = 2 (+SP) × CP = 2 × EP = 2, the routers counting over the tensor × context ranks.
    Each equals one process over its iterations within the same tolerances (measured:
    losses 5e-8, grad norms 1.8e-7, logged losses 1.2e-7)."""
    import json
    from pathlib import Path

    from mg.core.testing.launch import launch_workers

    # 128 vocabulary rows at TP 1, 2 and 4 alike
    flags = [*MOE, "--moe-z-loss-coeff", "1e-3", "--make-vocab-size-divisible-by", "32"]
    flags += ["--attention-dropout", "0", "--hidden-dropout", "0", "--clip-grad", "0.05"]
    flags += ["--eval-interval", "10", "--eval-iters", "1", "--moe-shared-expert-gate"]
    flags += ["--moe-shared-expert-intermediate-size", "16"]
    argv = mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=20)
    one = train(argv)
    run = [*argv, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    sharded = [*run, "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
    ckpt = str(tmp_path / "ckpt")
    runs = [run, [*sharded, "--save", ckpt, "--exit-interval", "10"], [*sharded, "--load", ckpt]]
    runs.append([*argv, "--context-parallel-size", "2", "--expert-model-parallel-size", "2"])
    # expert TP 2 under TP 4, and expert TP 1 with CP, for a few iterations each
    tp4 = [*argv, "--tensor-model-parallel-size", "4", "--sequence-parallel"]
    tp4 += ["--expert-tensor-parallel-size", "2"]
    tp4_sharded = [*tp4, "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
    ckpt4 = str(tmp_path / "ckpt_etp2")
    runs.append([*tp4, "--expert-model-parallel-size", "2", "--moe-grouped-gemm"])
    runs[-1] += ["--exit-interval", "6"]
    runs.append([*tp4_sharded, "--save", ckpt4, "--exit-interval", "3"])
    runs.append([*tp4_sharded, "--load", ckpt4, "--exit-interval", "6"])
    other = [*argv, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    other += ["--expert-model-parallel-size", "2", *tp4_sharded[len(tp4) :]]
    runs.append([*other, "--load", ckpt4, "--exit-interval", "6"])  # expert TP = TP = 2
    tp4_torch = [*tp4, "--expert-model-parallel-size", "2", "--ckpt-format", "torch"]
    ckpt4_torch = str(tmp_path / "ckpt_etp2_torch")  # mp_rank_TT_EEE, each its slices
    runs.append([*tp4_torch, "--save", ckpt4_torch, "--exit-interval", "3"])
    runs.append([*tp4_torch, "--load", ckpt4_torch, "--exit-interval", "6"])
    cp_tp = [*argv, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    cp_tp += ["--context-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    runs.append([*cp_tp, "--expert-model-parallel-size", "2", "--exit-interval", "6"])
    biased = [f for f in argv if f != "--disable-bias-linear"] + ["--exit-interval", "4"]
    one_biased = train(biased)
    runs.append(
        [*biased, *tp4[len(argv) :], "--expert-model-parallel-size", "2", "--moe-grouped-gemm"]
    )
    # the balancing counts of an expert TP pair's two copies of its chunk (each counted)
    balancing = [
        ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-score-function"]
        + ["sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.3"],
        ["--moe-router-load-balancing-type", "global_aux_loss"],
    ]
    ones_balancing = [train([*argv, *b, "--exit-interval", "4"]) for b in balancing]
    for b in balancing:
        runs.append([*tp4, "--expert-model-parallel-size", "2", *b, "--exit-interval", "4"])
    out = tmp_path / "etp1.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    launch_workers(str(worker), 4, [str(out), json.dumps(runs)], timeout=2300)
    results = json.loads(out.read_text())
    plain, first, resumed, cp_ep = results[:4]
    etp2, etp2_first, etp2_resumed, resharded, torch_first, torch_resumed = results[4:10]
    cp_etp1, etp2_bias, seq_aux_bias, global_aux = results[10:]
    for four, ref, start, end in (
        (etp2, one, 0, 6),
        (etp2_first, one, 0, 3),
        (etp2_resumed, one, 3, 6),
        (resharded, one, 3, 6),
        (torch_first, one, 0, 3),
        (torch_resumed, one, 3, 6),
        (cp_etp1, one, 0, 6),
        (etp2_bias, one_biased, 0, 4),
        (seq_aux_bias, ones_balancing[0], 0, 4),
        (global_aux, ones_balancing[1], 0, 4),
    ):
        assert len(four["losses"]) == end - start
        assert four["losses"] == pytest.approx(ref.losses[start:end], rel=1e-5)
        assert four["grad_norms"] == pytest.approx(ref.grad_norms[start:end], rel=1e-4)
        for name, values in ref.extra_losses.items():
            assert four["extra_losses"][name] == pytest.approx(values[start:end], rel=1e-5)
    assert max(one_biased.grad_norms) > 0.05  # clipped
    for four in (plain, cp_ep):
        assert four["losses"] == pytest.approx(one.losses, rel=1e-5)
        assert four["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4)
        for (i, a), (j, b) in zip(one.validation, four["validation"], strict=True):
            assert i == j and b == pytest.approx(a, rel=1e-5)
        for name, values in one.extra_losses.items():
            assert four["extra_losses"][name] == pytest.approx(values, rel=1e-5)
    assert max(one.grad_norms) > 0.05  # clipped
    assert first["losses"] + resumed["losses"] == pytest.approx(one.losses, rel=1e-5)
    assert first["grad_norms"] + resumed["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4)


def test_moe_layer_recompute_and_per_layer_logging(tmp_path, mock_argv, train):
    """--moe-layer-recompute trains as without it (the global aux loss's counts, which
    change every micro-batch, replayed for the recomputation; fp32, losses 1e-6, grad
    norms 1e-5), so does `--recompute-granularity selective --recompute-modules moe
    core_attn`, and --moe-per-layer-logging writes each MoE layer's balancing losses to
    tensorboard under Megatron's names, their mean the logged value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = [*MOE, "--moe-z-loss-coeff", "1e-3", "--moe-router-load-balancing-type"]
    flags += ["global_aux_loss", "--attention-dropout", "0", "--hidden-dropout", "0"]
    plain = train(mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=3))
    tb = tmp_path / "tb"
    flags += ["--moe-layer-recompute", "--moe-per-layer-logging", "--tensorboard-dir", str(tb)]
    recomputed = train(mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=3))
    assert recomputed.losses == pytest.approx(plain.losses, rel=1e-6)
    assert recomputed.grad_norms == pytest.approx(plain.grad_norms, rel=1e-5)
    # Megatron's newer spelling of the same, with the attention core's recompute too
    modules = ["--recompute-granularity", "selective", "--recompute-modules", "moe", "core_attn"]
    base = flags[: flags.index("--moe-layer-recompute")]
    spelled = train(mock_argv(tmp_path, *base, *modules, mbs=2, gbs=8, iters=3))
    assert spelled.losses == pytest.approx(plain.losses, rel=1e-6)
    assert spelled.grad_norms == pytest.approx(plain.grad_norms, rel=1e-5)
    for name, values in plain.extra_losses.items():
        assert recomputed.extra_losses[name] == pytest.approx(values, rel=1e-6)
    events = EventAccumulator(str(tb))
    events.Reload()
    for name in ("global_load_balancing_loss", "z_loss"):
        layers = [[e.value for e in events.Scalars(f"moe/{name}_layer_{i}")] for i in (0, 1)]
        means = [(a + b) / 2 for a, b in zip(*layers, strict=True)]
        assert means == pytest.approx(recomputed.extra_losses[name], rel=1e-5)
        assert layers[0] != layers[1]


@pytest.mark.slow  # six one-process references and one two-rank launch of six runs
@pytest.mark.timeout(1200)
def test_moe_context_parallel_and_interleaved_pipeline_match_one_process(
    tmp_path, mock_argv, train
):
    """On two gloo ranks, each against one process (fp32, 6 iterations): CP = 2 with the
    aux loss and with the sequence aux loss (counts summed over the CP ranks, the losses'
    gradient times cp as the main loss's); the interleaved pipeline (PP = 2, one layer per
    virtual stage) plain, and with the global aux loss and --moe-layer-recompute (each
    micro-batch's recomputation replaying its counts); TP = 2 + SP with expert TP 1 at
    EP = 1 (every expert on both TP ranks, their gradients summed over them), with a
    shared expert, and with the expert bias (counts summed over the stage's ranks) and the
    distributed optimizer. Losses and logged balancing losses within 1e-5, clipped grad
    norms within 1e-4."""
    import json
    from pathlib import Path

    from mg.core.testing.launch import launch_workers

    flags = [*MOE, "--moe-z-loss-coeff", "1e-3", "--attention-dropout", "0", "--hidden-dropout"]
    flags += ["0", "--clip-grad", "0.05"]
    vpp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    tp_flags = ["--make-vocab-size-divisible-by", "64"]
    shared = ["--moe-shared-expert-intermediate-size", "16"]
    bias = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    bias += ["--moe-router-bias-update-rate", "0.3"]  # large: a wrong count changes routing
    cases = [
        ([], ["--context-parallel-size", "2"]),
        (["--moe-router-load-balancing-type", "seq_aux_loss"], ["--context-parallel-size", "2"]),
        (["--num-layers", "4"], vpp),
        (
            ["--num-layers", "4", "--moe-router-load-balancing-type", "global_aux_loss"],
            [*vpp, "--moe-layer-recompute"],
        ),
        ([*tp_flags, *shared], [*tp, "--expert-tensor-parallel-size", "1"]),
        (
            [*tp_flags, *bias, "--moe-grouped-gemm"],
            [*tp, "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer"],
        ),
    ]
    argvs = [mock_argv(tmp_path, *flags, *extra, mbs=2, gbs=8, iters=6) for extra, _ in cases]
    ones = [train(argv) for argv in argvs]
    runs = [[*argv, *par] for argv, (_, par) in zip(argvs, cases, strict=True)]
    out = tmp_path / "cp_vpp.json"
    worker = Path(__file__).with_name("ddp_worker.py")
    launch_workers(str(worker), 2, [str(out), json.dumps(runs)], timeout=1100)
    for one, two in zip(ones, json.loads(out.read_text()), strict=True):
        assert two["losses"] == pytest.approx(one.losses, rel=1e-5)
        assert two["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4)
        assert one.extra_losses.keys() == two["extra_losses"].keys()
        for name, values in one.extra_losses.items():
            assert two["extra_losses"][name] == pytest.approx(values, rel=1e-5)
    assert max(ones[0].grad_norms) > 0.05  # clipped


@pytest.mark.parametrize(
    ("recompute", "attention", "moe"),
    [
        (["--recompute-granularity", "selective", "--recompute-modules", "moe"], False, True),
        (["--recompute-granularity", "selective", "--recompute-modules", "core_attn"], True, False),
        (["--recompute-granularity", "selective"], True, False),  # Megatron's default
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"],
            True,
            True,
        ),
        (["--recompute-modules", "moe"], False, False),  # read under selective only
        (["--moe-layer-recompute"], False, True),
    ],
)
def test_recompute_modules_map_onto_selective_and_moe_layer_recompute(
    tmp_path, mock_argv, recompute, attention, moe
):
    """Megatron's `--recompute-modules` names: core_attn is the selective recompute of the
    attention core, moe each MoE layer's (--moe-layer-recompute); checked on the built
    model's checkpointed modules."""
    from mg.core.models.moe import MoELayer
    from mg.trainer.training import Trainer

    trainer = Trainer(parse_args(mock_argv(tmp_path, *MOE, *recompute)))
    modules = list(trainer.model.modules())
    cores = [m.core_attention for m in modules if hasattr(m, "core_attention")]
    layers = [m for m in modules if isinstance(m, MoELayer)]
    assert cores and layers
    assert all(getattr(m, "_mg_recompute", False) == attention for m in cores)
    assert all(getattr(m, "_mg_moe_recompute", False) == moe for m in layers)


def test_every_megatron_recompute_module_is_built(tmp_path, mock_argv):
    """Megatron's other `--recompute-modules` names reach the built model: mlp and
    shared_experts checkpoint those modules, layernorm and moe_act switch on their
    output-discarding recompute (mla_up_proj: test_mla_dry_run / core's tests)."""
    from mg.core.models.moe import MoELayer
    from mg.trainer.training import Trainer

    argv = mock_argv(tmp_path, *MOE, "--moe-grouped-gemm", "--moe-layer-freq", "[0,1]")
    argv += ["--moe-shared-expert-intermediate-size", "16"]
    argv += ["--recompute-granularity", "selective", "--recompute-modules"]
    argv += ["moe_act", "layernorm", "mlp", "shared_experts"]
    trainer = Trainer(parse_args(argv))
    modules = list(trainer.model.modules())
    moes = [m for m in modules if isinstance(m, MoELayer)]
    layers = [m for m in modules if hasattr(m, "recompute_input_layernorm")]
    assert moes and all(m.experts.recompute_activation for m in moes)
    assert all(getattr(m.shared_experts, "_mg_module_recompute", False) for m in moes)
    assert layers and all(m.recompute_input_layernorm for m in layers)
    dense = [m.mlp for m in layers if not isinstance(m.mlp, MoELayer)]
    assert dense and all(getattr(m, "_mg_module_recompute", False) for m in dense)
    cores = [m.core_attention for m in modules if hasattr(m, "core_attention")]
    assert not any(getattr(m, "_mg_recompute", False) for m in cores)  # core_attn not named


MLA = [
    "--multi-latent-attention",
    "--position-embedding-type",
    "rope",
    "--q-lora-rank",
    "16",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "8",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "8",
    "--qk-layernorm",
    "--normalization",
    "RMSNorm",
]


def test_every_recompute_module_trains_to_the_same_losses(tmp_path, mock_argv, train):
    """DeepSeek-V3's recipe in small (MLA, a dense layer then an MoE layer with grouped-GEMM
    and shared experts) with every module of Megatron's recompute_modules except core_attn
    and moe: the losses of three steps are those without recompute."""
    flags = [*MOE, *MLA, "--moe-grouped-gemm", "--moe-layer-freq", "[0,1]"]
    flags += ["--moe-shared-expert-intermediate-size", "16"]
    plain = train(mock_argv(tmp_path, *flags, iters=3))
    recompute = ["--recompute-granularity", "selective", "--recompute-modules"]
    recompute += ["mlp", "mla_up_proj", "layernorm", "moe_act", "shared_experts"]
    recomputed = train(mock_argv(tmp_path, *flags, *recompute, iters=3))
    for a, b in zip(plain.losses, recomputed.losses, strict=True):
        assert b == pytest.approx(a, rel=1e-6)


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["attention"], "not a module Megatron recomputes"),
        (["moe_act"], "only with --moe-grouped-gemm"),
        (["mla_up_proj"], "only with --multi-latent-attention"),
    ],
)
def test_recompute_modules_refused_by_name(tmp_path, mock_argv, names, message):
    argv = mock_argv(tmp_path, *MOE, "--recompute-granularity", "selective")
    with pytest.raises(ArgumentError, match=message) as info:
        parse_args([*argv, "--recompute-modules", "core_attn", *names])
    assert str(info.value).startswith(f"--recompute-modules {names[0]}")
    assert "\n" not in str(info.value)


def test_per_layer_logging_writes_every_layer_zero_for_dense_ones():
    """--moe-per-layer-logging writes each layer's balancing losses as Megatron's tracker
    holds them: a value per layer of the model, 0 for the dense ones."""
    import dataclasses

    import torch

    from mg.core.models import GPTModel, presets
    from mg.trainer.moe_step import finish_step

    config = presets.tiny_llama(num_layers=3, num_moe_experts=4, moe_router_topk=2)
    config = dataclasses.replace(config, moe_layer_freq=[0, 1, 1], moe_aux_loss_coeff=1e-2)
    model = GPTModel(config)
    model(torch.randint(0, config.vocab_size, (2, 8)))
    losses, layers = finish_step(model, config, None, per_layer=True)
    name = "load_balancing_loss"
    assert sorted(layers) == [f"moe/{name}_layer_{i}" for i in range(3)]
    assert layers[f"moe/{name}_layer_0"] == 0.0
    moe = [layers[f"moe/{name}_layer_{i}"] for i in (1, 2)]
    assert all(v > 0.5 for v in moe)
    assert sum(moe) / 2 == pytest.approx(losses[name], rel=1e-12)


def test_the_recompute_module_names_are_core_s() -> None:
    """arguments/model.py names the modules without importing the models (fast --help)."""
    from mg.core.models.recompute import RECOMPUTE_MODULES as BUILT
    from mg.trainer.arguments.model import RECOMPUTE_MODULES as ACCEPTED

    assert tuple(ACCEPTED) == BUILT
