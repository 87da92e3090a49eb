"""mg-eval of a hybrid (Mamba, attention, MLP layers) at TP=2 and at PP=2 equals one process.

Each rank builds its part of the `MambaModel` on the meta device (its mixers split
by heads and groups, or its stage of the layer pattern) and reads only that from
the checkpoint. One 2-rank launch runs both layouts; WikiText loss within 1e-5
relative of the single-process run (the sums only change order).
"""

from __future__ import annotations

import json

import pytest
import torch
from eval_ranks import THEN, run_eval_ranks

from mg.core.checkpoint import save_model
from mg.core.models.mamba import MambaModel, tiny_hybrid
from mg.evaluate.cli import main

TEXT = (
    " = The school = \n \n"
    " I had been teaching at the school for a month when the boys began to play tricks "
    "on me . The headmaster said that 1 @,@ 200 yen a year was a good salary , and the "
    "town 's inn was well @-@ known . \n"
)


def test_hybrid_at_tp2_and_pp2_equals_one_process(tokenizer_config, tmp_path) -> None:
    torch.manual_seed(0)
    # 4 layers; 2 Mamba heads of 16 in 2 groups: one group per TP rank
    config = tiny_hybrid(
        num_layers=4, seq_length=16, mamba_num_groups=2, hybrid_override_pattern="M*M-"
    )
    ckpt = tmp_path / "ckpt"
    save_model(ckpt, MambaModel(config).eval(), config, tokenizer_config)
    data = tmp_path / "wiki.test.tokens"
    data.write_text(TEXT, encoding="utf-8")
    command = ["wikitext", "--load", str(ckpt), "--valid-data", str(data)]
    command += ["--overlapping-eval", "8", "--micro-batch-size", "2"]
    one = tmp_path / "one.jsonl"
    assert main([*command, "--report", str(one)]) == 0
    two = tmp_path / "two.jsonl"
    argv = [*command, "--tensor-model-parallel-size", "2", "--report", str(two), THEN]
    argv += [*command, "--pipeline-model-parallel-size", "2", "--report", str(two)]
    run_eval_ranks(2, argv, tmp_path / "ranks")
    (expected,) = [json.loads(line)["metrics"] for line in one.read_text().splitlines()]
    for metrics in [json.loads(line)["metrics"] for line in two.read_text().splitlines()]:
        assert metrics["avg_loss"] == pytest.approx(expected["avg_loss"], rel=1e-5)
        assert metrics["num_tokenized_tokens"] == expected["num_tokenized_tokens"]
