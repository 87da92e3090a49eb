"""Real JSONL corpora built from the text fixtures, for tests and benchmarks.

The documents are real English (six Shakespeare plays and Botchan cut into
paragraphs, Wikipedia pages in MediaWiki markup), plus a handful of edge
cases that Megatron's preprocessing must survive. The output depends only on
the checksum-verified fixtures, so a golden hash of what `mg-prep tokenize`
makes of it is stable.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path

from mg.core.fixtures import fixture_dir, fixture_path

EDGE_CASES: list[str] = [
    "",
    "   \n\n  \t ",
    "A literal <|endoftext|> inside a document is ordinary text.",
    "Ünïcödé façade, naïve café; ΣΊΣΥΦΟΣ and Ὀδυσσεύς. 日本語のテキスト。 Emoji 😀 end.",
    "Control\x07 and zero\u200bwidth and NUL\x00 characters. Soft\u00adhyphen.",
    "Windows\r\nline endings\r\nhere. And\ttabs.",
    "A long word: " + "pneumonoultramicroscopicsilicovolcanoconiosis" * 3 + " ends here.",
    "An even longer one: " + "x" * 230 + ". Then [CLS] and [SEP] as text.",
    "Private\ue000use, unassigned\U000e0fff, CJK \U0002b820\u8c48\uf900 and ΟΔΟΣ ΚΑΙ ΣΟΦΙΑΣ.",
    "Unicode line\u2028separator and next\x85line characters are not line ends in JSONL.",
    "Mr. Smith went to Washington D.C. on Jan. 5th. He met Dr. Who at 3 p.m.\n\nNew para.",
]


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, stripped, empty ones dropped."""
    return [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def shakespeare_documents() -> Iterator[dict[str, str]]:
    for path in sorted(fixture_dir("shakespeare").glob("*.txt")):
        for paragraph in paragraphs(path.read_text(encoding="utf-8")):
            yield {"text": paragraph, "title": path.stem}


def botchan_documents() -> Iterator[dict[str, str]]:
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")
    for paragraph in paragraphs(text):
        yield {"text": paragraph, "title": "botchan"}


def wikipedia_documents(limit: int | None = None) -> Iterator[dict[str, str]]:
    """Pages of the enwiki excerpt: title and raw wikitext."""
    path = fixture_path("enwiki-excerpt", "enwiki-excerpt.xml")
    count = 0
    title = ""
    for _, element in ElementTree.iterparse(path):
        tag = element.tag.rsplit("}", 1)[-1]
        if tag == "title":
            title = element.text or ""
        elif tag == "text":
            yield {"text": element.text or "", "title": title}
            count += 1
            if limit is not None and count >= limit:
                return
        if tag == "page":
            element.clear()


def edge_case_documents() -> Iterator[dict[str, str]]:
    for i, text in enumerate(EDGE_CASES):
        yield {"text": text, "title": f"edge case {i}"}


def real_corpus(wikipedia_pages: int | None = 40) -> Iterator[dict[str, str]]:
    """The standard test corpus: edge cases, Shakespeare, Botchan, then Wikipedia pages."""
    yield from edge_case_documents()
    yield from shakespeare_documents()
    yield from botchan_documents()
    yield from wikipedia_documents(wikipedia_pages)


def write_jsonl(path: str | Path, documents: Iterator[dict[str, str]]) -> int:
    """Write one JSON object per line (ensure_ascii=False, like most corpora); return the count."""
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        for document in documents:
            out.write(json.dumps(document, ensure_ascii=False) + "\n")
            count += 1
    return count
