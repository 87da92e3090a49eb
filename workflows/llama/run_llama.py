"""Llama-2 inference and finetuning (Megatron-LM's README section), with mg's tools.

    just llama SRC CHATS [--output-dir OUT] [--ask QUESTION ...] [mg-train flags ...]

1. `mg-convert import-hf` (a Hugging Face folder: config.json + safetensors) or
   `mg-convert import-gguf` (a llama.cpp .gguf file) of any Llama-family model:
   Llama 2/3, Mistral, Qwen2/3, SmolLM2, ... -> OUT/imported, its tokenizer and chat
   template in OUT/imported/tokenizer
2. `mg-prep sft`: CHATS (conversations, JSON lines: {"messages": [{"role", "content"}]})
   with that tokenizer's chat template -> OUT/data/chats
3. `mg-train gpt --sft`: supervised finetuning from the imported weights, the model and
   tokenizer taken from the checkpoint (`--use-checkpoint-args`) -> OUT/finetuned;
   flags given after the others replace the defaults (`--train-iters 200 --lr 2e-5`)
4. `mg-serve` of the finetuned checkpoint: with `--ask`, each question answered
   (greedy, through the chat template) and the server stopped; without, it serves on
   `--port` until Ctrl-C

`--dry-run` prints the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "bin"
sys.path.insert(0, str(ROOT / "workflows"))
from serving import Server, chat  # noqa: E402 (workflows/serving.py)

# short on purpose: a recipe's first run should end; pass more iterations for real work
TRAIN_DEFAULTS = [
    "--split", "90,10,0", "--seq-length", "512", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--train-iters", "50", "--lr", "1e-5", "--min-lr", "1e-6",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--log-interval", "1",
    "--eval-interval", "50", "--eval-iters", "4",
]  # fmt: skip


def import_command(src: Path, save: Path) -> list[str]:
    """import-gguf for a .gguf file, import-hf for a folder with config.json."""
    if src.suffix == ".gguf":
        return [str(BIN / "mg-convert"), "import-gguf", str(src), "--save", str(save)]
    return [str(BIN / "mg-convert"), "import-hf", str(src), "--save", str(save)]


def plan(src: Path, chats: Path, out: Path, train_flags: list[str]) -> list[list[str]]:
    imported, finetuned, data = out / "imported", out / "finetuned", out / "data" / "chats"
    return [
        [*import_command(src, imported), "--overwrite"],
        [str(BIN / "mg-prep"), "sft", "--input", str(chats), "--output-prefix", str(data),
         "--tokenizer-model", str(imported / "tokenizer")],
        [str(BIN / "mg-train"), "gpt", "--sft", "--load", str(imported), "--finetune",
         "--use-checkpoint-args", "--data-path", f"{data}_text_document",
         "--sft-tokenizer-prompt-format", "chat_template", *TRAIN_DEFAULTS, *train_flags,
         "--save", str(finetuned), "--no-save-optim", "--no-save-rng"],
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path, help="a Hugging Face model folder or a .gguf file")
    parser.add_argument("chats", type=Path, help="conversations to finetune on, JSON lines")
    parser.add_argument("--output-dir", dest="out", type=Path, default=Path("llama-output"))
    parser.add_argument("--ask", nargs="+", metavar="QUESTION", help="ask, then stop serving")
    parser.add_argument("--port", type=int, default=5000, help="without --ask (default 5000)")
    parser.add_argument("--max-tokens", type=int, default=64, help="of each answer to --ask")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args, train_flags = parser.parse_known_args()
    for path, what in ((args.src, "SRC"), (args.chats, "CHATS")):
        if not args.dry_run and not path.exists():
            parser.exit(2, f"{what} {path}: not found\n")
    is_hf = (args.src / "config.json").is_file()
    if not args.dry_run and args.src.suffix != ".gguf" and not is_hf:
        parser.exit(2, f"SRC {args.src}: neither a .gguf file nor a folder with config.json\n")
    serve = [str(BIN / "mg-serve"), "--load", str(args.out / "finetuned")]
    steps = plan(args.src, args.chats, args.out, train_flags)
    if args.dry_run:
        for argv in [*steps, [*serve, "--port", str(args.port)]]:
            print(shlex.join(argv))
        return
    (args.out / "data").mkdir(parents=True, exist_ok=True)
    for number, argv in enumerate(steps, 1):
        print(f"== {number}. {shlex.join(argv)}", flush=True)
        if subprocess.run(argv).returncode != 0:
            sys.exit(f"failed: {shlex.join(argv)}")
    if not args.ask:
        print(f"== 4. {shlex.join([*serve, '--port', str(args.port)])}", flush=True)
        os.execv(serve[0], [*serve, "--port", str(args.port)])
    print(f"== 4. {shlex.join([*serve, '--port', '0'])}: the questions", flush=True)
    with Server([*serve, "--port", "0"], log=args.out / "serve.log") as url:
        for question in args.ask:
            print(f"Q: {question}\nA: {chat(url, question, args.max_tokens)}\n", flush=True)


if __name__ == "__main__":
    main()
