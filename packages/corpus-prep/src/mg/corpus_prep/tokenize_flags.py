"""`mg-prep tokenize`: Megatron's tools/preprocess_data.py, streaming and with clear errors.

    mg-prep tokenize --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

writes `data/corpus_text_document.{bin,idx}`, byte-identical to what Megatron's
script writes for the same flags. Same flags as Megatron; in addition
`--input` takes several files, globs and folders (`.jsonl`, `.json`, `.gz`,
`.zst`, `.parquet`), `--sentence-splitter` picks NLTK or spaCy, and `--on-error` decides
whether a bad line stops the run (default) or is skipped and counted.
"""

from __future__ import annotations

import argparse
import os

from mg.corpus_prep.commands import run_later
from mg.corpus_prep.engine_flags import add_ray_arguments
from mg.corpus_prep.punkt_rules import DEFAULT_PUNKT_RULES, PUNKT_RULES
from mg.corpus_prep.tokenizer_args import add_tokenizer_args


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tokenize",
        help="tokenize loose JSON into Megatron .bin/.idx datasets (preprocess_data.py)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_tokenize_arguments(parser)
    parser.set_defaults(func=run_later("tokenize_cmd"))


def add_tokenize_arguments(parser: argparse.ArgumentParser, input_output: bool = True) -> None:
    """Every `mg-prep tokenize` flag; `input_output=False` leaves out --input and
    --output-prefix, for commands that set those per file (`mg-prep refresh`)."""
    group = parser.add_argument_group("input data")
    if input_output:
        group.add_argument(
            "--input",
            nargs="+",
            required=True,
            metavar="PATH",
            help="JSON-lines files (.jsonl/.json, optionally .gz/.zst) or Parquet files (rows "
            "read as JSON objects), glob patterns or folders; read in the order given (globs "
            "and folders sorted)",
        )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="keys to take from each JSON object; one output dataset per key (default: text)",
    )
    group.add_argument(
        "--split-sentences", action="store_true", help="split documents into sentences"
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="keep the newlines between sentences when splitting",
    )
    group.add_argument(
        "--lang", default="english", help="language for sentence splitting (default: english)"
    )
    group.add_argument(
        "--sentence-splitter",
        default="nltk",
        metavar="nltk|spacy:PIPELINE",
        help="with --split-sentences: NLTK punkt (default, as Megatron) or a spaCy pipeline, "
        "e.g. spacy:en_core_web_sm (falls back to spacy.blank + sentencizer if not installed)",
    )
    group.add_argument(
        "--punkt-rules",
        choices=PUNKT_RULES,
        default=DEFAULT_PUNKT_RULES,
        help="with --split-sentences and NLTK: whose punkt language rules to split by, "
        "whatever nltk is installed: nltk-3.9 (default; Megatron core_v0.16.1 locks nltk "
        "3.9.3) or nltk-3.10 (curly quotes and guillemets close a sentence like \" and ')",
    )
    add_tokenizer_args(parser)
    group = parser.add_argument_group("tokenization process")
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to each non-empty document",
    )
    if input_output:
        group = parser.add_argument_group("output data")
        group.add_argument(
            "--output-prefix",
            required=True,
            help="output path without suffix; writes PREFIX_KEY_{document,sentence}.bin/.idx",
        )
        group.add_argument(
            "--output-shards",
            type=int,
            default=1,
            metavar="N",
            help="write each dataset as N .bin/.idx shards cut at document boundaries in input "
            "order (PREFIX_KEY_LEVEL_00000_of_0000N, ...), about equal in tokens, and beside "
            "them PREFIX_KEY_LEVEL.blend.txt: the --data-path blend (token counts as weights)",
        )
    group = parser.add_argument_group("runtime")
    group.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="tokenizer processes in all (default: the CPUs available, here %(default)s); "
        "0 tokenizes in the main process",
    )
    group.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="cut the input into N contiguous parts processed side by side (each with "
        "workers/N workers), then merged; the output is the same as with 1",
    )
    add_ray_arguments(
        group,
        "local: worker processes on this machine (default); ray: --workers Ray actors "
        "on a Ray cluster (the ray extra), the input cut into shards (--partitions, default "
        "4 per actor) merged in input order; the output is the same bytes",
    )
    group.add_argument(
        "--tokenizer-backend",
        choices=("auto", "gigatoken", "classic"),
        default="auto",
        help="what encodes the text: gigatoken (Rust BPE, when installed; GPT2BPETokenizer "
        "and GPTSentencePieceTokenizer), classic (mg.core's tokenizers), or auto (default: "
        "gigatoken where it is installed and supports the type, on 4 MiB of input a worker or "
        "more: measured faster); the output is the same bytes",
    )
    group.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="print a progress line every N documents (default: 1000)",
    )
    group.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="a bad line (invalid JSON or UTF-8, missing key, non-string value, unreadable "
        "file): stop with its file:line (fail, default), or skip it and count it (skip)",
    )
    group.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="accepted for Megatron compatibility: input order is always kept",
    )
    group.add_argument(
        "--chunk-size",
        type=int,
        metavar="N",
        help="accepted for compatibility with older preprocess_data.py lines (its "
        "multiprocessing chunk size): workers here take whole batches, the output is the same",
    )
    group.add_argument(
        "--dataset-impl",
        choices=("mmap",),
        help="accepted for compatibility with older preprocess_data.py lines: the output is "
        "always Megatron's mmap format",
    )
    group.add_argument(
        "--no-progress-bar",
        dest="progress_bar",
        action="store_false",
        default=None,
        help="no progress bar on a terminal, and no plain progress line every 30 s "
        "elsewhere (the --log-interval lines stay)",
    )
