"""LAMBADA with an accuracy far from zero, so that agreeing with transformers on *which*
lines are right is a real check (REFERENCE §6; the independent loop is
eval_hf_reference.lambada_correct).

The `memorized` fixture (conftest) is a tiny GPT-2 trained on eight short real passages
(Botchan) until it knows them; the LAMBADA file holds those eight and four it has never
seen, so the memorized last words are predicted and the unseen ones mostly not."""

from __future__ import annotations

import json

import pytest
from eval_hf_reference import lambada_correct, to_hf

from mg.evaluate.cli import main


@pytest.mark.parametrize("strict", [False, True])
def test_nonzero_accuracy_matches_transformers(
    memorized, tokenizer, tmp_path, capsys, strict
) -> None:
    model, ckpt, data = memorized
    report = tmp_path / "r.jsonl"
    argv = ["lambada", "--load", str(ckpt), "--valid-data", str(data), "--report", str(report)]
    assert main(argv + (["--strict-lambada"] if strict else [])) == 0, capsys.readouterr().err
    m = json.loads(report.read_text())["metrics"]
    correct = lambada_correct(to_hf(model), tokenizer, data, strict)
    print(f"strict={strict}: {m['num_correct']}/{m['num_examples']} correct: {correct}")
    assert m["num_examples"] == len(correct) == 12
    assert m["num_correct"] == sum(correct)
    assert m["accuracy"] == pytest.approx(sum(correct) / 12, rel=1e-12)
    assert sum(correct[:8]) >= 6  # the memorized passages
    assert sum(correct[8:]) < 4  # not a model that is right about everything
