"""`mg-eval captioning` and `mg-eval vqa`: the flags, and the summary table they print.

Megatron's multimodal evaluation names (examples/multimodal/run_text_generation.py):
--out-seq-length (most tokens generated), --output-path (one JSON line per sample),
--input-image-path (the image folder). The data is a JSON-lines file of LLaVA records
(--valid-data; `mg.evaluate.vlm_samples`).
"""

from __future__ import annotations

import argparse
from typing import Any

from mg.core.cli_types import ckpt_step
from mg.core.io_paths import output_clash
from mg.evaluate.errors import EvalInputError

_TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def _flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("checkpoint")
    g.add_argument("--load", required=True, metavar="DIR", help="an mg-train vlm checkpoint")
    g.add_argument(
        "--ckpt-step",
        type=ckpt_step,
        default=None,
        metavar="N",
        help="iteration to load; default: latest_checkpointed_iteration.txt",
    )
    d = p.add_argument_group("data and outputs")
    d.add_argument(
        "--valid-data",
        required=True,
        metavar="FILE.jsonl|DIR",
        help="LLaVA records, or an mg-prep vlm folder (its --eval-split)",
    )
    d.add_argument(
        "--eval-split",
        choices=("train", "val", "test"),
        default="test",
        help="the split of an mg-prep vlm folder (default test)",
    )
    d.add_argument(
        "--input-image-path",
        metavar="DIR",
        help="where the records' image paths start; default: the file's folder",
    )
    d.add_argument("--output-path", metavar="FILE.jsonl", help="each sample's output and score")
    d.add_argument(
        "--out-seq-length",
        type=int,
        default=max_tokens,
        metavar="N",
        help=f"most tokens of an answer (default {max_tokens})",
    )
    d.add_argument("--micro-batch-size", type=int, default=8, help="images per forward pass")
    d.add_argument("--report", metavar="FILE.jsonl", help="append the results as a JSON line")
    t = p.add_argument_group("tokenizer", "override what the checkpoint records")
    t.add_argument("--tokenizer-type")
    t.add_argument("--vocab-file")
    t.add_argument("--merge-file")
    t.add_argument("--tokenizer-model")
    t.add_argument(
        "--tokenizer-prompt-format",
        choices=("raw", "chatml", "mistral"),
        help="how prompts are rendered; default: the training run's",
    )


def add_vlm_tasks(sub: argparse._SubParsersAction) -> None:
    cap = sub.add_parser(
        "captioning",
        help="image captioning: CIDEr-D and BLEU-4 of greedy captions (vision-language models)",
        description="Greedy captions of held-out images (JSON lines of LLaVA records), "
        "scored against their references by CIDEr-D and BLEU-4 as the COCO evaluation "
        "computes them.",
    )
    _flags(cap, 32)
    cap.set_defaults(run=run_vlm_task, print_result=summary_table)
    vqa = sub.add_parser(
        "vqa",
        help="visual question answering accuracy: short answers and multiple choice",
        description="Short answers: the greedy answer, scored by VQA accuracy (the VQA "
        "evaluation's answer normalisation, min(1, matches / 3)). Multiple choice (records "
        'with "choices"): the choice the model gives the highest log-likelihood.',
    )
    _flags(vqa, 10)
    vqa.set_defaults(run=run_vlm_task, print_result=summary_table)


def run_vlm_task(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    from mg.evaluate import distributed
    from mg.evaluate.vlm_loading import load_vlm_for_eval
    from mg.evaluate.vlm_samples import read_records
    from mg.evaluate.vlm_tasks import evaluate_captioning, evaluate_vqa

    if args.out_seq_length < 1 or args.micro_batch_size < 1:
        raise EvalInputError("--out-seq-length and --micro-batch-size must be >= 1")
    clash = output_clash(
        [("--output-path", args.output_path)],
        [("--valid-data", args.valid_data), ("--load", args.load)],
    )
    if clash:
        raise EvalInputError(clash)
    records = read_records(args.valid_data, args.task, args.input_image_path, args.eval_split)
    overrides = {name: getattr(args, name) for name in _TOKENIZER_FIELDS}
    vlm = load_vlm_for_eval(args.load, args.ckpt_step, overrides, args.tokenizer_prompt_format)
    evaluate = evaluate_captioning if args.task == "captioning" else evaluate_vqa
    metrics = evaluate(
        vlm,
        records,
        args.micro_batch_size,
        args.out_seq_length,
        args.output_path if distributed.is_main() else None,  # under torchrun: rank 0 writes
    )
    context = dict(
        valid_data=args.valid_data,
        output_path=args.output_path,
        prompt_format=vlm.prompt_format,
        iteration=vlm.iteration,
    )
    return metrics, context


def summary_table(task: str, metrics: dict[str, Any]) -> str:
    """Megatron's COCO print (scores × 100) as a table."""
    if task == "captioning":
        rows = [("CIDEr", metrics["cider"]), ("BLEU-4", metrics["bleu4"])]
    else:
        rows = [("accuracy", metrics["accuracy"])]
        for kind in ("short_answer", "multiple_choice"):
            if metrics[f"{kind}_examples"]:
                rows.append((kind.replace("_", " "), metrics[f"{kind}_accuracy"]))
    width = max(len(name) for name, _ in rows)
    lines = [f"========== {task} scores ({metrics['num_examples']} samples) =========="]
    lines += [f"{name:<{width}}  {value * 100:8.3f}" for name, value in rows]
    return "\n".join(lines)
