"""`mg-eval qa`: zero-shot short-answer QA, exact match and token F1, for a GPT or a Retro
checkpoint (Megatron's InstructRetro evaluation: tools/retro/text_generation).

A Retro checkpoint retrieves at generation time from ``--retro-project-dir`` (default:
the project it was trained on, from its args); a GPT checkpoint answers from the
prompt alone. Single process, one question at a time. A model finetuned on `mg-prep
sft` conversations (`mg-train gpt|retro --sft`) is asked in the prompt format it was
trained on with ``--sft-tokenizer-prompt-format`` (Megatron's flag), as Megatron's
InstructRetro evaluation asks in its SFT template.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from mg.core.chat_format import CHAT_TEMPLATE, FLAG, SUPPORTED_FORMATS
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
    d.add_argument(
        FLAG,
        dest="sft_tokenizer_prompt_format",
        metavar="|".join(SUPPORTED_FORMATS),
        help="ask each question (after its context) as a chat's user turn in this prompt "
        "format, as `mg-prep sft` rendered the finetuning conversations: chatml, or "
        f"{CHAT_TEMPLATE} (the tokenizer folder's own template); the answer ends at the "
        "format's end of turn (default: the plain 'Question: ...\\nAnswer:' prompt)",
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
    chat = None
    if args.sft_tokenizer_prompt_format:
        chat = _chat_format(args, overrides)
        context["sft_tokenizer_prompt_format"] = args.sft_tokenizer_prompt_format
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
    metrics, rows = evaluate_qa(records, tokenizer, generate, limit, args.max_new_tokens, chat)
    if args.output_path:
        tmp = f"{args.output_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
        os.replace(tmp, args.output_path)
    return metrics, dict(context, iteration=iteration)


def _chat_format(args: argparse.Namespace, overrides: dict[str, Any]):
    """The prompt format of the checkpoint's Hugging Face tokenizer folder (the one
    `mg-prep sft --tokenizer-model` rendered the conversations with)."""
    # lazy: the checkpoint reader and the tokenizer only once the flags are parsed
    from mg.core.chat_format import (
        ChatFormatError,
        check_format,
        load_chat_format,
        read_tokenizer_settings,
        template_source,
    )
    from mg.core.checkpoint.model_io import resolve_tokenizer_paths
    from mg.core.tokenizers import TokenizerConfig

    fmt = args.sft_tokenizer_prompt_format
    try:
        check_format(fmt)
    except ChatFormatError as exc:
        raise EvalInputError(str(exc)) from None
    if not Path(args.load).is_dir():
        raise EvalInputError("no such checkpoint folder (--load)", args.load)
    recorded = _recorded_tokenizer(args.load, args.ckpt_step)
    fields = {**recorded, **{k: v for k, v in overrides.items() if v is not None}}
    kind = fields.get("tokenizer_type")
    if kind != "HuggingFaceTokenizer" or not fields.get("tokenizer_model"):
        raise EvalInputError(
            f"{FLAG} {fmt}: needs a Hugging Face tokenizer folder (HuggingFaceTokenizer "
            f"--tokenizer-model, as mg-prep sft renders with); the checkpoint's tokenizer is "
            f"{kind or 'not recorded'}"
        )
    config = resolve_tokenizer_paths(TokenizerConfig.from_dict(fields), args.load)
    folder = Path(str(config.tokenizer_model))
    if folder.is_file():
        folder = folder.parent
    if fmt == CHAT_TEMPLATE and not template_source(folder, read_tokenizer_settings(folder)):
        raise EvalInputError(
            f"{FLAG} {CHAT_TEMPLATE}: the tokenizer folder {folder} has no chat template "
            "(tokenizer_config.json's chat_template or chat_template.jinja); use chatml, or "
            "leave the flag out for the plain prompt"
        )
    try:
        return load_chat_format(folder, fmt)
    except ChatFormatError as exc:
        raise EvalInputError(str(exc)) from None


def _recorded_tokenizer(load_dir: str, iteration: Any) -> dict[str, Any]:
    """The tokenizer config a checkpoint records, torch or torch_dist ({} when none)."""
    # lazy: the checkpoint reader only once the flags are parsed
    from mg.core.checkpoint import CheckpointError, describe

    try:
        info = describe(load_dir, iteration)
    except (CheckpointError, OSError, ValueError, KeyError):
        return {}
    return dict(info.tokenizer_config or {})


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
