"""The ICT workflow's corpus: passages of the demo's texts, one JSON line each, shuffled.

    python workflows/ict_retrieval/make_passages.py --output out/passages.jsonl

Passages are --words-per-passage words of Botchan, Shakespeare's plays and the first
Wikipedia pages of the dump excerpt (the demo corpus's texts, the fixture cache), in a
fixed shuffle: `mg-prep tokenize --split-sentences` makes each a document of
sentences, and a document split (`--split 90,10,0`) then holds out whole passages.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
from make_corpus import passages  # noqa: E402 (workflows/demo/make_corpus.py)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--words-per-passage", type=int, default=150)
    parser.add_argument("--wikipedia-pages", type=int, default=10)
    parser.add_argument("--max-passages", type=int, help="cut the corpus (smoke runs)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    texts = list(passages(args.words_per_passage, args.wikipedia_pages))
    random.Random(args.seed).shuffle(texts)
    texts = texts[: args.max_passages] if args.max_passages else texts
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(args.output.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text}) + "\n")
    os.replace(tmp, args.output)
    print(f"wrote {len(texts)} passages to {args.output}")


if __name__ == "__main__":
    main()
