"""`mg-prep inspect`: what is in an indexed dataset, checked, with decoded samples.

The run; the flags and the command's description are in `inspect_flags`, which
`mg-prep inspect --help` reads without importing this module's dependencies.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from mg.corpus_prep.commands import UserError
from mg.corpus_prep.tokenizer_args import (
    build_tokenizer_from_config,
    config_from_args,
)
from mg.indexed_dataset.format import IndexedDataset, IndexedDatasetError

BAR_WIDTH = 40
VISIBLE_WHITESPACE = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t"})
PERCENTILES = (10, 50, 90, 99)


def document_lengths(sequence_lengths: np.ndarray, document_indices: np.ndarray) -> np.ndarray:
    """Tokens per document: sums of each document's sequence lengths (int64)."""
    ends = np.concatenate(([0], np.cumsum(sequence_lengths, dtype=np.int64)))
    return ends[document_indices[1:]] - ends[document_indices[:-1]]


def length_summary(lengths: np.ndarray) -> dict[str, float]:
    if lengths.size == 0:
        return {}
    summary: dict[str, float] = {"min": int(lengths.min())}
    for q in PERCENTILES:
        summary[f"p{q}"] = int(np.percentile(lengths, q, method="lower"))
    summary["max"] = int(lengths.max())
    summary["mean"] = round(float(lengths.mean()), 1)
    return summary


def histogram_lines(lengths: np.ndarray) -> list[str]:
    """An ASCII histogram in power-of-two buckets: 0, 1, 2-3, 4-7, ... (from the first used)."""
    if lengths.size == 0:
        return []
    buckets = np.zeros(lengths.size, dtype=np.int64)
    positive = lengths > 0
    buckets[positive] = np.floor(np.log2(lengths[positive])).astype(np.int64) + 1
    counts = np.bincount(buckets)
    peak = counts.max()
    lines = []
    first = int(np.flatnonzero(counts)[0])  # no rows of empty buckets before the first count
    for bucket, count in enumerate(counts[first:], start=first):
        if bucket == 0:
            label = "0"
        else:
            low, high = 1 << (bucket - 1), (1 << bucket) - 1
            label = str(low) if low == high else f"{low}-{high}"
        bar = "#" * (round(BAR_WIDTH * count / peak) if count else 0)
        if count and not bar:
            bar = "."
        lines.append(f"    {label:>15} {count:>12,} {bar}".rstrip())
    return lines


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _sample_indices(documents: int, samples: int, doc_lengths: np.ndarray) -> list[int]:
    candidates = np.flatnonzero(doc_lengths > 0)
    if samples <= 0 or candidates.size == 0:
        return []
    picks = np.linspace(0, candidates.size - 1, min(samples, candidates.size)).round()
    return [int(candidates[int(i)]) for i in picks]


def run(args: argparse.Namespace) -> int:
    prefix = args.prefix
    root, extension = os.path.splitext(prefix)
    if extension in (".bin", ".idx"):
        prefix = root
    tokenizer = None
    if args.tokenizer_type:
        tokenizer = build_tokenizer_from_config(config_from_args(args))
    try:
        dataset = IndexedDataset(prefix, multimodal=args.multimodal)
    except IndexedDatasetError as err:
        raise UserError(str(err)) from err
    with dataset:
        report = _report(dataset, prefix)
        doc_lengths = document_lengths(dataset.sequence_lengths, dataset.document_indices)
        picks = _sample_indices(dataset.num_documents, args.samples, doc_lengths)
        samples = [_sample(dataset, d, tokenizer, args.max_chars) for d in picks]
        if args.json:
            report["samples"] = samples
            print(json.dumps(report, indent=2))
            return 0
        print(_format(report, dataset, doc_lengths))
        for sample in samples:
            print(_format_sample(sample))
    return 0


def _report(dataset, prefix: str) -> dict:
    lengths = np.asarray(dataset.sequence_lengths)
    doc_lengths = document_lengths(lengths, dataset.document_indices)
    return {
        "prefix": prefix,
        "dtype": dataset.dtype.name,
        "documents": dataset.num_documents,
        "empty_documents": int((doc_lengths == 0).sum()),
        "sequences": len(dataset),
        "tokens": dataset.num_tokens,
        "bin_bytes": os.path.getsize(prefix + ".bin"),
        "idx_bytes": os.path.getsize(prefix + ".idx"),
        "document_tokens": length_summary(doc_lengths),
        "sequence_tokens": length_summary(lengths),
    }


def _format(report: dict, dataset, doc_lengths: np.ndarray) -> str:
    documents, sequences = report["documents"], report["sequences"]
    per_doc = sequences / documents if documents else 0.0
    itemsize = np.dtype(report["dtype"]).itemsize
    lines = [
        f"mg-prep inspect: {report['prefix']}",
        f"  dtype       {report['dtype']} ({itemsize} bytes per token)",
        f"  documents   {documents:,} ({report['empty_documents']:,} empty)",
        f"  sequences   {sequences:,} ({per_doc:.2f} per document)",
        f"  tokens      {report['tokens']:,}",
        f"  files       .bin {_human(report['bin_bytes'])}, .idx {_human(report['idx_bytes'])}",
    ]
    sections = [("document", doc_lengths, report["document_tokens"])]
    if (np.diff(dataset.document_indices) > 1).any():  # sentence level
        sections.append(
            ("sequence", np.asarray(dataset.sequence_lengths), report["sequence_tokens"])
        )
    for name, lengths, summary in sections:
        if not summary:
            continue
        stats = "  ".join(f"{k} {v:,}" for k, v in summary.items())
        lines.append(f"{name} length (tokens): {stats}")
        lines.extend(histogram_lines(lengths))
    return "\n".join(lines)


def _sample(dataset, document: int, tokenizer, max_chars: int) -> dict:
    first, last = (int(i) for i in dataset.document_indices[document : document + 2])
    sequences = [np.asarray(dataset[i]) for i in range(first, last)]
    sample: dict = {"document": document, "sequences": len(sequences)}
    sample["tokens"] = int(sum(s.size for s in sequences))
    if tokenizer is None:
        flat = np.concatenate(sequences) if sequences else np.zeros(0, dtype=np.int64)
        sample["ids"] = [int(i) for i in flat[:32]]
        return sample
    texts = []
    budget = max_chars
    for ids in sequences:
        if budget <= 0:
            break
        text = tokenizer.detokenize([int(i) for i in ids])
        texts.append(text[:budget])
        budget -= len(text)
    sample["text"] = texts
    sample["truncated"] = budget < 0 or len(texts) < len(sequences)
    return sample


def _format_sample(sample: dict) -> str:
    count = sample["sequences"]
    head = (
        f"document {sample['document']:,} ({count:,} sequence{'' if count == 1 else 's'}, "
        f"{sample['tokens']:,} tokens):"
    )
    if "ids" in sample:
        more = " ..." if sample["tokens"] > len(sample["ids"]) else ""
        return f"{head}\n    ids {sample['ids']}{more}"
    lines = [head]
    for text in sample["text"]:
        lines.append("    | " + text.translate(VISIBLE_WHITESPACE))
    if sample["truncated"]:
        lines.append("    | ...")
    return "\n".join(lines)
