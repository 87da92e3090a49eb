"""`mg-train gpt --mtp-num-layers`: the flags, the loss plumbing, the log line, and
pipeline (MTP on the last stage) and tensor parallelism equal to one process.

The MTP losses and gradients themselves are checked against megatron-core's block in
packages/core/tests/test_mtp.py; here the family's loss terms are checked against
Megatron's objective in both of its normalisations, and whole runs on mock data.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.mtp import roll_left
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.family_gpt import gpt_config, gpt_loss_terms

sys.path.insert(0, str(Path(__file__).parent))
from conftest import _mock_argv, _train  # noqa: E402

ROPE = ["--position-embedding-type", "rope", "--attention-dropout", "0", "--hidden-dropout", "0"]


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_mtp_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_reach_the_config(tmp_path):
    args = parse_args(_mock_argv(tmp_path, *ROPE, "--mtp-num-layers", "2"))
    config = gpt_config(args, 128)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (2, 0.1)
    args = parse_args(
        _mock_argv(tmp_path, *ROPE, "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3")
    )
    assert gpt_config(args, 128).mtp_loss_scaling_factor == 0.3
    assert gpt_config(parse_args(_mock_argv(tmp_path, *ROPE)), 128).mtp_num_layers is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mtp-loss-scaling-factor", "0.2"], "--mtp-loss-scaling-factor needs --mtp-num-layers"),
        (["--mtp-num-layers", "0"], "--mtp-num-layers must be a positive integer"),
        (
            ["--mtp-num-layers", "1", "--position-embedding-type", "learned_absolute"],
            "Megatron's MTP takes rope or none",
        ),
    ],
)
def test_refused_by_name(tmp_path, flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(_mock_argv(tmp_path, *flags))


def test_refused_with_context_parallel(tmp_path):
    cp = [*ROPE, "--mtp-num-layers", "1", "--context-parallel-size", "2"]
    with pytest.raises(ArgumentError, match="--context-parallel-size 2: the MTP roll"):
        parse_args(_mock_argv(tmp_path, *cp), world_size=2)


def _batch(config: TransformerConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, config.vocab_size, (2, 10), generator=gen)
    mask = torch.ones(2, 10)
    mask[0, 6:] = 0
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": mask,
        "position_ids": torch.arange(10).expand(2, 10),
    }


def _grads(model: GPTModel, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_loss_terms_give_megatrons_gradient_both_ways():
    """The loss sum's value is the main loss's; its gradient, after the trainer's division
    by the tokens (default) or its per-token factor (--calculate-per-token-loss), is the one
    of Megatron's objective: core_v0.19.0's `process_mtp_loss` in both modes."""
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=10,
        position_embedding_type="rope", attention_dropout=0.0, hidden_dropout=0.0,
        mtp_num_layers=2, mtp_loss_scaling_factor=0.4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config)
    batch = _batch(config)
    loss_sum, tokens, extra = gpt_loss_terms(model, batch)
    assert sorted(extra) == ["mtp_1 loss", "mtp_2 loss"]

    mask = batch["loss_mask"]
    w = 0.4 / 2

    def megatron(per_token: bool) -> torch.Tensor:
        """core_v0.19.0's objective: per micro-batch mean + w Σ_k mean_k by default;
        with per-token loss sum + w Σ_k sum_k × tokens / tokens_k, over the global tokens."""
        main, mtp = model(batch["tokens"], labels=batch["labels"], return_mtp=True)
        main_sum = (main * mask).sum()
        torch.testing.assert_close(loss_sum, main_sum)  # the value is the main loss's alone
        sums, counts, mask_k = [], [], mask
        for depth in mtp.per_token:
            mask_k = roll_left(mask_k)
            sums.append((depth * mask_k).sum())
            counts.append(mask_k.sum())
        for k, (s, n) in enumerate(zip(sums, counts, strict=True)):
            assert extra[f"mtp_{k + 1} loss"].item() == pytest.approx((s / n).item(), rel=1e-6)
        pairs = list(zip(sums, counts, strict=True))
        if per_token:
            return (main_sum + w * sum(s * tokens / n for s, n in pairs)) / 7.0
        return main_sum / tokens + w * sum(s / n for s, n in pairs)

    for per_token in (False, True):
        expected = _grads(model, megatron(per_token))
        ours = gpt_loss_terms(model, batch)[0]
        got = _grads(model, ours / 7.0 if per_token else ours / tokens)
        for name, grad in got.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-8)
        assert got["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_training_logs_each_depth(tmp_path, capsys):
    """Megatron's log line: `lm loss: … | mtp_1 loss: … | mtp_2 loss: … |`; a zero factor
    leaves the main model's training exactly as without MTP (tied embeddings: same init)."""
    flags = [*ROPE, "--log-interval", "2"]
    run = _train(_mock_argv(tmp_path, *flags, "--mtp-num-layers", "2", iters=4))
    line = [x for x in capsys.readouterr().out.splitlines() if "iteration        4/" in x][0]
    assert " | lm loss: " in line and " | mtp_1 loss: " in line and " | mtp_2 loss: " in line
    assert line.index("lm loss") < line.index("mtp_1 loss") < line.index("mtp_2 loss")
    assert len(run.extra_losses["mtp_1 loss"]) == 4
    logged = float(line.split("mtp_2 loss: ")[1].split(" ")[0])  # the interval's mean
    assert logged == pytest.approx(sum(run.extra_losses["mtp_2 loss"][2:]) / 2, rel=1e-5)

    plain = _train(_mock_argv(tmp_path, *flags, iters=4))
    off = _train(
        _mock_argv(
            tmp_path, *flags, "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0", iters=4
        )
    )
    assert off.losses == plain.losses
    assert run.losses[1:] != plain.losses[1:]  # the MTP gradient reaches the decoder


ITERS = 10


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """PP=2 (MTP on the last stage; tied and untied embeddings), TP=2 (with and without
    sequence parallelism), EP=2 (MoE MTP layers) and Megatron FSDP (DP=2), each on 2 gloo
    ranks, and the same flags in one process: fp32, 10 iterations."""
    tmp = tmp_path_factory.mktemp("mtp_parallel")
    run_ranks = _sibling("test_ddp.py").run_ranks
    common = [*ROPE, "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
    common += ["--make-vocab-size-divisible-by", "64", "--clip-grad", "0"]
    untied = [*common, "--untie-embeddings-and-output-weights", "--swiglu"]
    untied += ["--normalization", "RMSNorm", "--disable-bias-linear"]
    # DeepSeek-V3's shape in small: the last layer, and so the MTP layers, MoE
    moe = [*untied, "--num-experts", "4", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size"]
    moe += ["32", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
    layouts = {
        "pp2": (common, ["--pipeline-model-parallel-size", "2"]),
        "pp2_untied": (untied, ["--pipeline-model-parallel-size", "2"]),
        "tp2": (untied, ["--tensor-model-parallel-size", "2"]),
        "tp2_sp": (untied, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "ep2": (moe, ["--expert-model-parallel-size", "2"]),
        "fsdp2": (  # sbatch_mfsdp_deepseek_v3.sh's data parallelism, the MTP block sharded too
            untied,
            ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
            + ["--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"],
        ),
    }
    argvs = [_mock_argv(tmp, *flags, *layout, iters=ITERS) for flags, layout in layouts.values()]
    two = run_ranks(argvs, 2, tmp / "two.json")
    one = {"tied": _train(_mock_argv(tmp, *common, iters=ITERS))}
    one["untied"] = _train(_mock_argv(tmp, *untied, iters=ITERS))
    one["moe"] = _train(_mock_argv(tmp, *moe, iters=ITERS))
    return dict(zip(layouts, two, strict=True)), one


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "model"),
    [
        ("pp2", "tied"),
        ("pp2_untied", "untied"),
        ("tp2", "untied"),
        ("tp2_sp", "untied"),
        ("ep2", "moe"),
        ("fsdp2", "untied"),
    ],
)
def test_parallel_equals_one_process(parallel_runs, layout, model):
    two, one = parallel_runs[0][layout], parallel_runs[1][model]
    assert len(one.losses) == ITERS
    assert two["losses"] == pytest.approx(one.losses, rel=1e-5)
    assert two["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4)
    for name in ("mtp_1 loss", "mtp_2 loss"):
        assert two["extra_losses"][name] == pytest.approx(one.extra_losses[name], rel=1e-5)
    last_two, last_one = two["extra_losses"]["mtp_2 loss"][-1], one.extra_losses["mtp_2 loss"][-1]
    print(f"{layout}: lm {two['losses'][-1]:.6f} vs {one.losses[-1]:.6f}, mtp_2 {last_two:.6f} vs")
    print(f"  {last_one:.6f}; worst relative lm difference {_worst(two['losses'], one.losses):.2g}")


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_dry_run_counts_mtp(tmp_path):
    """The plan's parameters equal the meta-device model's with the MTP block in it, the
    MTP share is named, and the FLOPs grow by the block's (flops.py's, tested in core)."""
    from mg.trainer.dry_run import report

    flags = [*ROPE, "--untie-embeddings-and-output-weights", "--swiglu", "--dry-run"]
    flags += ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]

    def plan(*extra: str) -> str:
        return report(parse_args(_mock_argv(tmp_path, *flags, *extra), world_size=8))

    with_mtp, without = plan("--mtp-num-layers", "2"), plan()
    assert "multi-token prediction: 2 depth(s) on the last stage" in with_mtp
    params = [x for x in with_mtp.splitlines() if x.startswith("number of parameters:")][0]
    assert params.split(": ")[1].split(" B")[0] == params.split("model: ")[1].split(" B")[0]

    def flops(text: str) -> float:
        return float(text.split("FLOPs per iteration: ")[1].split(" ")[0])

    assert flops(with_mtp) > flops(without)
