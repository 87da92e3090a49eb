"""Build the Retro-vs-GPT corpus: training passages, then validation passages, one JSON line
each, where half the validation passages have a near-duplicate in the training part.

    python workflows/retro_vs_gpt/make_corpus.py --output out/corpus.jsonl

Passages are --words-per-passage words of Botchan, Shakespeare's plays and the first
Wikipedia pages of the dump excerpt (the demo corpus's texts, the fixture cache). After a
fixed shuffle the last --valid-documents passages are the validation documents; the
first half of them ("near-duplicate") get a perturbed copy in the training part, the
other half ("fresh") none. A perturbed copy has its sentences' order changed in one
place (two neighbouring sentences swapped) and a share --change of its words replaced
by other words of the corpus: the same passage, not the same tokens.

Retro learns to use its neighbours only where they help, so --train-duplicates of the
training passages also get a perturbed copy (a pair of near-duplicates, both in the
training part). The GPT trains on exactly the same documents.

Lines: {"text", "role": train|valid, "near_duplicate": bool, "pair": id or null};
the training lines first, in shuffled order, then the validation lines. `mg-prep
tokenize` keeps the order, so `--split <train>,<valid>,0` (printed, and written to
<output>.split) makes exactly the validation lines the validation split.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
from make_corpus import passages  # noqa: E402 (workflows/demo/make_corpus.py)

SENTENCE_END = re.compile(r"(?<=[.!?;:])(\s+)")


def perturb(text: str, vocabulary: list[str], change: float, rng: random.Random) -> str:
    """The passage with two neighbouring sentences swapped and ``change`` of its words
    replaced by random corpus words (line breaks and spacing kept)."""
    sentences = SENTENCE_END.split(text)  # sentence, separator, sentence, ...
    if len(sentences) >= 5:
        i = 2 * rng.randrange(len(sentences) // 2 - 1)
        sentences[i], sentences[i + 2] = sentences[i + 2], sentences[i]
    pieces = re.split(r"(\s+)", "".join(sentences))  # word, space, word, ...
    for i in range(0, len(pieces), 2):
        if pieces[i] and rng.random() < change:
            pieces[i] = rng.choice(vocabulary)
    return "".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--words-per-passage", type=int, default=150)
    parser.add_argument("--wikipedia-pages", type=int, default=10)
    parser.add_argument("--valid-documents", type=int, default=80)
    parser.add_argument(
        "--train-duplicates", type=float, default=1.0, help="share of training passages"
    )
    parser.add_argument("--change", type=float, default=0.05, help="share of words replaced")
    parser.add_argument("--max-passages", type=int, help="cut the corpus (smoke runs)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    texts = list(passages(args.words_per_passage, args.wikipedia_pages))
    rng.shuffle(texts)
    if args.max_passages:
        texts = texts[: args.max_passages]
    if not 2 <= args.valid_documents < len(texts) // 2:
        sys.exit(f"--valid-documents {args.valid_documents}: give 2 to {len(texts) // 2 - 1}")
    vocabulary = sorted({w for t in texts for w in t.split() if w.isalpha()})
    valid_texts, train_texts = texts[-args.valid_documents :], texts[: -args.valid_documents]
    near = len(valid_texts) // 2

    train = [
        {"text": t, "role": "train", "near_duplicate": False, "pair": None} for t in train_texts
    ]
    for i, doc in enumerate(train[: round(args.train_duplicates * len(train))]):
        doc["pair"] = f"t{i}"
        copy = perturb(doc["text"], vocabulary, args.change, rng)
        train.append({"text": copy, "role": "train", "near_duplicate": True, "pair": f"t{i}"})
    valid = []
    for i, text in enumerate(valid_texts):
        pair = f"v{i}" if i < near else None
        valid.append({"text": text, "role": "valid", "near_duplicate": i < near, "pair": pair})
        if pair:
            copy = perturb(text, vocabulary, args.change, rng)
            train.append({"text": copy, "role": "train", "near_duplicate": True, "pair": pair})
    rng.shuffle(train)
    rng.shuffle(valid)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(args.output.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for doc in train + valid:
            out.write(json.dumps(doc) + "\n")
    os.replace(tmp, args.output)
    split = f"{len(train)},{len(valid)},0"
    args.output.with_suffix(".split").write_text(split + "\n")
    pairs = sum(d["near_duplicate"] for d in train)
    print(
        f"wrote {len(train) + len(valid)} documents to {args.output}: {len(train)} training "
        f"({pairs} of them perturbed copies), {len(valid)} validation ({near} with a "
        f"near-duplicate in training, {len(valid) - near} without); --split {split}"
    )


if __name__ == "__main__":
    main()
