"""Megatron's model-parallel flags of mg-eval, apart from the model code that uses them,
so that `mg-eval --help` builds its parser without importing torch."""

from __future__ import annotations

import argparse

from mg.evaluate.errors import EvalInputError


def add_model_parallel_flags(parser: argparse.ArgumentParser, bert_task: bool = False) -> None:
    """Megatron's layout flags; the world size (torchrun) must be a multiple of TP x PP.

    ``bert_task``: BERT finetuning, tensor parallel only (:func:`check_bert_task_layout`)."""
    about = (
        "finetune with BERT's layers split over TP ranks under torchrun (Megatron's layout; "
        "each rank keeps its shards), WORLD_SIZE / TP ranks data parallel; pipeline "
        "parallelism is not supported for the BERT tasks"
        if bert_task
        else "evaluate in a tensor/pipeline-parallel layout under torchrun: each rank reads only "
        "its shard / stage of the checkpoint; WORLD_SIZE / (TP x PP) ranks are data parallel"
    )
    g = parser.add_argument_group("model parallelism", about)
    default = "" if bert_task else " (default 1)"  # the BERT tasks' formatter adds defaults
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        metavar="TP",
        help="ranks that split each layer" + default,
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        metavar="PP",
        help="pipeline stages the layers are split into" + default,
    )


def check_bert_task_layout(task: str, tp: int, pp: int) -> None:
    """BERT finetuning runs tensor parallel (and data parallel), not pipeline parallel."""
    if tp < 1:
        raise EvalInputError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if pp != 1:
        raise EvalInputError(
            f"--pipeline-model-parallel-size {pp}: pipeline-parallel finetuning is not supported "
            f"for {task}; use --tensor-model-parallel-size (extra torchrun ranks are data "
            "parallel). Pipeline parallelism is supported for the GPT tasks wikitext, lambada "
            "and ppl"
        )
