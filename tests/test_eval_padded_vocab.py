"""Padded vocabulary rows take no probability in mg-eval: a GPT-2-shaped `transformers`
model (50,257 tokens) imported with `mg-convert import-hf` is padded to 50,304 rows, as
Megatron pads it; mg-eval scores text exactly as `transformers` scores the original.
Unmasked, the 47 zero rows would take probability mass (the training loss keeps them,
as Megatron's does)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mg.core.fixtures import fixture_path
from mg.core.models.vocab_mask import set_real_vocab_size
from mg.evaluate.model_loading import load_for_eval
from mg.evaluate.scoring import Scored, score_sequences

transformers = pytest.importorskip("transformers")
import_hf = pytest.importorskip("mg.ckpt_convert.import_hf").import_hf

GPT2_BPE = {
    "tokenizer_type": "GPT2BPETokenizer",
    "vocab_file": str(fixture_path("gpt2-bpe", "vocab.json")),
    "merge_file": str(fixture_path("gpt2-bpe", "merges.txt")),
}


def _hf_gpt2(folder: Path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder)
    return model


def test_perplexity_equals_transformers_on_a_padded_vocabulary(tmp_path) -> None:
    hf = _hf_gpt2(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    loaded = load_for_eval(tmp_path / "ckpt", tokenizer_overrides=GPT2_BPE)
    assert loaded.tokenizer.vocab_size == 50257 and loaded.config.vocab_size == 50304
    ids = loaded.tokenizer.tokenize("It was a fine day and the boys were out in the fields.")
    items = [Scored(ids, [1] * (len(ids) - 1))]
    ours = score_sequences(loaded.model, items, micro_batch_size=1)[0].loss_sum

    tokens = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf(tokens).logits[0, :-1].double(), dim=-1)
    expected = -logp.gather(1, tokens[0, 1:, None]).sum().item()
    assert ours == pytest.approx(expected, rel=1e-6)

    set_real_vocab_size(loaded.model, None)  # the padding rows back in the softmax
    unmasked = score_sequences(loaded.model, items, micro_batch_size=1)[0].loss_sum
    # a near-uniform random model: each target loses about log(50304 / 50257) nats
    assert unmasked - expected > 0.5 * (len(ids) - 1) * math.log(50304 / 50257)


def test_mg_serve_never_samples_a_padding_row(tmp_path) -> None:
    """mg-serve's model masks the rows Megatron padded (here from the tokenizer's 50,257
    to 50,304); an imported model keeps its own vocabulary (Qwen2's exceeds its tokenizer)."""
    from mg.core.checkpoint import save_model
    from mg.core.models import GPTModel, presets
    from mg.core.models.vocab_mask import unpadded_vocab_size
    from mg.core.tokenizers import TokenizerConfig
    from mg.generate_server.loading import load_for_serving

    config = presets.tiny_gpt2(vocab_size=50304, max_position_embeddings=32, seq_length=32)
    tokenizer = TokenizerConfig(**GPT2_BPE)
    save_model(tmp_path / "ckpt", GPTModel(config), config, tokenizer)
    served = load_for_serving(tmp_path / "ckpt")
    with torch.no_grad():
        logits = served.model(torch.tensor([[464, 3290, 318]]))
    assert torch.isinf(logits[..., 50257:]).all() and torch.isfinite(logits[..., :50257]).all()
    config.extra = {"hf_vocab_size": 50280}
    assert unpadded_vocab_size(config, 50257) == 50280
