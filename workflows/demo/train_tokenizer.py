"""Train a small GPT-2-style byte-level BPE on the demo corpus (vocab.json + merges.txt).

    python workflows/demo/train_tokenizer.py --input demo-output/corpus.jsonl \
        --vocab-size 4096 --output-dir demo-output/tokenizer

GPT-2's own vocabulary has 50,257 tokens: on a tiny model its output layer is
most of the arithmetic (128 x 50,304 weights against 2 x 12 x 128^2 in the
layers), so a CPU demo spends its minutes learning rare subwords. A vocabulary
trained on the corpus itself is 12x smaller and splits this text into fewer
tokens. The files have GPT-2's layout (the 256 byte tokens first, in GPT-2's
byte order, then one token per merge, `<|endoftext|>` last), so every tool reads
them as `--tokenizer-type GPT2BPETokenizer`, as Megatron would.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

EOD = "<|endoftext|>"


def texts(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)["text"]


def gpt2_byte_tokens() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order (ids 0-255 in its vocab.json)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def train(corpus: Path, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """vocab.json's mapping and merges.txt's pairs, `vocab_size` tokens in all."""
    byte_tokens = gpt2_byte_tokens()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # <|endoftext|> is added last, as in GPT-2's file
        initial_alphabet=byte_tokens,
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(corpus), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab = {token: i for i, token in enumerate(byte_tokens)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab[EOD] = len(vocab)
    return vocab, merges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="loose JSON, a 'text' per line")
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokens, <|endoftext|> too")
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args()
    vocab, merges = train(args.input, args.vocab_size)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("vocab.json", json.dumps(vocab, ensure_ascii=False)),
        ("merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)),
    ):
        tmp = args.output_dir / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, args.output_dir / name)
    print(
        f"wrote a {len(vocab):,}-token byte-level BPE ({len(merges):,} merges) to {args.output_dir}"
    )


if __name__ == "__main__":
    main()
