import json
import math

import pytest
from eval_hf_reference import to_hf, wikitext_ppl

from mg.evaluate.cli import main
from mg.evaluate.wikitext import build_windows

V = 50257  # the tokenizer's tokens: uniform logits over them (the padding rows to 50304
# take no probability) cost ln(V) per token


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_windows_follow_megatron_lm_dataset() -> None:
    # 10 tokens = 9 targets, seq 4, stride 2: ceil((9-2)/2)+1 = 5 windows
    windows = build_windows(list(range(10)), seq_length=4, stride=2)
    assert [list(w.tokens) for w in windows] == [
        [0, 1, 2, 3, 4],
        [2, 3, 4, 5, 6],
        [4, 5, 6, 7, 8],
        [6, 7, 8, 9],
        [8, 9],
    ]
    assert [list(w.mask) for w in windows] == [
        [1, 1, 1, 1],
        [0, 0, 1, 1],
        [0, 0, 1, 1],
        [0, 0, 1],
        [0],
    ]
    scored = [w.tokens[j + 1] for w in windows for j, m in enumerate(w.mask) if m]
    assert scored == list(range(1, 10))  # every target exactly once


def test_hand_checked_numbers_with_uniform_logits(zero_ckpt, tokenizer, tmp_path, capsys) -> None:
    path = tmp_path / "wiki.tokens"
    path.write_text(" The cat sat . \n", encoding="utf-8")
    # words: 'The cat sat .' → 4; detokenized ' The cat sat.\n' → ' The',' cat',' sat','.','\n'
    assert len(tokenizer.tokenize(" The cat sat.\n")) == 5
    report = tmp_path / "r.jsonl"
    code, out, _ = run(
        capsys,
        "wikitext",
        "--load",
        str(zero_ckpt),
        "--valid-data",
        str(path),
        "--report",
        str(report),
    )
    assert code == 0
    m = json.loads(report.read_text())["metrics"]
    assert m["num_tokenized_tokens"] == 5 and m["num_original_tokens"] == 4
    assert m["token_ratio"] == pytest.approx(4 / 3)
    assert m["avg_loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert m["ppl"] == pytest.approx(V, rel=1e-5)
    assert m["adjusted_ppl"] == pytest.approx(V ** (4 / 3), rel=1e-5)
    assert "validation results on WIKITEXT" in out and "adjusted ppl: " in out


@pytest.mark.parametrize("stride", [16, 64])
def test_matches_transformers_on_the_same_weights(
    trained, tokenizer, wikitext_file, tmp_path, capsys, stride
) -> None:
    model, ckpt = trained
    report = tmp_path / "r.jsonl"
    code, _, err = run(
        capsys,
        "wikitext",
        "--load",
        str(ckpt),
        "--valid-data",
        str(wikitext_file),
        "--overlapping-eval",
        str(stride),
        "--micro-batch-size",
        "4",
        "--report",
        str(report),
    )
    assert code == 0, err
    ours = json.loads(report.read_text())["metrics"]
    reference = wikitext_ppl(
        to_hf(model), tokenizer, wikitext_file.read_text(encoding="utf-8"), 64, stride
    )
    print(stride, ours, reference)
    assert ours["num_windows"] > 3
    for key, value in reference.items():
        assert ours[key] == pytest.approx(value, rel=1e-4), key
