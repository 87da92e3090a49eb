import json

import pytest
from eval_hf_reference import lambada_correct, to_hf

from mg.evaluate.cli import main


def lambada_metrics(capsys, tmp_path, ckpt, data, *extra: str) -> dict:
    report = tmp_path / "r.jsonl"
    report.unlink(missing_ok=True)
    code = main(
        ["lambada", "--load", str(ckpt), "--valid-data", str(data), "--report", str(report), *extra]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "validation results on LAMBADA" in out.out
    return json.loads(report.read_text())["metrics"]


def test_hand_checked_accuracy_with_argmax_zero(zero_ckpt, tmp_path, capsys) -> None:
    # all logits 0 → argmax is token 0, which is "!" in GPT-2's vocabulary
    data = tmp_path / "l.jsonl"
    lines = ["Wow, what a day!", "It was a quiet day", "He shouted at the sea!"]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    m = lambada_metrics(capsys, tmp_path, zero_ckpt, data)
    assert (m["num_correct"], m["num_examples"]) == (2, 3)
    # strict: targets are ' day!' and ' sea!' (two tokens each): the first is never token 0
    m = lambada_metrics(capsys, tmp_path, zero_ckpt, data, "--strict-lambada")
    assert (m["num_correct"], m["num_examples"], m["accuracy"]) == (0, 3, 0.0)


@pytest.mark.parametrize("strict", [False, True])
def test_matches_transformers_on_the_same_weights(
    trained, tokenizer, lambada_file, tmp_path, capsys, strict
) -> None:
    model, ckpt = trained
    m = lambada_metrics(
        capsys, tmp_path, ckpt, lambada_file, *(["--strict-lambada"] if strict else [])
    )
    correct = lambada_correct(to_hf(model), tokenizer, lambada_file, strict)
    print(strict, m, sum(correct))
    assert m["num_examples"] == len(correct) == 18
    assert m["num_correct"] == sum(correct)
    assert m["accuracy"] == pytest.approx(sum(correct) / len(correct), rel=1e-4)
