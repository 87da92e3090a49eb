"""`mg-train mamba`: a hybrid trains, resumes bitwise, matches one process with DP=2 and the
distributed optimizer, with TP=2 (and sequence parallelism) and with PP=2, refuses what
it cannot do by flag name, and plans Megatron's examples/mamba/train.sh with --dry-run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mg.core.testing.launch import launch_workers
from mg.trainer.cli import main

DDP_WORKER = str(Path(__file__).with_name("ddp_worker.py"))

MAMBA = [
    "mamba",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--mamba-head-dim",
    "16",
    "--mamba-num-groups",
    "2",
    "--mamba-state-dim",
    "8",
    "--mamba-chunk-size",
    "8",
    "--hybrid-override-pattern",
    "M*M-",
    "--position-embedding-type",
    "none",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--seq-length",
    "20",
    "--max-position-embeddings",
    "20",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1000",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--seed",
    "1234",
    "--mock-data",
    "--vocab-size",
    "127",
]


def _argv(tmp_path, *extra, mbs=2, gbs=8, iters=10) -> list[str]:
    return [
        *MAMBA,
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--micro-batch-size",
        str(mbs),
        "--global-batch-size",
        str(gbs),
        "--train-iters",
        str(iters),
        *extra,
    ]


def test_hybrid_trains_and_resumes_bitwise(tmp_path, train) -> None:
    flags = ("--eval-interval", "4", "--eval-iters", "1")
    straight = train(_argv(tmp_path, *flags, iters=8))
    assert all(np.isfinite(straight.losses)) and straight.losses[-1] < straight.losses[0]
    ckpt = str(tmp_path / "ckpt")
    first = train(_argv(tmp_path, *flags, "--save", ckpt, "--exit-interval", "4", iters=8))
    second = train(_argv(tmp_path, *flags, "--load", ckpt, iters=8))
    assert first.losses + second.losses == straight.losses  # bitwise
    assert first.validation + second.validation == straight.validation

    # the checkpoint describes itself: eval and serve rebuild the hybrid with no flags
    from mg.core.checkpoint import load_model
    from mg.core.models.mamba import MambaModel

    model, config, _, _ = load_model(ckpt)
    assert isinstance(model, MambaModel) and config.layer_pattern == "M*M-"
    assert model(torch.randint(0, 127, (1, 9))).shape == (1, 9, 128)


def test_full_recompute_equals_none(tmp_path, train) -> None:
    """--recompute-granularity full over the hybrid's stack (its final norm is
    `final_norm`, not TransformerBlock's `final_layernorm`): the same losses, bitwise."""
    argv = _argv(tmp_path, "--eval-iters", "0", iters=3)
    plain = train(argv)
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    assert train([*argv, *full, "--recompute-num-layers", "2"]).losses == plain.losses


@pytest.mark.slow
def test_data_parallel_distributed_optimizer_matches_one_process(tmp_path, train) -> None:
    """20 iterations, fp32: DP=2 with the distributed optimizer vs one process accumulating
    the same global batch; losses within 1e-5 relative, grad norms within 1e-4."""
    argv = _argv(tmp_path, "--eval-iters", "0", iters=20)
    one = train(argv)
    out = tmp_path / "two.json"
    launch_workers(DDP_WORKER, 2, [str(out), json.dumps([[*argv, "--use-distributed-optimizer"]])])
    (two,) = json.loads(out.read_text())
    for a, b in zip(one.losses, two["losses"], strict=True):
        assert abs(a - b) / abs(a) <= 1e-5, (one.losses, two["losses"])
    for a, b in zip(one.grad_norms, two["grad_norms"], strict=True):
        assert abs(a - b) / abs(a) <= 1e-4


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["gpt", "--hybrid-override-pattern", "M*"],
            "--hybrid-override-pattern is a Mamba / hybrid flag: use `mg-train mamba`",
        ),
        (["--hybrid-override-pattern", "M*E-"], "MoE layers ('E') are not supported yet"),
        (["--hybrid-override-pattern", "M*M"], "has 3 layers, --num-layers is 4"),
        (["--spec", "local"], "--spec local: mg-train mamba builds"),
        (["--mamba-num-groups", "3"], "do not divide into 3 groups"),
        (["--mamba-ssm-kernels"], "--mamba-ssm-kernels: the mamba_ssm package is not installed"),
    ],
)
def test_flag_errors_exit_2_with_one_line(tmp_path, capsys, argv, message) -> None:
    base = _argv(tmp_path)
    if argv[0] == "gpt":  # a plain GPT run given a Mamba flag
        base = "gpt --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 20 "
        base = (base + "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data").split()
        argv = argv[1:]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def _train_sh(scale: str, data_prefix: str, tokenizer_model: str) -> list[str]:
    """The options of Megatron-LM's examples/mamba/train.sh, verbatim, at its two scales."""
    tp, layers, hidden, heads, gbs = {
        "800M": ("1", "48", "1024", "16", "32"),
        "8B": ("4", "56", "4096", "32", "8"),
    }[scale]
    return (
        f"--tensor-model-parallel-size {tp} --sequence-parallel "
        "--pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-param-gather "
        "--overlap-grad-reduce --untie-embeddings-and-output-weights --init-method-std 0.02 "
        f"--position-embedding-type none --num-layers {layers} --hidden-size {hidden} "
        f"--num-attention-heads {heads} --group-query-attention --num-query-groups 8 "
        "--hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5 --seq-length 4096 "
        "--max-position-embeddings 4096 --train-samples 73242188 --lr-warmup-samples 50000 "
        "--lr-decay-samples 73192188 --save ./checkpoints --load ./checkpoints "
        f"--data-path {data_prefix} --data-cache-path ./data-cache --split 99,1,0 "
        f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {tokenizer_model} "
        "--distributed-backend nccl --micro-batch-size 4 "
        f"--global-batch-size {gbs} --lr 2.5e-4 --min-lr 2.5e-5 --lr-decay-style cosine "
        "--weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 "
        "--disable-bias-linear --normalization RMSNorm --adam-beta1 0.9 --adam-beta2 0.95 "
        "--log-interval 10 --save-interval 2000 --eval-interval 2000 --eval-iters 32 --bf16 "
        "--use-mcore-models --spec megatron.core.models.mamba.mamba_layer_specs "
        "mamba_stack_spec --no-create-attention-mask-in-dataloader "
        "--tensorboard-dir ./tensorboard"
    ).split()


def _hybrid_parameters(layers: int, h: int, heads: int, vocab: int) -> int:
    """Parameters of train.sh's model by hand: 8 query groups, GeLU MLP of 4h, Mamba with
    d_inner 2h, head dim 64, 8 groups, state 128, conv width 4; RMSNorm; untied output."""
    from mg.core.models.mamba import allocate_layers

    pattern = allocate_layers(layers, 0.08, 0.5)
    d_inner, mamba_heads, bc = 2 * h, 2 * h // 64, 2 * 8 * 128
    mamba = h + h * (2 * d_inner + bc + mamba_heads) + 5 * (d_inner + bc)
    mamba += 3 * mamba_heads + d_inner + d_inner * h
    attention = h + h * (h + 2 * 8 * (h // heads)) + h * h
    mlp = h + 2 * h * 4 * h
    per_type = {"M": mamba, "*": attention, "-": mlp}
    return sum(per_type[t] for t in pattern) + h + 2 * vocab * h


@pytest.mark.parametrize("scale", ["800M", "8B"])
def test_megatron_train_sh_flags_accepted_by_dry_run(tmp_path, monkeypatch, capsys, scale) -> None:
    """Every option of Megatron's examples/mamba/train.sh, with the Mistral tokenizer
    (32,000 pieces; the published 8B used a 256k vocabulary, hence 6.8 B here, not 8 B).
    The 8B hybrid has 24 Mamba, 4 attention, 28 MLP layers (its technical report)."""
    from mg.core.fixtures import fixture_path

    prefix = tmp_path / "corpus_text_document"
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{ext}").write_bytes(b"")  # only checked to exist
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "8")
    tokenizer = str(fixture_path("mistral-spm", "tokenizer.model"))
    assert main(["mamba", "--dry-run", *_train_sh(scale, str(prefix), tokenizer)]) == 0
    out = capsys.readouterr().out
    from mg.core.models import pad_vocab_size

    layers, h, heads, tp = {"800M": (48, 1024, 16, 1), "8B": (56, 4096, 32, 4)}[scale]
    vocab = pad_vocab_size(32000, 128, tp)  # Megatron's padding to 128 x TP
    if scale == "8B":
        assert "56 layers (24 Mamba, 4 attention, 28 MLP)" in out
        assert "world 8 = TP 4 x PP 1 x DP 2" in out
    total = float(out.split("number of parameters: ")[1].split(" B")[0])
    assert total == pytest.approx(_hybrid_parameters(layers, h, heads, vocab) / 1e9, abs=1e-4)


# --- tensor and pipeline parallelism ------------------------------------------------------
#
# One 2-rank launch (ddp_worker.py, one process group) runs every parallel configuration
# on the same global batches as the single-process run: the "M*M-" hybrid above (Mamba,
# attention, Mamba, MLP), MBS 2, GBS 8, 20 iterations, fp32, dropout 0, AdamW with
# clipping. Tolerance, as the GPT equivalence tests (test_pp_cp_equivalence): the
# parallel runs sum the same products in another order (out_proj's partial sums over TP
# ranks, gradients over stages), ~1e-7 relative per step, which Adam amplifies a little
# over 20 steps: losses agree to 1e-5 relative, gradient norms to 1e-4. A resume in the
# same layout is bitwise; a TP=2 checkpoint resumed in one process (the same sums in
# another order again) is held to the same 1e-5 over two iterations (the first reads the
# weights, the second the Adam moments: a permuted row of either would show).

LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4
TP2 = ["--tensor-model-parallel-size", "2"]
SP = [*TP2, "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _close(reference: list[float], other: list[float], rtol: float, name: str) -> None:
    assert len(other) == len(reference), name
    for a, b in zip(reference, other, strict=True):
        assert abs(a - b) / abs(a) <= rtol, (name, reference, other)


def _two_ranks(tmp_path: Path, argv: list[str], configs: dict[str, list[str]]) -> dict:
    """Each configuration trained on 2 gloo ranks in one launch; rank 0's results by name."""
    out = tmp_path / "two.json"
    argvs = json.dumps([[*argv, *c] for c in configs.values()])
    launch_workers(DDP_WORKER, 2, [str(out), argvs], timeout=900)
    return dict(zip(configs, json.loads(out.read_text()), strict=True))


def _parallel_argv(tmp_path: Path) -> list[str]:
    # padded to a multiple of 64·tp: 127 ids give 128 rows at TP=1 and TP=2 alike
    return _argv(tmp_path, "--eval-iters", "0", "--make-vocab-size-divisible-by", "64", iters=20)


def test_two_ranks_tp2_sp_pp2_match_one_process_and_resume(tmp_path: Path, train) -> None:
    """TP=2 with sequence parallelism and PP=2 (1F1B, 4 micro-batches) against one process;
    TP=2+SP saved at iteration 10 resumes bitwise on 2 ranks, and in one process (TP=1:
    the checkpoint holds the whole tensors) its iterations 11-12 match within 1e-5."""
    argv = _parallel_argv(tmp_path)
    one = train(argv)
    ckpt = str(tmp_path / "tp2")
    runs = _two_ranks(
        tmp_path,
        argv,
        {
            "tp2 sp": SP,
            "pp2": PP2,
            "tp2 sp, first 10": [*SP, "--save", ckpt, "--exit-interval", "10"],
            "tp2 sp, resumed": [*SP, "--load", ckpt],
        },
    )
    for name in ("tp2 sp", "pp2"):
        _close(one.losses, runs[name]["losses"], LOSS_RTOL, name)
        _close(one.grad_norms, runs[name]["grad_norms"], NORM_RTOL, name)
    resumed = runs["tp2 sp, first 10"]["losses"] + runs["tp2 sp, resumed"]["losses"]
    assert resumed == runs["tp2 sp"]["losses"]  # bitwise
    # two steps: the weights (iteration 11) and the Adam moments (iteration 12) are right
    at_tp1 = train([*argv, "--load", ckpt, "--exit-interval", "12"])
    _close(one.losses[10:12], at_tp1.losses, LOSS_RTOL, "TP=2 checkpoint resumed at TP=1")


@pytest.mark.slow
def test_two_ranks_tp2_and_distributed_optimizer_match_one_process(tmp_path: Path, train) -> None:
    """TP=2 without sequence parallelism, PP=2 and TP=2+SP with the distributed optimizer
    against one process; the distributed optimizer's TP=2 checkpoint resumes on 2 ranks
    and in one process within 1e-5, and its `torch`-format twin merges into the same
    whole tensors, exactly."""
    argv = _parallel_argv(tmp_path)
    one = train(argv)
    ckpt, torch_ckpt = str(tmp_path / "tp2_dist_opt"), str(tmp_path / "tp2_torch")
    dist_opt = [*SP, "--use-distributed-optimizer"]
    runs = _two_ranks(
        tmp_path,
        argv,
        {
            "tp2": TP2,
            "pp2 distributed optimizer": [*PP2, "--use-distributed-optimizer"],
            "tp2 sp distributed optimizer, first 10": [
                *dist_opt,
                "--save",
                ckpt,
                "--exit-interval",
                "10",
            ],
            "tp2 sp distributed optimizer, resumed": [*dist_opt, "--load", ckpt],
            "the same, torch format, first 10": [
                *dist_opt,
                *("--ckpt-format", "torch", "--save", torch_ckpt, "--exit-interval", "10"),
            ],
        },
    )
    for name in ("tp2", "pp2 distributed optimizer"):
        _close(one.losses, runs[name]["losses"], LOSS_RTOL, name)
        _close(one.grad_norms, runs[name]["grad_norms"], NORM_RTOL, name)
    first, resumed = (runs[f"tp2 sp distributed optimizer, {k}"] for k in ("first 10", "resumed"))
    _close(one.losses, first["losses"] + resumed["losses"], LOSS_RTOL, "distributed optimizer")
    at_tp1 = train([*argv, "--load", ckpt, "--exit-interval", "12"])
    _close(one.losses[10:12], at_tp1.losses, LOSS_RTOL, "TP=2 checkpoint resumed at TP=1")

    # the same weights saved as Megatron's mp_rank_0r files (each rank's [z_r; x_r; ...]
    # rows) merge into the tensors the torch_dist checkpoint stores whole
    from mg.core.checkpoint import load_model

    whole = load_model(ckpt)[0].state_dict()
    merged = load_model(torch_ckpt)[0].state_dict()
    assert merged.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(merged[name], tensor), name


def test_dry_run_plans_tensor_and_pipeline_parallelism(tmp_path, capsys, monkeypatch) -> None:
    """TP=2 x PP=2 on 4 GPUs: each stage's slice of the pattern and its parameters per GPU,
    counted by hand (hidden 32, 4 Mamba heads of 16, 2 groups, state 8, ffn 128, vocab 128,
    untied): per TP rank a Mamba layer holds 7,852 / 2 sharded + 32 norm = 3,958, an
    attention layer 4,096 / 2 + 32 = 2,080, an MLP layer 8,192 / 2 + 32 = 4,128, the
    embedding and the output layer 4,096 / 2 each, the final norm 32."""
    from mg.trainer.cli import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    extra = [*TP2, *PP2, "--make-vocab-size-divisible-by", "64", "--dry-run"]
    assert main(_argv(tmp_path, *extra)) == 0
    out = capsys.readouterr().out
    assert "world 4 = TP 2 x PP 2 x DP 1" in out
    assert "2 of 4 Mamba heads, 1 of 2 groups" in out
    assert "stage 0: layers 0-1 'M*' + embedding, 8,086 parameters per GPU" in out
    assert "stage 1: layers 2-3 'M-' + final norm, output layer, 10,166 parameters per GPU" in out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--context-parallel-size", "2"], "--context-parallel-size > 1 is supported for gpt"),
        (["--mamba-num-groups", "1", *TP2], "--mamba-num-groups (1) is not divisible by --tensor"),
    ],
)
def test_parallel_flag_errors_exit_2_with_one_line(tmp_path, capsys, monkeypatch, extra, message):
    from mg.trainer.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(_argv(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
