"""Peak memory and time of `mg-prep tokenize` on one huge document, per tokenizer.

    uv run --frozen python bench/bench_prep_long_document.py                # 50 MB, all
    uv run --frozen python bench/bench_prep_long_document.py --size-mb 5 --only gpt2-openai

The input is one JSONL line whose text is the fixture texts (Shakespeare,
Botchan, Wikipedia) joined and repeated up to --size-mb. Each tokenizer runs
`mg-prep tokenize --workers 1 --append-eod` on it in its own process tree,
whose RSS (sum over the processes) is sampled every 50 ms as in
bench_prep.py. The tokenizers:

- gpt2-openai: GPT2BPETokenizer with OpenAI's vocab.json/merges.txt (tiktoken);
- gpt2-trained: GPT2BPETokenizer with a byte-level BPE trained here on Botchan
  (8,000 tokens; its ids do not follow tiktoken's rule, so `tokenizers` runs it);
- hf-byte-level: HuggingFaceTokenizer on that trained tokenizer.json;
- sentencepiece: GPTSentencePieceTokenizer with Mistral's tokenizer.model;
- wordpiece: BertWordPieceLowerCase with MiniLM's vocab.txt (document level).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prep import MIB, WORK, measure  # noqa: E402

from mg.core.fixtures import fixture_dir, fixture_path  # noqa: E402

TOKENIZERS = ("gpt2-openai", "gpt2-trained", "hf-byte-level", "sentencepiece", "wordpiece")


def make_document(size_mb: int) -> Path:
    """One JSONL line of at least size_mb MiB of real text, cached by size."""
    from mg.corpus_prep.sample_corpus import (
        botchan_documents,
        shakespeare_documents,
        wikipedia_documents,
    )

    path = WORK / f"one-document-{size_mb}mb.jsonl"
    if path.exists():
        return path
    WORK.mkdir(parents=True, exist_ok=True)
    docs = [*shakespeare_documents(), *botchan_documents(), *wikipedia_documents()]
    block = "\n\n".join(d["text"] for d in docs)
    text = (block + "\n\n") * (size_mb * MIB // len(block.encode("utf-8")) + 1)
    path.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def trained_bpe() -> Path:
    """A byte-level BPE (vocab.json, merges.txt, tokenizer.json) trained on Botchan."""
    folder = WORK / "trained-bpe"
    if (folder / "tokenizer.json").exists():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = fixture_path("botchan", "botchan.txt").read_text("utf-8")
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    tokenizer.model.save(str(folder))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def tokenizer_flags(name: str) -> list[str]:
    gpt2 = fixture_dir("gpt2-bpe")
    if name == "gpt2-openai":
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2 / "vocab.json"),
                "--merge-file", str(gpt2 / "merges.txt")]  # fmt: skip
    if name == "gpt2-trained":
        folder = trained_bpe()
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                str(folder / "vocab.json"), "--merge-file", str(folder / "merges.txt")]  # fmt: skip
    if name == "hf-byte-level":
        return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(trained_bpe())]
    if name == "sentencepiece":
        model = fixture_path("mistral-spm", "tokenizer.model")
        return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(model)]
    if name == "wordpiece":
        vocab = fixture_path("minilm-bert", "vocab.txt")
        return ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab)]
    raise ValueError(name)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=50)
    parser.add_argument("--only", nargs="+", choices=TOKENIZERS, default=list(TOKENIZERS))
    args = parser.parse_args()
    document = make_document(args.size_mb)
    size = document.stat().st_size
    print(f"one document of {size / MIB:.1f} MiB; {cpu_model()}")
    print(f"{'tokenizer':<15} {'wall s':>7} {'peak RSS (tree)':>16} {'largest process':>16}")
    for name in args.only:
        prefix = str(WORK / f"long-{name}")
        command = [
            str(Path(sys.executable).parent / "mg-prep"), "tokenize", "--input", str(document),
            "--output-prefix", prefix, "--workers", "1", "--append-eod", "--no-progress-bar",
            *tokenizer_flags(name),
        ]  # fmt: skip
        result = measure(name, command, prefix + "_text_document")
        status = "" if result.ok else "  FAILED"
        print(
            f"{name:<15} {result.seconds:>7.1f} {result.peak_total / MIB:>13,.0f} MB "
            f"{result.peak_process / MIB:>13,.0f} MB{status}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
