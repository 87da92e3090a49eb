"""`mg-eval`: evaluate a checkpoint on WikiText, LAMBADA or an indexed-dataset split,
finetune a BERT on RACE / MNLI / QQP and report its accuracy, or score a
vision-language model's captions and VQA answers (`captioning`, `vqa`).

Every task loads the model and tokenizer the checkpoint records (no model
flags), prints Megatron's result line and, with ``--report``, appends a JSON
line. Under torchrun the examples are shared out over the ranks (data
parallel) and the sums reduced; only rank 0 prints and writes the report. The
GPT tasks also run in a tensor/pipeline-parallel layout
(``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``; see
:mod:`mg.evaluate.model_parallel`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mg.core.cli_types import ckpt_step
from mg.core.io_paths import output_clash
from mg.evaluate.errors import EvalInputError
from mg.evaluate.finetune_cli import add_finetune_tasks
from mg.evaluate.harness_cli import add_harness_task
from mg.evaluate.ict_retrieval import add_ict_retrieval_task
from mg.evaluate.parallel_flags import add_model_parallel_flags
from mg.evaluate.qa_cli import add_qa_task
from mg.evaluate.toxicity_cli import add_toxicity_task
from mg.evaluate.vlm_cli import add_vlm_tasks

if TYPE_CHECKING:  # torch and the model code load only once the flags are parsed
    from mg.core.tokenizers.base import BaseTokenizer
    from mg.evaluate.model_parallel import EvalModel
from mg.evaluate.report import megatron_line, write_report


def _common(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoint")
    g.add_argument(
        "--load",
        required=True,
        metavar="DIR",
        help="checkpoint folder (mg-train --save, mg-convert)",
    )
    g.add_argument(
        "--ckpt-step",
        type=ckpt_step,
        default=None,
        metavar="N",
        help="iteration to load (an int or 'release'); default: latest_checkpointed_iteration.txt",
    )
    g.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens the model sees at once; default: the checkpoint's seq_length",
    )
    g.add_argument(
        "--micro-batch-size", type=int, default=8, help="sequences per forward pass (default 8)"
    )
    g.add_argument(
        "--report", metavar="FILE.jsonl", help="append the results as one JSON line to this file"
    )
    add_model_parallel_flags(parser)
    k = parser.add_argument_group("kernels", "attention kernel (Megatron's flag names)")
    k.add_argument(
        "--attention-backend",
        choices=("flash", "fused", "unfused", "local", "auto"),
        default="auto",
        help="flash, fused (cuDNN/memory-efficient), unfused/local (math), auto (PyTorch "
        "chooses); flash and fused need CUDA. Whatever the checkpoint was trained with.",
    )
    k.add_argument("--use-flash-attn", action="store_true", help="--attention-backend flash")
    t = parser.add_argument_group(
        "tokenizer", "override the tokenizer recorded in the checkpoint (Megatron's flag names)"
    )
    t.add_argument("--tokenizer-type")
    t.add_argument("--vocab-file")
    t.add_argument("--merge-file")
    t.add_argument("--tokenizer-model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mg-eval",
        description="Evaluate an mg checkpoint with Megatron-LM's zero-shot formulas.",
    )
    sub = parser.add_subparsers(dest="task", required=True, metavar="TASK")

    wiki = sub.add_parser(
        "wikitext",
        help="WikiText-103 perplexity (token-level and word-level adjusted)",
        description="Perplexity on a raw WikiText file (wiki.test.tokens): Megatron's detokenizer, "
        "whole-text tokenization, overlapping windows. The adjusted (word-level) perplexity is "
        "exp(avg_loss * token_ratio), token_ratio = (tokens-1)/(words-1).",
    )
    _common(wiki)
    wiki.add_argument("--valid-data", required=True, metavar="FILE", help="raw WikiText file")
    wiki.add_argument(
        "--overlapping-eval",
        type=int,
        default=32,
        metavar="STRIDE",
        help="windows advance by STRIDE tokens; each later window scores only its last STRIDE "
        "targets (default 32; --seq-length gives disjoint windows)",
    )
    wiki.set_defaults(run=_run_wikitext)

    lam = sub.add_parser(
        "lambada",
        help="LAMBADA last-word accuracy",
        description='Accuracy on LAMBADA JSON lines ({"text": ...}): is the greedy prediction '
        "of the last token (or, with --strict-lambada, of every token of the last word) right?",
    )
    _common(lam)
    lam.add_argument("--valid-data", required=True, metavar="FILE.jsonl", help="LAMBADA JSON lines")
    lam.add_argument(
        "--strict-lambada",
        action="store_true",
        help="target = the whole last whitespace word (possibly several tokens), as in the paper",
    )
    lam.set_defaults(run=_run_lambada)

    ppl = sub.add_parser(
        "ppl",
        help="loss and perplexity on an indexed dataset split",
        description="Loss (masked as in training) and perplexity on one split of an indexed "
        "dataset (mg-prep output), built as mg-train builds it.",
    )
    _common(ppl)
    ppl.add_argument(
        "--data-path", required=True, nargs="+", metavar="PREFIX", help="P, or w1 P1 w2 P2 ..."
    )
    ppl.add_argument(
        "--split", default="969,30,1", help="train,valid,test weights (default 969,30,1)"
    )
    ppl.add_argument("--eval-split", choices=("train", "valid", "test"), default="valid")
    ppl.add_argument(
        "--eval-iters",
        type=int,
        default=None,
        help="evaluate this many micro-batches; default: the whole split",
    )
    ppl.add_argument("--seed", type=int, default=1234, help="dataset shuffle seed (as in training)")
    ppl.add_argument("--data-cache-path", default=None, help="where the sample index files go")
    ppl.set_defaults(run=_run_ppl)
    add_finetune_tasks(sub)
    add_harness_task(sub)
    add_toxicity_task(sub)
    add_ict_retrieval_task(sub)
    add_vlm_tasks(sub)
    add_qa_task(sub)
    return parser


@dataclass
class _Prepared:
    """What a GPT task needs: the model as this rank holds it (its shard or stage only:
    the rest of the loaded model is let go), the tokenizer and the sequence length."""

    model: EvalModel
    tokenizer: BaseTokenizer
    iteration: Any
    seq_length: int


def _load(args: argparse.Namespace) -> _Prepared:
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    import torch

    # lazy, as torch: each of these imports it
    from mg.core.models.core_attention import set_attention_backend
    from mg.evaluate import distributed
    from mg.evaluate.attention_flags import attention_backend_of
    from mg.evaluate.model_loading import TOKENIZER_FIELDS, load_for_eval, load_part_for_eval
    from mg.evaluate.model_parallel import EvalModel, build_eval_layout

    # the layout first: a flag that does not fit the world fails before a long load
    layout = build_eval_layout(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        "cuda" if torch.cuda.is_available() else "cpu",
    )
    backend = attention_backend_of(args)
    overrides = {name: getattr(args, name) for name in TOKENIZER_FIELDS}
    if layout.tp * layout.pp > 1:  # read only this rank's shards / stage
        loaded = load_part_for_eval(args.load, layout, args.ckpt_step, overrides)
    else:
        loaded = load_for_eval(args.load, args.ckpt_step, overrides)
    config = loaded.config
    set_attention_backend(loaded.model, backend, config)
    seq_length = args.seq_length or config.seq_length
    if seq_length < 1 or args.micro_batch_size < 1:
        raise EvalInputError("--seq-length and --micro-batch-size must be >= 1")
    if (
        config.position_embedding_type == "learned_absolute"
        and seq_length > config.max_position_embeddings
    ):
        raise EvalInputError(
            f"--seq-length {seq_length} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    model = EvalModel(loaded.model, layout)
    if distributed.rank_and_world()[1] > 1:
        if distributed.is_main():
            print(layout.sizes_line(), flush=True)
        if layout.dp_rank == 0:
            print(model.describe(), flush=True)
    return _Prepared(model, loaded.tokenizer, loaded.iteration, seq_length)


def _run_wikitext(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    from mg.evaluate.wikitext import evaluate_wikitext

    prepared = _load(args)
    result = evaluate_wikitext(
        prepared.model,
        prepared.tokenizer,
        args.valid_data,
        prepared.seq_length,
        args.overlapping_eval,
        args.micro_batch_size,
    )
    context = dict(
        valid_data=args.valid_data,
        seq_length=prepared.seq_length,
        overlapping_eval=args.overlapping_eval,
    )
    return result.metrics(), dict(context, iteration=prepared.iteration)


def _run_lambada(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    from mg.evaluate.lambada import evaluate_lambada

    prepared = _load(args)
    result = evaluate_lambada(
        prepared.model,
        prepared.tokenizer,
        args.valid_data,
        prepared.seq_length,
        args.micro_batch_size,
        args.strict_lambada,
    )
    context = dict(valid_data=args.valid_data, seq_length=prepared.seq_length)
    return result.metrics(), dict(context, iteration=prepared.iteration)


def _run_ppl(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    from mg.evaluate.ppl import evaluate_ppl

    if args.eval_iters is not None and args.eval_iters < 1:
        raise EvalInputError("--eval-iters must be >= 1")
    prepared = _load(args)
    result = evaluate_ppl(
        prepared.model,
        prepared.tokenizer,
        args.data_path,
        prepared.seq_length,
        args.micro_batch_size,
        split=args.split,
        split_name=args.eval_split,
        eval_iters=args.eval_iters,
        seed=args.seed,
        cache_path=args.data_cache_path,
    )
    context = dict(data_path=args.data_path, split=args.split, seq_length=prepared.seq_length)
    return result.metrics(), dict(context, iteration=prepared.iteration)


# what a task reads, by its argparse dest: --report must not be (or sit inside) any of it
_INPUTS = ("load", "pretrained_checkpoint", "valid_data", "train_data", "data_path", "include_path")


def _report_clash(args: argparse.Namespace) -> str | None:
    inputs = []
    for name in _INPUTS:
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        for item in value if isinstance(value, list) else [value]:
            if item is not None and name == "data_path":  # a dataset prefix: its two files
                inputs += [(flag, item + ".bin"), (flag, item + ".idx")]
            else:
                inputs.append((flag, item))
    return output_clash([("--report", getattr(args, "report", None))], inputs)


def user_hint(exc: BaseException, args: argparse.Namespace) -> str:
    """The error text with mg-eval's flag where it says to load another iteration
    (core's messages cannot know which tool they run in)."""
    text = str(exc).rstrip()
    if not hasattr(args, "ckpt_step"):
        return text.replace(", or load another iteration.", ".")
    text = text.replace("pass iteration=N to load one of them", "pick one with --ckpt-step N")
    text = text.replace("or pass an explicit iteration.", "or pass --ckpt-step N.")
    if text.endswith("load another iteration."):
        text = text[:-1] + " (--ckpt-step N)."
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    clash = _report_clash(args)
    if clash:
        print(f"mg-eval {args.task}: error: {clash}", file=sys.stderr)
        return 2
    run: Callable[[argparse.Namespace], tuple[dict[str, Any], dict[str, Any]]] = args.run
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    from mg.core.checkpoint import CheckpointError
    from mg.evaluate import distributed

    distributed.init_from_env()
    try:
        metrics, context = run(args)
    except (EvalInputError, CheckpointError) as exc:
        print(f"mg-eval {args.task}: error: {user_hint(exc, args)}", file=sys.stderr)
        return 2
    if not distributed.is_main():
        return 0
    printer = getattr(args, "print_result", None)
    if printer is not None:
        print(printer(args.task, metrics))
    else:
        print(megatron_line(args.task.upper() if args.task != "ppl" else "ppl", metrics))
    if args.report:
        load = getattr(args, "load", None) or getattr(args, "pretrained_checkpoint", None)
        write_report(args.report, args.task, metrics, load=load, **context)
        print(f"report appended to {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
