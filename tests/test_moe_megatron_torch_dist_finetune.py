"""An MoE trained by mg-train -> `mg-convert export-megatron --ckpt-format torch_dist`
(Megatron-Core's keys: experts on an expert axis, layers keyed by number where
`--moe-layer-freq` varies) -> `mg-train --finetune` from it, at EP = 1 and EP = 2.

The export holds the trained weights, so fine-tuning from it gives the losses of
fine-tuning from the trainer's own checkpoint: bitwise in one process, within 1e-5 at
EP = 2 on two gloo ranks (each rank reading its experts from the expert axis).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mg.ckpt_convert.megatron_lm import export_megatron
from mg.core.testing.launch import launch_workers
from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer

WORKER = Path(__file__).parents[1] / "packages" / "trainer" / "tests" / "ddp_worker.py"


def _argv(tmp_path: Path, *extra: str, iters: int) -> list[str]:
    return [
        "gpt",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "2", "--log-interval", "1000", "--eval-iters", "0",
        "--seed", "1234", "--mock-data", "--vocab-size", "127",
        "--data-cache-path", str(tmp_path / "cache"),
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters),
        "--swiglu", "--disable-bias-linear", "--num-experts", "4",
        "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-layer-freq", "[0]+[1]",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow  # three one-process runs and a two-rank launch
def test_finetune_from_megatron_torch_dist_moe_export(tmp_path: Path) -> None:
    trained = str(tmp_path / "trained")
    argv = _argv(tmp_path, "--ckpt-format", "torch", "--save", trained, iters=3)
    Trainer(parse_args(argv)).train()
    export_megatron(trained, tmp_path / "megatron", ckpt_format="torch_dist", report=lambda _: 0)

    def finetune(load: str) -> list[str]:
        return _argv(tmp_path, "--load", load, "--finetune", iters=3)

    own = Trainer(parse_args(finetune(trained))).train().losses
    exported = Trainer(parse_args(finetune(str(tmp_path / "megatron")))).train().losses
    assert exported == own  # bitwise
    out = tmp_path / "ep2.json"
    ep2 = [*finetune(str(tmp_path / "megatron")), "--expert-model-parallel-size", "2"]
    launch_workers(str(WORKER), 2, [str(out), json.dumps([ep2])], timeout=300)
    (two,) = json.loads(out.read_text())
    assert two["losses"] == pytest.approx(own, rel=1e-5)
