"""Tensor parallelism composes with recompute, through mg-train's one construction path.

One 2-rank gloo launch (te_parallel_worker.py: the stand-in Transformer Engine of
mg.core.testing.te_standin installed) trains a tiny GPT at TP=2 for 6 iterations
in three groups, each without recompute, with selective recompute (the attention
core) and with full recompute (every layer):

- the local spec with sequence parallelism and dropout 0.1, whose tensor-parallel
  regions draw from the per-rank stream (recompute replays it);
- the TE spec (TE's attention and linears, told the tensor-parallel group);
- an MoE model, recomputing its MoE layers too with selective recompute
  (--moe-layer-recompute; full recompute covers them already).

Recompute replays the same arithmetic and the same random numbers, so within a
group the losses are equal bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("te_parallel_worker.py")
RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-activations"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    + ["--recompute-num-layers", "1"],
}


def _argv(work: Path, *extra: str) -> list[str]:
    return [
        *("gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--max-position-embeddings", "32", "--seed", "1234"),
        *("--mock-data", "--vocab-size", "127", "--data-cache-path", str(work / "cache")),
        *("--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6"),
        *("--lr", "1e-3", "--log-interval", "1000", "--eval-iters", "0"),
        *("--distributed-backend", "gloo", "--tensor-model-parallel-size", "2"),
        *("--make-vocab-size-divisible-by", "64"),
        *extra,
    ]


def test_tensor_parallel_runs_recompute_without_changing_a_bit(tmp_path: Path) -> None:
    groups = {
        "local, SP, dropout": ["--sequence-parallel"],
        "TE spec": ["--transformer-impl", "transformer_engine"]
        + ["--attention-dropout", "0", "--hidden-dropout", "0"],
        "MoE": ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"],
    }
    argvs, names = [], []
    for group, flags in groups.items():
        for name, recompute in RECOMPUTE.items():
            more = ["--moe-layer-recompute"] if group == "MoE" and name == "selective" else []
            argvs.append(_argv(tmp_path, *flags, *recompute, *more))
            names.append((group, name))
    out = tmp_path / "losses.json"
    launch_workers(str(WORKER), 2, [str(out), json.dumps(argvs)], timeout=900)
    losses = dict(zip(names, json.loads(out.read_text()), strict=True))
    for group in groups:
        plain = losses[group, "none"]
        assert len(plain) == 6
        for name in ("selective", "full"):
            assert losses[group, name] == plain, (group, name)
