"""Hugging Face Llama -> `mg-convert import-hf` -> `mg-train --use-checkpoint-args
--finetune` -> `mg-convert export-hf` -> transformers loads it and agrees with us.

The model is a tiny random Llama (GQA, untied, RMSNorm, SwiGLU, RoPE) with a
byte-level BPE trained on Botchan, so every stage runs the real console tools in
subprocesses; `mg-train` is given no model flags, only `--use-checkpoint-args`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import load_model
from mg.core.fixtures import fixture_path

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{argv[0]} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def _hf_llama(folder: Path, lines: list[str]) -> None:
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(lines, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def test_import_finetune_export_roundtrip(tmp_path: Path) -> None:
    lines = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8-sig").splitlines()
    lines = [line for line in lines[:600] if line.strip()]
    hf = tmp_path / "hf"
    _hf_llama(hf, lines)

    ckpt, ft, hf2 = tmp_path / "ckpt", tmp_path / "ft", tmp_path / "hf2"
    _run(_tool("mg-convert"), "import-hf", str(hf), "--save", str(ckpt))

    corpus = tmp_path / "corpus.jsonl"
    with corpus.open("w", encoding="utf-8") as out:
        for start in range(0, len(lines), 10):
            out.write(json.dumps({"text": "\n".join(lines[start : start + 10])}) + "\n")
    prefix = tmp_path / "data" / "corpus"
    _run(
        _tool("mg-prep"), "tokenize", "--input", str(corpus), "--output-prefix", str(prefix),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf),
        "--append-eod", "--workers", "1", "--no-progress-bar",
    )  # fmt: skip

    log = _run(
        _tool("mg-train"), "gpt", "--use-checkpoint-args", "--finetune",
        "--load", str(ckpt), "--save", str(ft), "--data-path", f"{prefix}_text_document",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "5", "--lr", "1e-4", "--split", "98,2,0",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "5",
    )  # fmt: skip
    losses = [float(part.split("|")[0]) for part in log.split("lm loss:")[1:]]
    assert losses and all(math.isfinite(x) for x in losses), log

    before, config0, _, _ = load_model(ckpt)
    after, config, tokenizer_config, _ = load_model(ft)
    # the imported config, whole; only the training sequence length came from the flags
    assert config.to_dict() == {**config0.to_dict(), "seq_length": 32}
    assert (
        tokenizer_config is not None and tokenizer_config.tokenizer_type == "HuggingFaceTokenizer"
    )
    changed = [
        name
        for name, p in after.state_dict().items()
        if not torch.equal(p, before.state_dict()[name])
    ]
    assert changed, "fine-tuning left every weight unchanged"

    _run(_tool("mg-convert"), "export-hf", "--load", str(ft), "--save", str(hf2))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf2, torch_dtype=torch.float32)
    theirs.eval()
    vocab = theirs.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = after.float()(tokens)[..., :vocab]
        ref = theirs(tokens).logits
    assert (ours - ref).abs().max().item() <= 1e-4
