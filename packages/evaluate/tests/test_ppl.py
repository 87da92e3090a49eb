import json
import math

import numpy as np
import pytest
import torch
from eval_data import botchan_paragraphs
from eval_hf_reference import to_hf

from mg.evaluate.cli import main
from mg.indexed_dataset import GPTDatasetConfig, IndexedDatasetBuilder, build_gpt_datasets


@pytest.fixture(scope="module")
def prefix(tokenizer, tmp_path_factory) -> str:
    """Botchan paragraphs as documents (each ending in eod), as mg-prep writes them."""
    prefix = str(tmp_path_factory.mktemp("data") / "botchan_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for para in botchan_paragraphs(40):
        ids = tokenizer.tokenize(para) + [tokenizer.eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_valid_split_loss_matches_transformers(
    trained, tokenizer, prefix, tmp_path, capsys
) -> None:
    model, ckpt = trained
    report = tmp_path / "r.jsonl"
    argv = ["ppl", "--load", str(ckpt), "--data-path", prefix, "--split", "80,20,0"]
    argv += ["--data-cache-path", str(tmp_path / "cache"), "--report", str(report)]
    assert main(argv) == 0, capsys.readouterr().err
    m = json.loads(report.read_text())["metrics"]
    # independently: the same valid samples through transformers, loss masked as in training
    config = GPTDatasetConfig(
        64, split="80,20,0", eod_token_id=tokenizer.eod, path_to_cache=str(tmp_path / "c2")
    )
    valid = build_gpt_datasets([prefix], [0, None, 0], config)[1]
    hf = to_hf(model)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(len(valid)):
            sample = valid[i]
            logits = hf(torch.from_numpy(sample["tokens"])[None]).logits[0].double()
            nll = -torch.log_softmax(logits, -1).gather(
                1, torch.from_numpy(sample["labels"])[:, None]
            )
            total += float((nll[:, 0] * torch.from_numpy(sample["loss_mask"]).double()).sum())
            count += float(sample["loss_mask"].sum())
    assert m["num_samples"] == len(valid) > 2
    assert m["loss"] == pytest.approx(total / count, rel=1e-4)
    assert m["ppl"] == pytest.approx(math.exp(total / count), rel=1e-4)
    assert "lm loss PPL" in capsys.readouterr().out


def test_eval_iters_limits_the_samples(trained, prefix, tmp_path, capsys) -> None:
    _, ckpt = trained
    report = tmp_path / "r.jsonl"
    argv = ["ppl", "--load", str(ckpt), "--data-path", prefix, "--split", "80,20,0"]
    argv += ["--eval-iters", "1", "--micro-batch-size", "2", "--report", str(report)]
    argv += ["--data-cache-path", str(tmp_path / "cache")]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(report.read_text())["metrics"]["num_samples"] == 2
