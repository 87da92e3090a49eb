"""`mg-eval toxicity`: score generated texts (JSON lines) with a pluggable toxicity scorer.

The scoring step of Megatron-LM's detoxification example: every text gets a score in
[0, 1] (`mg.evaluate.toxicity`: a local word list by default, a command or an HTTP
endpoint), the mean is reported, and `--output` keeps each record with its score so a
workflow can keep the least toxic ones.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from mg.evaluate.errors import EvalInputError, read_text
from mg.evaluate.toxicity import scorer_from_spec


def add_toxicity_task(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "toxicity",
        help="toxicity scores of texts (JSON lines) from a pluggable scorer",
        description="Score each text of a JSON-lines file and report the mean. --scorer: "
        "wordlist (default: a built-in list of insults, curses and violent words, a local "
        "stand-in for Perspective API, no network), wordlist:FILE (one word a line), "
        "command:CMD (texts as JSON lines on its stdin, one score a line on its stdout), "
        'or an http(s) URL (POST {"texts": [...]} -> {"scores": [...]}).',
    )
    p.add_argument("--input", required=True, metavar="FILE.jsonl", help="one JSON object a line")
    p.add_argument("--key", default="text", help="the field holding the text (default text)")
    p.add_argument("--scorer", default="wordlist", metavar="SPEC", help="default wordlist")
    p.add_argument(
        "--output", metavar="FILE.jsonl", help="the records again, each with its 'toxicity'"
    )
    p.add_argument("--report", metavar="FILE.jsonl", help="append the results as a JSON line")
    p.set_defaults(run=run_toxicity, print_result=_line)


def read_texts(path: str, key: str) -> tuple[list[dict[str, Any]], list[str]]:
    records, texts = [], []
    for number, line in enumerate(read_text(path, "toxicity").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalInputError(f"not JSON ({exc.msg})", path, number) from None
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise EvalInputError(f"no string field {key!r} (--key)", path, number)
        records.append(record)
        texts.append(record[key])
    if not texts:
        raise EvalInputError("no texts", path)
    return records, texts


def run_toxicity(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    if args.output and Path(args.output).resolve() == Path(args.input).resolve():
        raise EvalInputError("--output is the --input file; name another file", args.output)
    scorer = scorer_from_spec(args.scorer)
    records, texts = read_texts(args.input, args.key)
    scores = scorer.score(texts)
    if args.output:
        tmp = f"{args.output}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            for record, score in zip(records, scores, strict=True):
                out.write(json.dumps({**record, "toxicity": score}) + "\n")
        os.replace(tmp, args.output)
    metrics = {
        "mean": sum(scores) / len(scores),
        "max": max(scores),
        "scored": sum(s > 0 for s in scores),
        "texts": len(scores),
    }
    return metrics, {"input": args.input, "scorer": args.scorer}


def _line(task: str, metrics: dict[str, Any]) -> str:
    return (
        f" toxicity | mean: {metrics['mean']:.6f} | max: {metrics['max']:.6f} | "
        f"texts with a score above 0: {metrics['scored']} of {metrics['texts']} |"
    )
