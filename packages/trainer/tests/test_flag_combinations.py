"""Flags that do not go together are refused by one table (arguments/combinations.py), each
refusal one line naming both flags."""

from __future__ import annotations

import pytest

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.arguments.combinations import CONFLICTS

BASE = [
    "gpt",
    *("--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--mock-data"),
    *("--vocab-size", "127", "--micro-batch-size", "2", "--global-batch-size", "8"),
    *("--train-iters", "2", "--lr", "1e-3"),
]


def test_every_refusal_names_both_flags() -> None:
    for conflict in CONFLICTS:
        for side in (conflict.first, conflict.second):
            words = side.split()
            name = next((w for w in words if w.startswith("--")), words[-1])  # "mg-train t5"
            assert name in conflict.message, conflict
        assert "\n" not in conflict.message


@pytest.mark.parametrize(
    ("extra", "world_size", "expected"),
    [
        (["--fp16", "--bf16"], 1, "--fp16 and --bf16 cannot both be set"),
        (
            ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--bf16"]
            + ["--recompute-granularity", "full", "--recompute-method", "uniform"]
            + ["--recompute-num-layers", "1"],
            1,
            "--fp8-format with --recompute-granularity full is not supported",
        ),
        (
            ["--async-save", "--ckpt-format", "torch", "--save", "ckpt"],
            1,
            "--async-save needs --ckpt-format torch_dist",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce"],
            2,
            "--overlap-grad-reduce with --pipeline-model-parallel-size > 1 needs",
        ),
        (["--save-interval", "2"], 1, "--save-interval needs --save"),
    ],
)
def test_a_conflict_is_one_line(extra: list[str], world_size: int, expected: str) -> None:
    with pytest.raises(ArgumentError, match=expected):
        parse_args([*BASE, *extra], world_size=world_size)


def test_fp8_with_selective_recompute_is_accepted_by_the_table() -> None:
    """Selective recompute reruns the attention core only, which runs outside FP8 anyway."""
    from mg.trainer.arguments.combinations import check_combinations

    args = parse_args([*BASE, "--recompute-activations"], world_size=1)
    args.transformer_engine.transformer_impl = "transformer_engine"
    args.transformer_engine.fp8 = "hybrid"
    check_combinations(args)  # nothing refused
