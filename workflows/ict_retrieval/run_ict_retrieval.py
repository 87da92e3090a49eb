"""`just ict-retrieval`: the ICT retriever trained briefly on the CPU, against the untrained one.

    python workflows/ict_retrieval/run_ict_retrieval.py --output-dir ict-output [--dry-run]

1. data: passages of Botchan, Shakespeare and Wikipedia (`make_passages.py`), split into
   sentences by `mg-prep tokenize --split-sentences` with MiniLM's WordPiece vocabulary;
   the last tenth of the passages are held out (`--split 90,10,0`)
2. bert: the real MiniLM-L6 BERT's first two layers (`../retro_vs_gpt/import_bert.py`),
   the checkpoint both towers start from, as Megatron's ICT starts from a BERT
3. `mg-eval ict-retrieval --load <the BERT>`: the untrained bi-encoder's top-k accuracy on
   the held-out (query sentence, block) pairs, every query against every held-out block
4. `mg-train ict --bert-load <the BERT>`: Inverse Cloze Task training, in-batch negatives
5. `mg-eval ict-retrieval --load <the ICT checkpoint>`: the same pairs again
6. `summary.md`: both rows, the training loss, the machine. Exit 1 unless training at least
   doubles the held-out top-5 accuracy.

`--dry-run` prints the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "workflows"))
from steps import (  # noqa: E402 (workflows/steps.py)
    Timing,
    machine,
    phase_table,
    run_command,
    run_steps,
    script,
    tool,
    train_losses,
)

SPLIT = "90,10,0"


@dataclass
class Settings:
    out: Path
    train_iters: int = 300
    global_batch_size: int = 32
    seq_length: int = 64
    lr: float = 1e-3
    bert_layers: int = 2
    max_passages: int | None = None
    seed: int = 1234


@dataclass
class Step:
    phase: str
    argv: list[str]
    log: Path | None = None


def vocab_file() -> str:
    from mg.core.fixtures import fixture_path  # the fixture cache (fetched on first use)

    return str(fixture_path("minilm-bert", "vocab.txt"))


def plan(s: Settings, vocab: str) -> list[Step]:
    """The commands in order; every file one reads, an earlier one wrote."""
    d = s.out
    data = d / "data" / "passages_text_sentence"
    tokenizer = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab]
    passages = ["--max-passages", s.max_passages] if s.max_passages else []
    evaluate = [
        *("--data-path", data, "--split", SPLIT, "--seq-length", s.seq_length),
        *("--seed", s.seed, "--report", d / "eval.jsonl"),
    ]
    # fmt: off
    return [
        Step("data", script(HERE / "make_passages.py", "--output", d / "passages.jsonl",
                            "--seed", s.seed, *passages)),
        Step("data", tool("mg-prep", "tokenize", "--input", d / "passages.jsonl",
                          "--output-prefix", d / "data" / "passages", "--split-sentences",
                          *tokenizer, "--workers", 1)),
        Step("bert", script(ROOT / "workflows/retro_vs_gpt/import_bert.py", "--save",
                            d / "bert", "--num-layers", s.bert_layers)),
        Step("evaluate", tool("mg-eval", "ict-retrieval", "--load", d / "bert", *evaluate)),
        Step("train", tool(
            "mg-train", "ict", "--bert-load", d / "bert", "--num-layers", s.bert_layers,
            "--hidden-size", 384, "--num-attention-heads", 12, "--ffn-hidden-size", 1536,
            "--max-position-embeddings", 512, "--seq-length", s.seq_length, *tokenizer,
            "--data-path", data, "--split", SPLIT, "--data-cache-path", d / "cache",
            "--micro-batch-size", s.global_batch_size,
            "--global-batch-size", s.global_batch_size, "--train-iters", s.train_iters,
            "--lr", s.lr, "--lr-warmup-iters", max(1, s.train_iters // 30),
            "--lr-decay-style", "cosine", "--seed", s.seed, "--eval-iters", 0,
            "--log-interval", max(1, s.train_iters // 15), "--save", d / "ict",
            "--ckpt-format", "torch", "--no-save-optim", "--no-save-rng",
            "--num-workers", 0,  # no loader processes: on a CPU they take the cores
        ), log=d / "train_ict.log"),
        Step("evaluate", tool("mg-eval", "ict-retrieval", "--load", d / "ict", *evaluate)),
    ]
    # fmt: on


def results(s: Settings) -> tuple[dict, dict]:
    """(untrained, trained) metrics: eval.jsonl's two records, in the order they ran."""
    records = [json.loads(line) for line in (s.out / "eval.jsonl").read_text().splitlines()]
    untrained, trained = (r["metrics"] for r in records[-2:])
    return untrained, trained


def verdict(untrained: dict, trained: dict) -> tuple[bool, str]:
    chance = 100 * min(5, untrained["pairs"]) / untrained["pairs"]  # top-5 of random scores
    better = trained["top5_acc"] >= 2 * max(untrained["top5_acc"], chance)
    word = "**yes**" if better else "**NO**"
    return better, (
        f"Training at least doubles the held-out top-5 accuracy: {word} "
        f"({untrained['top5_acc']:.2f}% → {trained['top5_acc']:.2f}%)."
    )


def summary(s: Settings, timings: dict[str, Timing], seconds: float, load: tuple) -> str:
    untrained, trained = results(s)
    losses = train_losses((s.out / "train_ict.log").read_text())
    pairs = untrained["pairs"]
    ks = sorted(int(k[3:-4]) for k in untrained if k.startswith("top") and k.endswith("_acc"))
    lines = [
        "# The ICT retriever: held-out top-k retrieval accuracy, before and after training",
        "",
        f"{pairs} held-out (query sentence, block) pairs from the last tenth of the passages"
        " (never trained on); each query sentence, taken out of its block, is searched among"
        f" all {pairs} blocks (Faiss Flat, inner product). Chance: top-1 "
        f"{100 / pairs:.2f}%, top-{ks[-1]} {100 * ks[-1] / pairs:.2f}%.",
        "",
        "| bi-encoder | " + " | ".join(f"top-{k}" for k in ks) + " |",
        "| --- | " + " | ".join("---:" for _ in ks) + " |",
    ]
    for label, m in (("untrained (both towers MiniLM)", untrained), ("ICT-trained", trained)):
        lines.append(f"| {label} | " + " | ".join(f"{m[f'top{k}_acc']:.2f}%" for k in ks) + " |")
    _, text = verdict(untrained, trained)
    loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "–"
    lines += [
        "",
        text,
        "",
        "| | |",
        "| --- | --- |",
        f"| towers | MiniLM-L6's first {s.bert_layers} layers (hidden 384, 12 heads), query"
        " and block towers apart, the [CLS] output as the embedding |",
        f"| training | {s.train_iters} iterations of {s.global_batch_size} pairs (in-batch"
        f" negatives), blocks of {s.seq_length} tokens, lr {s.lr:g} cosine, fp32 on the CPU;"
        f" ICT loss {loss} (chance ln {s.global_batch_size} ="
        f" {math.log(s.global_batch_size):.3f}) |",
        f"| machine | {machine()}; load average {load[0]:.1f} at the start,"
        f" {os.getloadavg()[0]:.1f} at the end |",
        f"| wall time | {seconds:.0f} s |",
        "",
        *phase_table(timings),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--train-iters", type=int, default=Settings.train_iters)
    parser.add_argument("--global-batch-size", type=int, default=Settings.global_batch_size)
    parser.add_argument("--seq-length", type=int, default=Settings.seq_length)
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument(
        "--bert-layers", type=int, default=Settings.bert_layers, help="of MiniLM-L6's 6"
    )
    parser.add_argument("--max-passages", type=int, help="cut the corpus (smoke runs)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    s = Settings(
        args.output_dir.resolve(),
        train_iters=args.train_iters,
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        lr=args.lr,
        bert_layers=args.bert_layers,
        max_passages=args.max_passages,
    )
    if args.dry_run:
        for step in plan(s, "<MiniLM vocab.txt>"):
            print(shlex.join(step.argv))
        return
    start, load = time.monotonic(), os.getloadavg()
    for stale in ("ict", "cache", "data", "eval.jsonl"):  # a fresh run each time
        target = s.out / stale
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    s.out.mkdir(parents=True, exist_ok=True)
    timings = run_steps(plan(s, vocab_file()), lambda step: run_command(step.argv, step.log))
    text = summary(s, timings, time.monotonic() - start, load)
    (s.out / "summary.md").write_text(text)
    print(text)
    better, _ = verdict(*results(s))
    sys.exit(0 if better else 1)


if __name__ == "__main__":
    main()
