"""Megatron's biencoder flags (`mg-train ict`, REALM's Inverse Cloze Task; pretrain_ict.py).

The bi-encoder's query and context towers start from one BERT checkpoint
(`--bert-load`: `mg-train bert`, or a Hugging Face BERT through `mg-convert`); the
blocks come from a sentence-split `--data-path`, their titles from
`--titles-data-path` (one sequence per document). The index-building flags of
Megatron's group (`--block-data-path`, `--embedding-path`, `--evidence-data-path`,
`--indexer-*`), `--ict-head-size`/`--ict-load` (REALM) and
`--retriever-report-topk-accuracies` (the training log has no place for metrics that
are not losses yet) are refused by argparse for now. Data-parallel ranks share their
blocks as in-batch negatives (`family_ict`); model and context parallelism and FSDP
are refused.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class ICTArgs:
    """The bi-encoder and its ICT data."""

    bert_load: str | None = None
    titles_data_path: str | None = None
    query_in_block_prob: float = 0.1
    use_one_sent_docs: bool = False
    biencoder_projection_dim: int = 0
    biencoder_shared_query_context_model: bool = False
    retriever_score_scaling: bool = False


def add_ict_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--bert-load",
        help="BERT checkpoint both towers start from (mg-train bert, mg-convert import-hf).",
    )
    p.add_argument(
        "--titles-data-path",
        help="Indexed dataset of document titles, one sequence per document of --data-path.",
    )
    p.add_argument(
        "--query-in-block-prob",
        type=float,
        default=0.1,
        help="How often the query sentence is left in its block (0.1).",
    )
    p.add_argument(
        "--use-one-sent-docs", action="store_true", help="Keep one-sentence documents as blocks."
    )
    p.add_argument(
        "--biencoder-projection-dim",
        type=int,
        default=0,
        help="A linear projection of each tower's [CLS] state to this size (0: none).",
    )
    p.add_argument(
        "--biencoder-shared-query-context-model",
        action="store_true",
        help="One tower embeds queries and blocks.",
    )
    p.add_argument(
        "--retriever-score-scaling",
        action="store_true",
        help="Divide the query-block inner products by the square root of --hidden-size.",
    )


def check_ict(args: Args) -> None:
    """ICT's needs, and ICT flags given to another family."""
    i = args.ict
    if args.family != "ict":
        given = [
            flag
            for flag, value in (
                ("--bert-load", i.bert_load),
                ("--titles-data-path", i.titles_data_path),
                ("--biencoder-projection-dim", i.biencoder_projection_dim),
                ("--biencoder-shared-query-context-model", i.biencoder_shared_query_context_model),
                ("--retriever-score-scaling", i.retriever_score_scaling),
                ("--use-one-sent-docs", i.use_one_sent_docs),
            )
            if value
        ]
        if given:
            fail(f"{given[0]} is for mg-train ict, not {args.family}")
        return
    if not 0.0 <= i.query_in_block_prob <= 1.0:
        fail(f"--query-in-block-prob must be in [0, 1], got {i.query_in_block_prob}")
    if i.biencoder_projection_dim < 0:
        fail(f"--biencoder-projection-dim must be >= 0, got {i.biencoder_projection_dim}")
    d = args.distributed
    if d.tensor_model_parallel_size > 1 or d.pipeline_model_parallel_size > 1:
        fail("mg-train ict runs without model parallelism (as Megatron's pretrain_ict.py)")
    if d.context_parallel_size > 1:
        fail("mg-train ict does not support --context-parallel-size > 1")
    if args.fsdp.enabled:
        fail(
            "mg-train ict does not support --use-megatron-fsdp or --use-torch-fsdp2 yet; "
            "use data parallelism (with --use-distributed-optimizer to shard the optimizer)"
        )
    if args.data.mock_data or not args.data.data_path:
        fail(
            "mg-train ict needs --data-path of a sentence-split dataset (mg-prep --split-sentences)"
        )
