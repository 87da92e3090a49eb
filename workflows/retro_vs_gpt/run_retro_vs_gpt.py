"""`just retro-vs-gpt`: a small Retro against the same-size GPT, where retrieval should help.

    python workflows/retro_vs_gpt/run_retro_vs_gpt.py --output-dir retro-output [--dry-run]

1. data: passages of Botchan, Shakespeare and Wikipedia (`make_corpus.py`); half the
   validation passages have a perturbed copy (words changed, two sentences swapped) in
   the training part, the other half none; a 4,096-token BPE trained on the corpus
   (the demo's `train_tokenizer.py`); `mg-prep tokenize`
2. retrieval: the real MiniLM-L6 BERT's first two layers (`import_bert.py`) embed
   every chunk of the training documents; `mg-prep retro build`: the chunk database, a
   Faiss Flat index, the neighbours of every train and valid sample's chunks
3. `mg-train gpt` and `mg-train retro`: the same layers, width, data, iterations,
   learning rate and seed; Retro adds its neighbour encoder and chunked cross-attention
4. `evaluate.py`: validation perplexity on the same tokens of the GPT, the Retro
   model with its neighbours, and the Retro model with retrieval off (every neighbour
   missing; and random neighbours), over all validation documents and split into those
   with a near-duplicate in the database and the rest
5. `summary.md`: the figures, training times, the machine. Exit 1 when Retro does not
   beat the GPT.

`--dry-run` prints the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import json
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


@dataclass
class Settings:
    out: Path
    train_iters: int = 300
    num_layers: int = 6
    hidden_size: int = 64
    seq_length: int = 128
    chunk_length: int = 32
    num_neighbors: int = 1
    global_batch_size: int = 16
    max_passages: int | None = 700
    valid_documents: int = 80
    train_duplicates: float = 1.0
    change: float = 0.05
    bert_layers: int = 2
    index_ntrain: int = 5000
    """Chunks the index is trained on: at most the database's (a smoke run's is small)."""
    seed: int = 1234

    @property
    def train_samples(self) -> int:
        """Queried training samples: the run cycles over them (Megatron's cyclic Retro)."""
        return min(self.train_iters * self.global_batch_size, 2400)


@dataclass
class Step:
    phase: str
    argv: list[str]
    stdout: Path | None = None


def model_flags(s: Settings, split: str) -> list[object]:
    """What the GPT and the Retro model share: the decoder, the data, the schedule."""
    d = s.out
    # fmt: off
    return [
        "--num-layers", s.num_layers, "--hidden-size", s.hidden_size,
        "--num-attention-heads", 4, "--seq-length", s.seq_length,
        "--max-position-embeddings", s.seq_length,
        "--micro-batch-size", s.global_batch_size, "--global-batch-size", s.global_batch_size,
        "--train-iters", s.train_iters, "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", min(30, s.train_iters // 10),
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", s.seed,
        "--data-path", d / "data" / "corpus_text_document", "--split", split,
        "--data-cache-path", d / "cache", *tokenizer_flags(s, ""),
        "--log-interval", max(1, s.train_iters // 12), "--eval-interval", s.train_iters,
        "--eval-iters", 1, "--ckpt-format", "torch", "--no-save-optim", "--no-save-rng",
        # no loader processes: on a CPU they take cores from the training (3.5 against
        # 12 s an iteration measured on a busy 2-core machine)
        "--num-workers", 0,
    ]
    # fmt: on


def tokenizer_flags(s: Settings, prefix: str) -> list[object]:
    t = s.out / "tokenizer"
    return [
        f"--{prefix}tokenizer-type",
        "GPT2BPETokenizer",
        f"--{prefix}vocab-file",
        t / "vocab.json",
        f"--{prefix}merge-file",
        t / "merges.txt",
    ]


def plan(s: Settings, split: str) -> list[Step]:
    """The commands in order; every file one reads, an earlier one wrote. ``split`` is the
    corpus's train,valid document counts (make_corpus.py prints and writes it)."""
    d = s.out
    data = d / "data" / "corpus_text_document"
    project = d / "retro-project"
    shared = model_flags(s, split)
    corpus_flags = [
        *("--valid-documents", s.valid_documents, "--train-duplicates", s.train_duplicates),
        *("--change", s.change, "--seed", s.seed),
    ]
    if s.max_passages:
        corpus_flags += ["--max-passages", s.max_passages]
    # fmt: off
    return [
        Step("data", script(HERE / "make_corpus.py", "--output", d / "corpus.jsonl",
                            *corpus_flags)),
        Step("data", script(ROOT / "workflows/demo/train_tokenizer.py", "--input",
                            d / "corpus.jsonl", "--vocab-size", 4096,
                            "--output-dir", d / "tokenizer")),
        Step("data", tool("mg-prep", "tokenize", "--input", d / "corpus.jsonl",
                          "--output-prefix", d / "data" / "corpus", *tokenizer_flags(s, ""),
                          "--append-eod", "--workers", 1)),
        Step("retrieval", script(HERE / "import_bert.py", "--save", d / "bert",
                                 "--num-layers", s.bert_layers)),
        Step("retrieval", tool(
            "mg-prep", "retro", "--retro-project-dir", project, "--retro-tasks", "build",
            "--retro-gpt-data-path", 1, data, "--retro-gpt-split", split,
            "--retro-gpt-seed", s.seed, *tokenizer_flags(s, "retro-gpt-"),
            "--retro-gpt-seq-length", s.seq_length,
            "--retro-gpt-chunk-length", s.chunk_length,
            "--retro-gpt-train-samples", s.train_samples,
            "--retro-gpt-global-batch-size", s.global_batch_size,
            # validation samples queried: 2 x 6 x batch, one pass over the split or less
            "--retro-gpt-eval-interval", s.train_samples // s.global_batch_size,
            "--retro-gpt-eval-iters", 6,
            "--load", d / "bert", "--retro-bert-max-chunk-length", 64,
            "--retro-bert-batch-size", 128, "--retro-block-size", 5000,
            "--retro-index-str", "Flat", "--retro-index-ntrain", s.index_ntrain,
            "--retro-query-num-neighbors-query", 20, "--retro-query-num-neighbors-save", 4,
        )),
        Step("train GPT", tool("mg-train", "gpt", *shared, "--save", d / "gpt"),
             stdout=d / "train_gpt.log"),
        Step("train Retro", tool(
            "mg-train", "retro", *shared, "--save", d / "retro",
            "--retro-add-retriever", "--retro-project-dir", project,
            "--retro-num-neighbors", s.num_neighbors, "--retro-no-verify-neighbor-count",
        ), stdout=d / "train_retro.log"),
        Step("evaluate", script(HERE / "evaluate.py", "--gpt", d / "gpt", "--retro", d / "retro",
                                "--retro-project-dir", project, "--corpus", d / "corpus.jsonl",
                                "--output", d / "eval.json")),
    ]
    # fmt: on


def run(steps: list[Step], timings: dict[str, Timing] | None = None) -> dict[str, Timing]:
    """Each step in turn (a failure stops the run); wall and CPU seconds added by phase."""
    return run_steps(steps, lambda step: run_command(step.argv, step.stdout), timings)


def summary(
    s: Settings, split: str, timings: dict[str, Timing], seconds: float, load: tuple
) -> str:
    d = s.out
    result = json.loads((d / "eval.json").read_text())
    ways = result["ways"]
    losses = {
        name: train_losses((d / f"train_{name}.log").read_text()) for name in ("gpt", "retro")
    }
    n_train, n_valid = (int(v) for v in split.split(",")[:2])
    hits = result["top_neighbour_from_near_duplicate"]
    labels = {
        "gpt": "GPT",
        "retro": "Retro, with its neighbours",
        "retro_no_retrieval": "Retro, retrieval off (no neighbours: end-of-document tokens)",
        "retro_random_neighbours": "Retro, random neighbours from the database",
    }
    lines = [
        "# Retro against the same-size GPT: validation perplexity",
        "",
        f"Validation: {n_valid} documents, {result['tokens']:,} predicted tokens in "
        f"{result['samples']} samples of {s.seq_length}; {result['tokens_near_duplicate']:,} "
        f"of them in the {n_valid // 2} documents with a near-duplicate (a perturbed copy) "
        f"among the {n_train} training documents the database holds, "
        f"{result['tokens_fresh']:,} in the {n_valid - n_valid // 2} without.",
        "",
        "| model | perplexity | near-duplicate documents | the rest |",
        "| --- | ---: | ---: | ---: |",
    ]
    for way, label in labels.items():
        r = ways[way]
        lines.append(
            f"| {label} | {r['ppl']:.2f} | {r['ppl_near_duplicate']:.2f} | {r['ppl_fresh']:.2f} |"
        )
    gpt, retro, off = (ways[w]["ppl"] for w in ("gpt", "retro", "retro_no_retrieval"))
    if retro < gpt:
        verdict = (
            f"Retro beats the GPT: **yes**, {retro:.2f} against {gpt:.2f} "
            f"({100 * (1 - retro / gpt):.1f}% lower). With retrieval off the same Retro "
            f"checkpoint scores {off:.2f}: "
            + ("the gain is gone." if off >= gpt else "still below the GPT.")
        )
    else:
        verdict = (
            f"Retro beats the GPT: **NO**, {retro:.2f} against {gpt:.2f}; with retrieval "
            f"off {off:.2f}."
        )
    lines += [
        "",
        verdict,
        "",
        "| | |",
        "| --- | --- |",
        f"| models | {s.num_layers} layers, hidden {s.hidden_size}, 4 heads, seq {s.seq_length},"
        f" vocabulary 4,096; GPT {result['params']['gpt']:,} parameters, Retro "
        f"{result['params']['retro']:,} (+ neighbour encoder, 2 layers, and chunked "
        f"cross-attention in layer 6) |",
        f"| training | both: {s.train_iters} iterations of {s.global_batch_size} x "
        f"{s.seq_length} tokens, lr 3e-3 cosine, seed {s.seed}, fp32 on the CPU; lm loss "
        + ", ".join(f"{n} {v[0]:.2f} → {v[-1]:.2f}" if v else f"{n} –" for n, v in losses.items())
        + " |",
        f"| retrieval | chunks of {s.chunk_length} tokens, embedded by MiniLM-L6's first"
        f" {s.bert_layers} layers, Faiss Flat,"
        f" {s.num_neighbors} neighbours of 2 x {s.chunk_length} tokens per chunk; the "
        "validation chunks of near-duplicate documents whose first neighbour is from the "
        "copy: " + (f"{hits:.0%}" if hits is not None else "–") + " |",
        f"| corpus | {n_train} training documents ({s.train_duplicates:.0%} of the passages"
        f" with a perturbed copy: {s.change:.0%} of the words replaced, two sentences"
        f" swapped), {n_valid} validation documents |",
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
    parser.add_argument("--num-layers", type=int, default=Settings.num_layers)
    parser.add_argument("--hidden-size", type=int, default=Settings.hidden_size)
    parser.add_argument("--seq-length", type=int, default=Settings.seq_length)
    parser.add_argument("--chunk-length", type=int, default=Settings.chunk_length)
    parser.add_argument("--num-neighbors", type=int, default=Settings.num_neighbors)
    parser.add_argument("--global-batch-size", type=int, default=Settings.global_batch_size)
    parser.add_argument(
        "--max-passages", type=int, default=Settings.max_passages, help="0: every passage"
    )
    parser.add_argument("--valid-documents", type=int, default=Settings.valid_documents)
    parser.add_argument(
        "--train-duplicates",
        type=float,
        default=Settings.train_duplicates,
        help="share of the training passages with a perturbed copy",
    )
    parser.add_argument(
        "--change", type=float, default=Settings.change, help="share of a copy's words replaced"
    )
    parser.add_argument("--index-ntrain", type=int, default=Settings.index_ntrain)
    parser.add_argument(
        "--bert-layers", type=int, default=Settings.bert_layers, help="of MiniLM-L6's 6"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    s = Settings(
        args.output_dir.resolve(),
        train_iters=args.train_iters,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        seq_length=args.seq_length,
        chunk_length=args.chunk_length,
        num_neighbors=args.num_neighbors,
        global_batch_size=args.global_batch_size,
        max_passages=args.max_passages or None,
        valid_documents=args.valid_documents,
        bert_layers=args.bert_layers,
        index_ntrain=args.index_ntrain,
        train_duplicates=args.train_duplicates,
        change=args.change,
    )
    if args.dry_run:
        for step in plan(s, "<train>,<valid>,0"):
            print(shlex.join(step.argv))
        return
    start, load = time.monotonic(), os.getloadavg()
    for stale in ("gpt", "retro", "retro-project", "cache", "data"):  # a fresh run each time
        shutil.rmtree(s.out / stale, ignore_errors=True)
    (s.out / "data").mkdir(parents=True, exist_ok=True)
    first, *rest = plan(s, "0,0,0")
    timings = run([first])  # the corpus: its split is known from here on
    split = (s.out / "corpus.split").read_text().strip()
    run(plan(s, split)[1:], timings)
    text = summary(s, split, timings, time.monotonic() - start, load)
    (s.out / "summary.md").write_text(text)
    print(text)
    ways = json.loads((s.out / "eval.json").read_text())["ways"]
    if not ways["retro"]["ppl"] < ways["gpt"]["ppl"]:
        sys.exit("Retro does not beat the GPT on validation perplexity (summary.md)")


if __name__ == "__main__":
    main()
