"""Megatron's model-parallel flags of mg-eval, apart from the model code that uses them,
so that `mg-eval --help` builds its parser without importing torch."""

from __future__ import annotations

import argparse

from mg.evaluate.errors import EvalInputError


def add_model_parallel_flags(parser: argparse.ArgumentParser, gpt_only: bool = False) -> None:
    """Megatron's layout flags; the world size (torchrun) must be a multiple of TP x PP.

    ``gpt_only``: the task accepts the flags (Megatron's command lines run) but
    only at 1 (:func:`check_single_shard`)."""
    about = (
        "not supported for this task (BERT finetuning runs single-shard): only 1 is accepted"
        if gpt_only
        else "evaluate in a tensor/pipeline-parallel layout under torchrun: each rank reads only "
        "its shard / stage of the checkpoint; WORLD_SIZE / (TP x PP) ranks are data parallel"
    )
    g = parser.add_argument_group("model parallelism", about)
    default = "" if gpt_only else " (default 1)"  # the BERT tasks' formatter adds defaults
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


def check_single_shard(task: str, tp: int, pp: int) -> None:
    """BERT finetuning holds the whole model on every rank; refuse a model-parallel layout."""
    if tp != 1 or pp != 1:
        raise EvalInputError(
            f"--tensor-model-parallel-size {tp} / --pipeline-model-parallel-size {pp}: "
            f"tensor/pipeline-parallel evaluation is not supported for {task} (BERT finetuning "
            "runs single-shard; under torchrun extra ranks are data parallel). It is supported "
            "for the GPT tasks wikitext, lambada and ppl"
        )
