"""`mg-prep wikipedia`: a Wikipedia XML dump to loose JSON, one article a line.

    mg-prep wikipedia --input enwiki-latest-pages-articles1.xml.bz2 --output wiki.jsonl
    mg-prep tokenize --input wiki.jsonl --output-prefix data/wiki ...

The wikitext is turned into plain text by WikiExtractor (the `wikipedia`
extra), not by a parser of our own: each line is its JSON object, with `id`,
`revid`, `url`, `title` and `text`, articles in dump order. The output is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import run_later


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "wikipedia",
        help="a Wikipedia XML dump (*-pages-articles*.xml.bz2) to loose JSON lines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", required=True, metavar="DUMP", help="the XML dump, plain or .bz2"
    )
    parser.add_argument("--output", required=True, metavar="JSONL", help="the JSON-lines file")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="extractor processes (default 1)",
    )
    parser.add_argument(
        "--no-templates",
        action="store_true",
        help="do not expand templates (faster; text inside templates is dropped)",
    )
    parser.set_defaults(func=run_later("wikipedia_cmd"))
