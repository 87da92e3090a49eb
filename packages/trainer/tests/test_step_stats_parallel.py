"""--log-params-norm and --log-num-zeros-in-grad on 2 gloo ranks equal one process.

One 2-rank launch trains a tiny GPT (untied embeddings: the padded vocabulary row of
the input embedding never gets a gradient, so there are zeros to count) at TP=2;
at DP=2 with the distributed optimizer (its gradient reduction and parameter gather
overlapped); at PP=2 (tied embeddings: the last stage's copy counted once); with
Megatron-FSDP (ZeRO-3); and a tiny MoE at EP=2 with the distributed optimizer.
Every rank logs the same figures, equal to the one-process run's: the params norm
(each parameter counted once: TP-replicated norms once, shards summed) and the
zeros; where every rank can gather the whole tensors (TP, DP, FSDP) the params norm
also equals their norm, and at TP=2 the zeros a count over the whole gradients.
The grad norms (the same reduction) equal the one-process ones too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("step_stats_worker.py")
ITERS = 4
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"]
FLAGS = [
    "--log-params-norm",
    "--log-num-zeros-in-grad",
    "--untie-embeddings-and-output-weights",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]


def _run_ranks(argvs: list[list[str]], world_size: int, out: Path) -> list[dict]:
    # five runs in one launch: minutes on a loaded 2-CPU box
    launch_workers(str(WORKER), world_size, [str(out), json.dumps(argvs)], timeout=900)
    return json.loads(out.read_text())


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> None:
    assert len(a) == len(b) == ITERS
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= rtol * abs(y), (a, b)


@pytest.mark.slow
def test_parallel_layouts_match_one_process(tmp_path, mock_argv, train) -> None:
    base = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=ITERS)
    one_vocab = [*base, "--make-vocab-size-divisible-by", "128"]
    tp2 = [*base, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
    dist_opt = ["--use-distributed-optimizer"]
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    tied = [a for a in one_vocab if a != "--untie-embeddings-and-output-weights"]
    fsdp = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
    fsdp += ["--data-parallel-sharding-strategy", "optim_grads_params"]
    argvs = {
        "tp2": tp2,
        "dp2_dist_opt": [*one_vocab, *dist_opt, *overlap],
        "pp2": [*tied, "--pipeline-model-parallel-size", "2"],
        "fsdp": [*one_vocab, *fsdp],
        "ep2_dist_opt": [*one_vocab, *MOE, "--expert-model-parallel-size", "2", *dist_opt],
    }
    two = dict(zip(argvs, _run_ranks(list(argvs.values()), 2, tmp_path / "two.json"), strict=True))
    baselines = {"dense": one_vocab, "tied": tied, "moe": [*one_vocab, *MOE]}
    ones = {name: _one_process(train, argv) for name, argv in baselines.items()}
    assert min(ones["dense"]["num_zeros"]) >= 32  # the padded row of the 32-wide embedding
    for name, run in two.items():
        one = ones["tied" if name == "pp2" else "moe" if name.startswith("ep2") else "dense"]
        for ranks in run["per_rank"]:  # every rank logs the same figures
            assert all(r == ranks[0] for r in ranks), (name, ranks)
        _close(run["params_norms"], one["params_norms"])
        if name == "pp2":
            # the tied embedding's gradient is the sum of its two uses, added across the
            # stages in another order than one process adds them: an element that cancels
            # to exactly 0.0 in one order (a chance zero) is ~1e-12 in the other
            diffs = [abs(a - b) for a, b in zip(run["num_zeros"], one["num_zeros"], strict=True)]
            assert max(diffs) <= 1, (name, run["num_zeros"], one["num_zeros"])
        else:
            assert run["num_zeros"] == one["num_zeros"], name
        _close(run["grad_norms"], one["grad_norms"])
        if name in ("tp2", "dp2_dist_opt", "fsdp"):  # whole tensors on every rank
            _close(run["params_norms"], run["reference_norms"], 1e-12)
    assert two["tp2"]["num_zeros"] == two["tp2"]["reference_zeros"]


def _one_process(train, argv: list[str]) -> dict[str, list]:
    run: dict[str, list] = {"params_norms": [], "num_zeros": []}

    def record(trainer) -> None:
        run["params_norms"].append(trainer.stats.params_norm)
        run["num_zeros"].append(trainer.stats.num_zeros)

    run["grad_norms"] = train(argv, on_iteration=record).grad_norms
    return run
