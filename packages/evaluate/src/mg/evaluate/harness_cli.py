"""`mg-eval harness`: lm-evaluation-harness tasks on an mg GPT checkpoint.

Calls ``lm_eval.simple_evaluate`` with the ``mg`` model of
:mod:`mg.evaluate.lm_eval_adapter`; ``--include-path`` adds a folder of task
YAML files (local data, no network needed).
"""

from __future__ import annotations

import argparse
from typing import Any

from mg.core.cli_types import ckpt_step
from mg.evaluate.errors import EvalInputError
from mg.evaluate.progress import library_bars_on_terminal_only


def add_harness_task(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "harness",
        help="lm-evaluation-harness tasks (lm_eval.simple_evaluate with the mg model)",
        description="Run lm-evaluation-harness tasks on an mg GPT checkpoint. Equivalent to "
        "`python -m mg.evaluate.lm_eval_adapter run --model mg --model_args load=DIR --tasks ...`.",
    )
    p.add_argument("--load", required=True, metavar="DIR", help="GPT checkpoint folder")
    p.add_argument(
        "--ckpt-step", type=ckpt_step, default=None, metavar="N", help="iteration to load"
    )
    p.add_argument(
        "--tasks", required=True, nargs="+", help="task names (lm_eval ls tasks), or comma lists"
    )
    p.add_argument("--include-path", metavar="DIR", help="folder of extra task YAML files")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument(
        "--limit", type=float, default=None, help="examples per task (a fraction if < 1)"
    )
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument(
        "--seq-length", type=int, default=None, help="context length; default: the checkpoint's"
    )
    p.add_argument("--max-gen-toks", type=int, default=256, help="generate_until token limit")
    p.add_argument("--seed", type=int, default=1234, help="seed of few-shot sampling")
    p.add_argument("--report", metavar="FILE.jsonl", help="append the results as a JSON line")
    for flag in ("--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-model"):
        p.add_argument(flag, help="override the checkpoint's tokenizer")
    p.add_argument(
        "--attention-backend",
        choices=("flash", "fused", "unfused", "local", "auto"),
        default="auto",
        help="attention kernel (Megatron's names; flash and fused need CUDA)",
    )
    p.add_argument("--use-flash-attn", action="store_true", help="--attention-backend flash")
    p.set_defaults(run=run_harness, print_result=_table)


def _table(task: str, metrics: dict[str, Any]) -> str:
    lines = [f"{'task':<28} {'metric':<24} {'value':>12} {'stderr':>10}"]
    for name, values in sorted(metrics["results"].items()):
        for key, value in sorted(values.items()):
            if key == "alias" or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            stderr = values.get(f"{metric}_stderr,{filt}")
            err = f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "N/A"
            lines.append(f"{name:<28} {metric:<24} {value:>12.6f} {err:>10}")
    return "\n".join(lines)


def run_harness(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    # lazy: lm-eval is an optional dependency, and torch waits until the flags are parsed
    import lm_eval
    from lm_eval.tasks import TaskManager

    # lazy, as lm-eval: the adapter imports it, and both import torch
    from mg.evaluate.attention_flags import attention_backend_of
    from mg.evaluate.lm_eval_adapter import MgLM

    backend = attention_backend_of(args)
    if args.micro_batch_size < 1 or args.max_gen_toks < 1:
        raise EvalInputError("--micro-batch-size and --max-gen-toks must be >= 1")
    tasks = [t for item in args.tasks for t in item.split(",") if t]
    manager = TaskManager(include_path=args.include_path) if args.include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" (with --include-path {args.include_path})" if args.include_path else ""
        raise EvalInputError(
            f"unknown lm-eval task(s) {', '.join(unknown)}{where}; list them with "
            "`python -m lm_eval ls tasks`"
        )
    model = MgLM(
        load=args.load,
        ckpt_step=args.ckpt_step,
        batch_size=args.micro_batch_size,
        max_length=args.seq_length,
        max_gen_toks=args.max_gen_toks,
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        attention_backend=backend,
    )
    with library_bars_on_terminal_only():
        out = lm_eval.simple_evaluate(
            model=model,
            tasks=tasks,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            task_manager=manager,
            log_samples=False,
            random_seed=args.seed,
            numpy_random_seed=args.seed,
            torch_random_seed=args.seed,
            fewshot_random_seed=args.seed,
        )
    metrics = {"results": out["results"], "n-samples": out.get("n-samples", {})}
    context = dict(tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit)
    return metrics, context
