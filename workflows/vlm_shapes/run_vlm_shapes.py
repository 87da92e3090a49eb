"""`just vlm-shapes`: a small vision-language model learns to name coloured shapes, on the CPU.

    python workflows/vlm_shapes/run_vlm_shapes.py --output-dir vlm-shapes-output \
        [--quick] [--target 0.9] [--dry-run]

1. data: `make_shapes.py` draws the training pictures and the held-out ones (another
   seed, every (colour, shape) pair equally often), each captioned "A red circle.";
   `train_tokenizer.py` (the demo's) trains a byte-level BPE on the captions
2. `mg-prep vlm`: the training pictures and captions to energon WebDataset shards;
   `mg-prep tokenize`: the same captions, without pictures, as a GPT dataset
3. `mg-train vlm`: a small LLaVA (ViT + MLP projector + language model), every part
   trained from scratch, on the pictures
4. `mg-train gpt`: a text-only model of the same language-model shape on the captions
5. `mg-serve` of each: every held-out picture asked "What is in the image?" (Megatron's
   PUT /api, the picture in `images`; greedy), the text-only model the same question
   without it. An answer is right when it names the picture's colour and shape and no
   other colour or shape.
6. `summary.md`: both accuracies against chance (1 / pairs), the training times, the
   machine. The run fails (exit 1) when the VLM's accuracy is below --target.

`--quick` runs the same steps at smoke-test sizes (a few iterations, no target).
`--dry-run` prints the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "workflows"))
sys.path.insert(0, str(HERE))
from make_shapes import COLORS, IMAGE_TAG, QUESTION, SHAPES  # noqa: E402 (beside this file)
from serving import Server  # noqa: E402 (workflows/serving.py)
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

VLM_PROMPT = f"{IMAGE_TAG}\n{QUESTION}\n"  # as mg-train vlm's raw format renders the turn
TEXT_PROMPT = f"{QUESTION}\n"  # the same question, no picture


@dataclass
class Settings:
    """Sizes of one run; `quick()` is the smoke test's."""

    out: Path
    train_images: int = 4000
    heldout_images: int = 200  # 10 of each of the 20 pairs
    image_size: int = 32
    patch_dim: int = 4  # 8 x 8 patches: shapes need the finer grid (8-pixel patches: ~50%)
    vocab_size: int = 320
    layers: int = 2
    hidden_size: int = 64
    heads: int = 4
    vision_layers: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 4
    batch_size: int = 32
    vlm_iters: int = 1000
    text_iters: int = 200
    lr: float = 1.5e-3
    max_tokens: int = 6
    target: float = 0.9
    serve_batch: int = 25
    extra_train: list[str] = field(default_factory=list)

    @classmethod
    def quick(cls, out: Path) -> Settings:
        return cls(
            out, train_images=40, heldout_images=20, vlm_iters=3, text_iters=3,
            batch_size=4, hidden_size=32, vision_hidden_size=32, layers=1, vision_layers=1,
            target=0.0,
        )  # fmt: skip

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_dim) ** 2 + 1  # CLIP's class token kept

    @property
    def decoder_length(self) -> int:
        # the picture's rows, the question (~8 tokens) and the caption (~5): room to spare
        return self.image_tokens + 15


@dataclass
class Step:
    """One command; `log` keeps its output, `ask` serves the checkpoint and asks it."""

    phase: str
    argv: list[str]
    log: Path | None = None
    ask: str | None = None  # "vlm" (with the pictures) or "text" (without)


def plan(s: Settings) -> list[Step]:
    """The workflow's commands in order; every file one reads, an earlier one wrote."""
    d = s.out
    shapes, tok = d / "shapes", d / "tokenizer"
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tok / "vocab.json",
                 "--merge-file", tok / "merges.txt"]  # fmt: skip
    language = [
        "--num-layers", s.layers, "--hidden-size", s.hidden_size,
        "--num-attention-heads", s.heads, "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--attention-dropout", 0, "--hidden-dropout", 0,
    ]  # fmt: skip
    schedule = [
        "--micro-batch-size", s.batch_size, "--global-batch-size", s.batch_size,
        "--lr", f"{s.lr:g}", "--min-lr", f"{s.lr / 10:g}", "--lr-decay-style", "cosine",
        "--eval-iters", 0, "--seed", 1234, "--no-save-optim", "--no-save-rng",
    ]  # fmt: skip
    serve = ["--port", 0, "--request-timeout", 3600]

    def log_interval(iters: int) -> list[str | int]:
        return ["--log-interval", max(1, iters // 20), "--lr-warmup-iters", min(20, iters // 4)]

    # fmt: off
    return [
        Step("data", script(HERE / "make_shapes.py", "--output-dir", shapes, "--split", "train",
                            "--count", s.train_images, "--seed", 1, "--size", s.image_size)),
        Step("data", script(HERE / "make_shapes.py", "--output-dir", shapes, "--split",
                            "heldout", "--count", s.heldout_images, "--seed", 2,
                            "--size", s.image_size)),
        Step("data", script(ROOT / "workflows" / "demo" / "train_tokenizer.py",
                            "--input", shapes / "train" / "text.jsonl",
                            "--vocab-size", s.vocab_size, "--output-dir", tok)),
        Step("data", tool("mg-prep", "vlm", "--input", shapes / "train" / "data.jsonl",
                          "--output", d / "data" / "shapes", "--shard-size", 1000)),
        Step("data", tool("mg-prep", "tokenize", "--input", shapes / "train" / "text.jsonl",
                          "--output-prefix", d / "data" / "captions", *tokenizer,
                          "--append-eod", "--workers", 1, "--no-progress-bar")),
        Step(
            "train VLM",
            tool(
                "mg-train", "vlm", *language, *tokenizer, "--data-path", d / "data" / "shapes",
                "--img-h", s.image_size, "--img-w", s.image_size, "--patch-dim", s.patch_dim,
                "--vision-num-layers", s.vision_layers,
                "--vision-hidden-size", s.vision_hidden_size,
                "--vision-num-attention-heads", s.vision_heads,
                "--vision-ffn-hidden-size", 2 * s.vision_hidden_size,
                "--seq-length", s.image_tokens, "--decoder-seq-length", s.decoder_length,
                "--max-position-embeddings", s.decoder_length,
                *schedule, "--train-iters", s.vlm_iters, *log_interval(s.vlm_iters),
                "--save", d / "vlm", *s.extra_train,
            ),
            log=d / "train_vlm.log",
        ),
        Step(
            "train text-only",
            tool(
                "mg-train", "gpt", *language, *tokenizer,
                "--data-path", d / "data" / "captions_text_document", "--split", "100,0,0",
                "--seq-length", 16, "--max-position-embeddings", 16,
                *schedule, "--train-iters", s.text_iters, *log_interval(s.text_iters),
                "--save", d / "text-only",
            ),
            log=d / "train_text.log",
        ),
        Step("serve", tool("mg-serve", "--load", d / "vlm", *serve), ask="vlm"),
        Step("serve", tool("mg-serve", "--load", d / "text-only", *serve), ask="text"),
    ]
    # fmt: on


def put(url: str, body: dict) -> dict:
    """Megatron's PUT /api."""
    request = urllib.request.Request(
        f"{url}/api",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="PUT",
    )
    with urllib.request.urlopen(request, timeout=3600) as response:  # a busy machine is slow
        return json.load(response)


def heldout(s: Settings) -> list[dict]:
    folder = s.out / "shapes" / "heldout"
    return [json.loads(line) for line in (folder / "data.jsonl").read_text().splitlines()]


def named(answer: str, words) -> set[str]:
    return {w for w in words if re.search(rf"\b{w}\b", answer.lower())}


def is_right(answer: str, color: str, shape: str) -> bool:
    """The answer names the picture's colour and shape, and no other colour or shape."""
    return named(answer, COLORS) == {color} and named(answer, SHAPES) == {shape}


def ask(url: str, s: Settings, with_images: bool) -> list[dict]:
    """Every held-out picture's question, greedy, `serve_batch` prompts a request."""
    records, folder = heldout(s), s.out / "shapes" / "heldout"
    prompt = VLM_PROMPT if with_images else TEXT_PROMPT
    answers = []
    for start in range(0, len(records), s.serve_batch):
        batch = records[start : start + s.serve_batch]
        body = {"prompts": [prompt] * len(batch), "tokens_to_generate": s.max_tokens, "top_k": 1}
        if with_images:
            body["images"] = [
                base64.b64encode((folder / r["image"]).read_bytes()).decode() for r in batch
            ]
        texts = put(url, body)["text"]
        for record, text in zip(batch, texts, strict=True):
            answer = text.split(QUESTION, 1)[-1].replace("<|endoftext|>", "").strip()
            right = is_right(answer, record["color"], record["shape"])
            labels = {k: record[k] for k in ("image", "color", "shape")}
            answers.append({**labels, "answer": answer, "right": right})
        done = sum(a["right"] for a in answers)
        print(f"   {len(answers)}/{len(records)} asked, {done} right", flush=True)
    return answers


def run_step(step: Step, s: Settings) -> None:
    if step.ask is not None:
        log = s.out / f"serve_{step.ask}.log"
        with Server(step.argv, log=log) as url:
            answers = ask(url, s, with_images=step.ask == "vlm")
        path = s.out / f"answers_{step.ask}.jsonl"
        path.write_text("".join(json.dumps(a) + "\n" for a in answers))
        for a in answers[:5]:
            print(f"   {a['image']} ({a['color']} {a['shape']}): {a['answer']!r}")
    else:
        run_command(step.argv, step.log)


def run(steps: list[Step], s: Settings) -> dict[str, Timing]:
    return run_steps(steps, lambda step: run_step(step, s))


def last_loss(log: Path) -> str:
    losses = train_losses(log.read_text(errors="replace"))
    return f"{losses[-1]:.3f}" if losses else "–"


def answers(s: Settings, which: str) -> list[dict]:
    lines = (s.out / f"answers_{which}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def accuracy(s: Settings, which: str) -> tuple[int, int]:
    given = answers(s, which)
    return sum(a["right"] for a in given), len(given)


def summary(s: Settings, timings: dict[str, Timing], seconds: float, load: tuple) -> str:
    pairs = len(COLORS) * len(SHAPES)
    (vlm, n), (text, _) = accuracy(s, "vlm"), accuracy(s, "text")
    t = timings
    lines = [
        "# A small VLM names coloured shapes",
        "",
        f"{s.heldout_images} held-out pictures ({len(COLORS)} colours x {len(SHAPES)} shapes,"
        f' each pair {s.heldout_images // pairs} times), asked "{QUESTION}";'
        " right = the answer names the picture's colour and shape, and no other.",
        "",
        "| model | held-out accuracy |",
        "| --- | ---: |",
        f"| VLM (`mg-train vlm`, the picture given) | **{vlm / n:.1%}** ({vlm}/{n}) |",
        f"| text-only (`mg-train gpt`, the same question) | {text / n:.1%} ({text}/{n}) |",
        f"| chance (1 / {pairs} pairs) | {1 / pairs:.1%} |",
        "",
        "| | |",
        "| --- | --- |",
        f"| VLM | ViT {s.vision_layers} layers x {s.vision_hidden_size} on {s.image_size}x"
        f"{s.image_size} pictures in {s.patch_dim}-pixel patches ({s.image_tokens} image"
        f" tokens), MLP projector, language model {s.layers} layers x {s.hidden_size},"
        f" {s.vocab_size}-token BPE; all trained from scratch |",
        f"| VLM training | {s.vlm_iters} iterations of {s.batch_size} pictures"
        f" ({s.train_images} in the training set), lr {s.lr:g} cosine;"
        f" {t['train VLM'].wall:.0f} s wall, {t['train VLM'].cpu:.0f} s CPU;"
        f" final loss {last_loss(s.out / 'train_vlm.log')} |",
        f"| text-only training | {s.text_iters} iterations; {t['train text-only'].wall:.0f} s"
        f" wall; final loss {last_loss(s.out / 'train_text.log')} |",
        f"| command | `{shlex.join([Path(sys.executable).name, *sys.argv])}` |",
        f"| machine | {machine()} |",
        f"| wall time | {seconds:.0f} s in all, load average {load[0]:.1f} at the start,"
        f" {os.getloadavg()[0]:.1f} at the end |",
        f"| target | {f'VLM accuracy >= {s.target:.0%}' if s.target else 'none (--quick)'} |",
        "",
        *phase_table(timings),
    ]
    lines += ["", "## First answers", "", "| picture | VLM | text-only |", "| --- | --- | --- |"]
    both = zip(answers(s, "vlm"), answers(s, "text"), strict=True)
    for a, b in list(both)[:8]:
        lines.append(f"| {a['color']} {a['shape']} | {a['answer']} | {b['answer']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=Path("vlm-shapes-output"))
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes, no target")
    parser.add_argument("--train-iters", type=int, help="of the VLM (default 1000)")
    parser.add_argument("--target", type=float, help="VLM accuracy to reach (default 0.9)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args, extra = parser.parse_known_args()
    s = Settings.quick(args.output_dir) if args.quick else Settings(args.output_dir)
    s.extra_train = extra  # more mg-train vlm flags, after the workflow's own
    if args.train_iters is not None:
        s.vlm_iters = args.train_iters
    if args.target is not None:
        s.target = args.target
    steps = plan(s)
    if args.dry_run:
        for step in steps:
            print(shlex.join(step.argv))
        return
    start, load = time.monotonic(), os.getloadavg()
    for stale in ("shapes", "tokenizer", "data", "vlm", "text-only"):  # mg-prep wants new
        shutil.rmtree(s.out / stale, ignore_errors=True)
    s.out.mkdir(parents=True, exist_ok=True)
    timings = run(steps, s)
    text = summary(s, timings, time.monotonic() - start, load)
    (s.out / "summary.md").write_text(text)
    print(text)
    vlm, n = accuracy(s, "vlm")
    if vlm / n < s.target:
        sys.exit(f"the VLM named {vlm}/{n} = {vlm / n:.1%} right, below the target {s.target:.0%}")


if __name__ == "__main__":
    main()
