"""Detoxify a model by self-generation (Megatron-LM's `examples/detxoify_lm`), with mg's tools.

    just detoxify [--load CKPT] [--scorer SPEC] [--output-dir OUT] [mg-train flags ...]

1. `mg-serve` of CKPT: continuations of prompts taken from a text corpus (the first
   words of random lines of `--prompts-from`, JSON lines with "text"), sampled with a
   fixed seed -> OUT/generated_before.jsonl
2. `mg-eval toxicity`: each continuation scored by `--scorer` (default the local word
   list, a stand-in for Perspective API; or command:CMD, or an http(s) URL)
3. the least toxic `--keep` share of the texts (prompt + continuation) -> OUT/kept.jsonl;
   `mg-prep tokenize` with the model's tokenizer
4. `mg-train gpt --finetune`: continued training of CKPT on them -> OUT/detoxified
   (flags after the others replace the defaults)
5. `mg-serve` of the result: the same prompts, the same seed, scored again; the mean
   score before and after -> OUT/summary.md

`--dry-run` prints the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "bin"
sys.path.insert(0, str(ROOT / "workflows"))
from serving import Server, complete  # noqa: E402 (workflows/serving.py)

TRAIN_DEFAULTS = [
    "--split", "100,0,0", "--seq-length", "128", "--micro-batch-size", "4",
    "--global-batch-size", "8", "--train-iters", "30", "--lr", "3e-5", "--min-lr", "3e-6",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "3", "--log-interval", "5",
    "--eval-iters", "0",
]  # fmt: skip


def prompts_from(path: Path, count: int, words: int, seed: int) -> list[str]:
    """The first `words` words of `count` random lines (of at least that many words)."""
    lines = []
    for record in path.read_text(encoding="utf-8").splitlines():
        for line in json.loads(record)["text"].splitlines():
            if len(line.split()) >= words and not line.lstrip().startswith(("[", "{", "|", "=")):
                lines.append(" ".join(line.split()[:words]))
    return random.Random(seed).sample(lines, min(count, len(lines)))


def generate(load: Path, prompts: list[str], args: argparse.Namespace, out: Path) -> None:
    """Sampled continuations, `--samples` per prompt, written as JSON lines."""
    serve = [str(BIN / "mg-serve"), "--load", str(load), "--port", "0", "--request-timeout", "3600"]
    with Server(serve,
                log=out.with_suffix(".log")) as url:  # fmt: skip
        texts = complete(
            url, [p for p in prompts for _ in range(args.samples)], args.max_tokens,
            args.seed, temperature=args.temperature, top_k=args.top_k,
        )  # fmt: skip
    with out.open("w", encoding="utf-8") as file:
        for i, text in enumerate(texts):
            prompt = prompts[i // args.samples]
            file.write(json.dumps({"prompt": prompt, "text": text}) + "\n")


def score(generated: Path, scorer: str, report: Path) -> float:
    scored = generated.with_name(generated.stem + "_scored.jsonl")
    argv = [str(BIN / "mg-eval"), "toxicity", "--input", str(generated), "--scorer", scorer,
            "--output", str(scored), "--report", str(report)]  # fmt: skip
    run(argv)
    return json.loads(report.read_text().splitlines()[-1])["metrics"]["mean"]


def run(argv: list[str]) -> None:
    print(f"== {shlex.join(argv)}", flush=True)
    if subprocess.run(argv).returncode != 0:
        sys.exit(f"failed: {shlex.join(argv)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", type=Path, default=Path("demo-output/smollm2"))
    parser.add_argument("--prompts-from", type=Path, required=True, help='JSON lines, "text"')
    parser.add_argument("--output-dir", type=Path, default=Path("detoxify-output"))
    parser.add_argument("--scorer", default="wordlist", help="see mg-eval toxicity --help")
    parser.add_argument("--prompts", type=int, default=64, help="how many (default 64)")
    parser.add_argument("--prompt-words", type=int, default=6)
    parser.add_argument("--samples", type=int, default=4, help="continuations per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--keep", type=float, default=0.5, help="least toxic share kept")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args, train_flags = parser.parse_known_args()
    if not 0 < args.keep <= 1:
        parser.exit(2, f"--keep {args.keep}: a share in (0, 1]\n")
    out, tokenizer = args.output_dir, args.load / "tokenizer"
    detoxified = out / "detoxified"
    prep = [str(BIN / "mg-prep"), "tokenize", "--input", str(out / "kept.jsonl"),
            "--output-prefix", str(out / "data" / "kept"), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--append-eod",
            "--workers", "1"]  # fmt: skip
    train = [str(BIN / "mg-train"), "gpt", "--load", str(args.load), "--finetune",
             "--use-checkpoint-args", "--data-path", str(out / "data" / "kept_text_document"),
             *TRAIN_DEFAULTS, *train_flags, "--save", str(detoxified), "--no-save-optim",
             "--no-save-rng"]  # fmt: skip
    if args.dry_run:
        print("\n".join(shlex.join(argv) for argv in (prep, train)))
        return
    for path, flag in ((args.load, "--load"), (args.prompts_from, "--prompts-from")):
        if not path.exists():
            parser.exit(2, f"{flag} {path}: not found (`just demo` writes the defaults)\n")
    (out / "data").mkdir(parents=True, exist_ok=True)
    prompts = prompts_from(args.prompts_from, args.prompts, args.prompt_words, args.seed)
    print(f"== generating {args.samples} continuations of {len(prompts)} prompts", flush=True)
    generate(args.load, prompts, args, out / "generated_before.jsonl")
    before = score(out / "generated_before.jsonl", args.scorer, out / "toxicity_before.jsonl")
    scored = [
        json.loads(line)
        for line in (out / "generated_before_scored.jsonl").read_text().splitlines()
    ]
    kept = sorted(scored, key=lambda r: r["toxicity"])[: max(1, round(args.keep * len(scored)))]
    with (out / "kept.jsonl").open("w", encoding="utf-8") as file:
        for record in kept:
            file.write(json.dumps({"text": record["prompt"] + record["text"]}) + "\n")
    kept_mean = sum(r["toxicity"] for r in kept) / len(kept)
    run(prep)
    run(train)
    generate(detoxified, prompts, args, out / "generated_after.jsonl")
    after = score(out / "generated_after.jsonl", args.scorer, out / "toxicity_after.jsonl")
    summary = "\n".join([
        "# Detoxification by self-generation",
        "",
        "| | |",
        "| --- | --- |",
        f"| model | {args.load} → {detoxified} |",
        f"| scorer | {args.scorer} |",
        f"| generated | {len(scored)} continuations ({args.samples} each of {len(prompts)} "
        f"prompts, {args.max_tokens} tokens, temperature {args.temperature:g}, top-k "
        f"{args.top_k}, seed {args.seed}) |",
        f"| kept | the {len(kept)} least toxic (mean score {kept_mean:.5f}) |",
        f"| mean toxicity, before | {before:.5f} |",
        f"| mean toxicity, after | {after:.5f} ({(after - before) / before:+.0%}) |"
        if before > 0 else f"| mean toxicity, after | {after:.5f} |",
    ]) + "\n"  # fmt: skip
    (out / "summary.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
