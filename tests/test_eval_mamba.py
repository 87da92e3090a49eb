"""mg-eval on Mamba-2 and hybrid checkpoints: WikiText perplexity of an imported
`Mamba2ForCausalLM` equals transformers' on the same windows, and a hybrid's (Mamba,
attention and MLP layers) equals its own full forward."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mg.core.checkpoint import load_model, save_model
from mg.core.fixtures import fixture_path, gpt2_bpe_tokenizer_config
from mg.core.models.mamba import MambaModel, tiny_hybrid
from mg.core.tokenizers import build_tokenizer
from mg.evaluate.cli import main as mg_eval
from mg.evaluate.detokenizer import wikitext_detokenize

transformers = pytest.importorskip("transformers")
import_hf = pytest.importorskip("mg.ckpt_convert.import_hf").import_hf

SEQ = 32
TEXT = (
    " = The school = \n \n"
    " I had been teaching at the school for a month when the boys began to play tricks "
    "on me . The headmaster said that 1 @,@ 200 yen a year was a good salary , and the "
    "town 's inn was well @-@ known . \n"
    " The teacher of mathematics , whom the boys called Porcupine , laughed at me and "
    "said that I should not mind them ; they were only country boys . \n"
)
TOKENIZER = [
    *("--tokenizer-type", "GPT2BPETokenizer"),
    *("--vocab-file", str(fixture_path("gpt2-bpe", "vocab.json"))),
    *("--merge-file", str(fixture_path("gpt2-bpe", "merges.txt"))),
]


def _tokenizer():
    return build_tokenizer(gpt2_bpe_tokenizer_config())


def _disjoint_window_loss(logits_of, ids: list[int]) -> float:
    """Mean next-token loss over disjoint windows of SEQ targets, the model's logits over
    the tokenizer's 50257 tokens only (Megatron's padding rows take no probability)."""
    total = 0.0
    for start in range(0, len(ids) - 1, SEQ):
        window = ids[start : start + SEQ + 1]
        with torch.no_grad():
            logits = logits_of(torch.tensor([window[:-1]]))[0, :, :50257].double()
        lp = torch.log_softmax(logits, -1)
        total -= float(lp[torch.arange(len(window) - 1), torch.tensor(window[1:])].sum())
    return total / (len(ids) - 1)


def _mg_eval_wikitext(ckpt, tmp_path, capsys) -> dict:
    data = tmp_path / "wiki.test.tokens"
    data.write_text(TEXT, encoding="utf-8")
    report = tmp_path / "report.jsonl"
    argv = ["wikitext", "--load", str(ckpt), "--valid-data", str(data), *TOKENIZER]
    argv += ["--seq-length", str(SEQ), "--overlapping-eval", str(SEQ), "--report", str(report)]
    code = mg_eval(argv)
    assert code == 0, capsys.readouterr().err
    return json.loads(report.read_text())["metrics"]


def test_mamba2_wikitext_equals_transformers(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    config = transformers.Mamba2Config(
        num_heads=8,
        head_dim=16,
        hidden_size=64,
        state_size=16,
        n_groups=2,
        num_hidden_layers=2,
        vocab_size=50257,
        chunk_size=16,
    )
    hf = transformers.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    ours = _mg_eval_wikitext(tmp_path / "ckpt", tmp_path, capsys)
    ids = _tokenizer().tokenize(wikitext_detokenize(TEXT))
    expected = _disjoint_window_loss(lambda x: hf(x).logits, ids)
    assert ours["avg_loss"] == pytest.approx(expected, rel=1e-5)
    assert ours["ppl"] == pytest.approx(math.exp(expected), rel=1e-4)


def test_hybrid_wikitext_equals_its_forward(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    config = tiny_hybrid(seq_length=SEQ)
    save_model(tmp_path / "ckpt", MambaModel(config).eval(), config, None)
    ours = _mg_eval_wikitext(tmp_path / "ckpt", tmp_path, capsys)
    model = load_model(tmp_path / "ckpt")[0].eval()
    ids = _tokenizer().tokenize(wikitext_detokenize(TEXT))
    expected = _disjoint_window_loss(model, ids)
    assert ours["avg_loss"] == pytest.approx(expected, rel=1e-5)
