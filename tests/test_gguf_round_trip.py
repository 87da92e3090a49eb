"""mg-quantize's GGUF export, then mg-convert import-gguf: the same model back, weights bit
for bit (BF16 and F16 files of a model in that dtype, tied and untied), its config and
its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mg.ckpt_convert.import_gguf import import_gguf
from mg.core.checkpoint.model_io import load_model
from mg.core.models import GPTModel
from mg.core.models.presets import tiny_llama
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.quantize_export.gguf_export import write_gguf

pytest.importorskip("gguf")


def _byte_level_tokenizer(folder: Path) -> TokenizerConfig:
    """A small byte-level BPE tokenizer.json (256 bytes, three merges, <|endoftext|>)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for token in ("Ġt", "he", "Ġthe"):
        vocab[token] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(folder))


@pytest.mark.parametrize(
    ("kind", "dtype", "flag"), [("BF16", torch.bfloat16, "bf16"), ("F16", torch.float16, "fp16")]
)
@pytest.mark.parametrize("tied", [False, True])
def test_export_then_import_is_exact(kind, dtype, flag, tied, tmp_path: Path) -> None:
    tokenizer_config = _byte_level_tokenizer(tmp_path / "tok")
    config = tiny_llama(vocab_size=384, untie_embeddings_and_output_weights=not tied)
    torch.manual_seed(0)
    model = GPTModel(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms not all ones
    write_gguf(tmp_path / "m.gguf", model, config, tokenizer_config, tmp_path, kind)

    import_gguf(tmp_path / "m.gguf", tmp_path / "ckpt", dtype=flag, progress=False)
    back, back_config, back_tokenizer, _ = load_model(tmp_path / "ckpt")
    original, imported = model.state_dict(), back.state_dict()
    assert sorted(imported) == sorted(original)
    for name, tensor in original.items():
        assert imported[name].dtype == dtype
        assert torch.equal(imported[name], tensor), name
    for field in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "vocab_size",
        "rotary_base",
        "untie_embeddings_and_output_weights",
    ):
        assert getattr(back_config, field) == getattr(config, field), field
    assert back_config.layernorm_epsilon == pytest.approx(config.layernorm_epsilon)

    ids = torch.randint(0, 259, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    ours, theirs = build_tokenizer(back_tokenizer), build_tokenizer(tokenizer_config)
    text = "the theory <|endoftext|> of them"
    assert ours.tokenize(text) == theirs.tokenize(text)
    assert ours.eod == theirs.eod == 259
