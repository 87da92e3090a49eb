"""Build the demo's instruction set: chat conversations made from the demo corpus's texts.

Two kinds of question, both answerable from the texts themselves, so a reader can
check what the finetuned model learnt:

- Wikipedia: "What is Anarchism?" answered with the article's first sentence (its
  wikitext markup stripped), for every article of the dump excerpt that opens with
  its title in bold.
- Shakespeare: "Who wrote Macbeth?", and "Continue this line from Macbeth: ..."
  answered with the verse line that follows it in the play.

Botchan, the third source of the demo corpus, is left out on purpose: the demo
measures perplexity on it, so it stays text the finetuning never saw.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

from mg.core.fixtures import fixture_dir, fixture_path

PLAYS = {
    "hamlet": "Hamlet",
    "julius_caesar": "Julius Caesar",
    "lear": "King Lear",
    "macbeth": "Macbeth",
    "othello": "Othello",
    "tempest": "The Tempest",
}


def strip_wikitext(text: str) -> str:
    """Plain text of wikitext, good enough for an article's opening sentence."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    previous = None
    while previous != text:  # templates and file links nest: innermost first
        previous = text
        text = re.sub(r"\{\{[^{}]*\}\}", "", text)
        text = re.sub(r"\[\[(?:File|Image):[^\[\]]*\]\]", "", text)
    text = re.sub(r"\[\[[^\[\]|]*\|([^\[\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[\[([^\[\]]*)\]\]", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text).replace("&nbsp;", " ")
    return re.sub(r"\s*\([\s,;]*\)", "", text)  # what removed pronunciations leave


def first_sentence(paragraph: str) -> str | None:
    """Up to the first full stop that ends a sentence (not 'U.S.' or 'c.')."""
    match = re.search(r"^(.{30,400}?[a-z0-9)\]]{2}\.)(\s|$)", paragraph)
    return match.group(1) if match else None


def wikipedia_questions() -> Iterator[tuple[str, str]]:
    """("What is X?", its first sentence) for articles that open with '''X'''."""
    path = fixture_path("enwiki-excerpt", "enwiki-excerpt.xml")
    for _, element in ET.iterparse(path):
        if not element.tag.endswith("}text") or not element.text:
            continue
        text = element.text
        element.clear()
        if text.lstrip().upper().startswith("#REDIRECT"):
            continue
        for paragraph in strip_wikitext(text).split("\n"):
            bold = re.match(r"\s*(?:The |An? )?'''([^']{2,60})'''", paragraph)
            if bold is None:
                continue
            sentence = first_sentence(re.sub(r"'{2,}", "", paragraph).strip())
            if sentence:
                yield f"What is {bold.group(1)}?", re.sub(r"\s+", " ", sentence)
            break


def verse_pairs(text: str) -> Iterator[tuple[str, str]]:
    """Two consecutive lines of one speech: no speaker tag, stage direction or heading."""
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines()]
        for first, second in zip(lines, lines[1:], strict=False):
            if all(
                25 <= len(line) <= 80
                and not line.startswith(("[", "ACT", "SCENE", "Scene"))
                and not line.isupper()
                for line in (first, second)
            ):
                yield first, second


def shakespeare_questions(rng: random.Random, lines_per_play: int) -> Iterator[tuple[str, str]]:
    for path in sorted(fixture_dir("shakespeare").glob("*.txt")):
        title = PLAYS.get(path.stem)
        if title is None:
            continue
        yield f"Who wrote {title}?", f"{title} was written by William Shakespeare."
        pairs = list(verse_pairs(path.read_text(encoding="utf-8", errors="replace")))
        for first, second in rng.sample(pairs, min(lines_per_play, len(pairs))):
            yield f'Continue this line from Shakespeare\'s {title}: "{first}"', second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, required=True, help="conversations, JSON lines")
    parser.add_argument(
        "--lines-per-play", type=int, default=30, help="continuation questions per play"
    )
    parser.add_argument("--seed", type=int, default=1234, help="of the lines picked and the order")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pairs = list(wikipedia_questions()) + list(shakespeare_questions(rng, args.lines_per_play))
    rng.shuffle(pairs)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(args.output.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for question, answer in pairs:
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    os.replace(tmp, args.output)
    print(f"wrote {len(pairs)} conversations to {args.output}")


if __name__ == "__main__":
    main()
