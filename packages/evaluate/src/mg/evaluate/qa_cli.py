"""`mg-eval qa`: zero-shot short-answer QA, exact match and token F1, for a GPT or a Retro
checkpoint (Megatron's InstructRetro evaluation: tools/retro/text_generation).

A Retro checkpoint retrieves at generation time from ``--retro-project-dir`` (default:
the project it was trained on, from its args); a GPT checkpoint answers from the
prompt alone. Single process, one question at a time.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from mg.core.cli_types import ckpt_step
from mg.core.retro.flags import add_retrieval_flags
from mg.evaluate.errors import EvalInputError

_TOKENIZER = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def add_qa_task(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "qa",
        help="zero-shot short-answer QA: exact match and token F1 (GPT or Retro)",
        description='Greedy answers to the questions of a JSON-lines file ({"question", '
        '"answers": [...], optional "context"}), scored by exact match and token F1 after '
        "SQuAD's normalisation (lowercase, no punctuation, no articles). A Retro checkpoint "
        "retrieves its chunks' neighbours from the project's index as it generates.",
    )
    g = p.add_argument_group("checkpoint")
    g.add_argument("--load", required=True, metavar="DIR", help="a GPT or Retro checkpoint")
    g.add_argument("--ckpt-step", type=ckpt_step, default=None, metavar="N")
    d = p.add_argument_group("data and outputs")
    d.add_argument("--valid-data", required=True, metavar="FILE.jsonl", help="the questions")
    d.add_argument(
        "--max-new-tokens", type=int, default=32, help="tokens generated per answer (32)"
    )
    d.add_argument("--output-path", metavar="FILE.jsonl", help="each question's prediction")
    d.add_argument("--report", metavar="FILE.jsonl", help="append the results as a JSON line")
    add_retrieval_flags(p.add_argument_group("retrieval", "Retro checkpoints (Megatron's names)"))
    t = p.add_argument_group("tokenizer", "override what the checkpoint records")
    t.add_argument("--tokenizer-type")
    t.add_argument("--vocab-file")
    t.add_argument("--merge-file")
    t.add_argument("--tokenizer-model")
    p.set_defaults(run=run_qa, print_result=result_line)


def run_qa(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    from mg.core.retro.checkpoint import is_retro_config, recorded_model_config
    from mg.evaluate.qa import evaluate_qa, gpt_greedy, read_records

    if args.max_new_tokens < 1:
        raise EvalInputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    records = read_records(args.valid_data)
    overrides = {name: getattr(args, name) for name in _TOKENIZER}
    context: dict[str, Any] = {"valid_data": args.valid_data, "max_new_tokens": args.max_new_tokens}
    if is_retro_config(recorded_model_config(args.load, args.ckpt_step)):
        generate, tokenizer, limit, iteration, project = _retro(args, overrides)
        context["retro_project_dir"] = project
    else:
        # lazy: torch and the model code only once the flags are parsed
        from mg.evaluate.model_loading import load_for_eval

        if args.retro_project_dir or args.retro_num_neighbors:
            raise EvalInputError(
                "--retro-project-dir / --retro-num-neighbors: the checkpoint is not a Retro model"
            )
        loaded = load_for_eval(args.load, args.ckpt_step, overrides)
        config = loaded.config
        limit = config.seq_length
        if config.position_embedding_type == "learned_absolute":
            limit = config.max_position_embeddings
        generate, tokenizer, iteration = (
            gpt_greedy(loaded.model, limit),
            loaded.tokenizer,
            loaded.iteration,
        )
    metrics, rows = evaluate_qa(records, tokenizer, generate, limit, args.max_new_tokens)
    if args.output_path:
        tmp = f"{args.output_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
        os.replace(tmp, args.output_path)
    return metrics, dict(context, iteration=iteration)


def _retro(args: argparse.Namespace, overrides: dict[str, Any]):
    # lazy: the Retro model code and Faiss only for a Retro checkpoint
    from mg.core.retro.generation import longest_sequence, retro_greedy_generate
    from mg.evaluate.retro_loading import load_retro, retriever_for

    loaded = load_retro(args.load, args.ckpt_step, overrides, args.retro_num_neighbors)
    retriever = retriever_for(loaded, args.retro_project_dir)

    def generate(prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
        return retro_greedy_generate(loaded.model, retriever, prompt, max_new, stops)

    limit = longest_sequence(loaded.model, retriever.chunk_length)
    project = args.retro_project_dir or loaded.args.get("retro_project_dir")
    return generate, loaded.tokenizer, limit, loaded.iteration, project


def result_line(task: str, metrics: dict[str, Any]) -> str:
    text = (
        f" validation results on QA | exact match: {metrics['exact_match']:.4f} | "
        f"f1: {metrics['f1']:.4f} | total examples: {metrics['num_examples']} |"
    )
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"
