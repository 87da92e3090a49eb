"""Megatron-LM's Retro flags (`_add_retro_args`, `pretrain_retro.py`), their group and checks.

`mg-train retro --retro-add-retriever --retro-project-dir DIR` trains a Retro model
(`mg.core.models.retro`) on the GPT samples `mg-prep retro` queried neighbours for:
the project folder records the data, split, seed, sequence and chunk length, and each
sample's chunks come with their neighbours and continuations from its database. The
model shape comes from the usual model flags; the Retro encoder and chunked
cross-attention from these:

    --retro-encoder-layers            layers of the neighbour encoder (2)
    --retro-encoder-hidden-dropout    its hidden dropout (0.1)
    --retro-encoder-attention-dropout its attention dropout (0.1)
    --retro-num-neighbors             neighbours per chunk, k (2)
    --retro-num-retrieved-chunks      chunks per neighbour: it and its continuation (2)
    --retro-attention-gate            scale of the cross-attention output (1)
    --retro-cyclic-train-iters        train this many iterations, cycling over the
                                      queried samples (Megatron's cyclic Retro training)
    --retro-no-verify-neighbor-count  accept a project with fewer queried samples than
                                      the run reads (they are cycled over)

Retro-fitting a GPT: `mg-train retro ... --load GPT_CKPT --no-load-optim --finetune`.

InstructRetro: `mg-train retro --sft --data-path CHATS ...` finetunes on `mg-prep sft`
conversations instead (retro_sft_data.py); each conversation's neighbours are
retrieved with the project's BERT and index, so the project's pretraining data,
split and sequence length do not bind the run, but its BERT and index must be there.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class RetroArgs:
    """Where the retrieval database is, and the Retro encoder's shape."""

    retro_project_dir: str | None = None
    retro_add_retriever: bool = False
    retro_cyclic_train_iters: int | None = None
    retro_encoder_layers: int = 2
    retro_encoder_hidden_dropout: float = 0.1
    retro_encoder_attention_dropout: float = 0.1
    retro_num_neighbors: int = 2
    retro_num_retrieved_chunks: int = 2
    retro_attention_gate: float = 1.0
    retro_verify_neighbor_count: bool = True


def add_retro_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--retro-project-dir",
        help="Retro project folder built by `mg-prep retro` (chunk database, index, the "
        "pretraining neighbours).",
    )
    p.add_argument(
        "--retro-add-retriever",
        action="store_true",
        help="Add the retriever (encoder and chunked cross-attention): train a Retro model.",
    )
    p.add_argument(
        "--retro-cyclic-train-iters",
        type=int,
        help="Training iterations of cyclic Retro training (the queried samples are "
        "cycled over); sets --train-iters.",
    )
    p.add_argument("--retro-encoder-layers", type=int, default=2, help="Retrieval encoder layers.")
    p.add_argument(
        "--retro-encoder-hidden-dropout",
        type=float,
        default=0.1,
        help="Hidden dropout of the retrieval encoder.",
    )
    p.add_argument(
        "--retro-encoder-attention-dropout",
        type=float,
        default=0.1,
        help="Attention dropout of the retrieval encoder.",
    )
    p.add_argument(
        "--retro-num-neighbors",
        type=int,
        default=2,
        help="Neighbours per chunk used in training.",
    )
    p.add_argument(
        "--retro-num-retrieved-chunks",
        type=int,
        default=2,
        help="Chunks retrieved per neighbour (the neighbour and its continuation).",
    )
    p.add_argument(
        "--retro-attention-gate",
        type=float,
        default=1.0,
        help="Gated cross attention: scale of the chunked cross-attention output.",
    )
    p.add_argument(
        "--retro-no-verify-neighbor-count",
        action="store_false",
        dest="retro_verify_neighbor_count",
        help="Accept a project that queried fewer samples than the run reads (they are "
        "cycled over).",
    )


def read_project_config(project_dir: str) -> dict[str, Any]:
    """The project's recorded `mg-prep retro` arguments; a one-line error without them."""
    from mg.core.retro.files import read_json  # lazy: only a Retro run reads a project
    from mg.core.retro.project import ProjectPaths

    path = ProjectPaths.of(project_dir).config
    if not path.is_file():
        fail(
            f"--retro-project-dir {project_dir}: no {os.path.basename(path)} there; build the "
            "project with `mg-prep retro --retro-tasks build` first"
        )
    return dict(read_json(path))


# flags whose construction step or checkpoint layout Retro does not have yet, by name
_NOT_YET = (
    ("--pipeline-model-parallel-size", lambda a: a.distributed.pipeline_model_parallel_size > 1),
    ("--context-parallel-size", lambda a: a.distributed.context_parallel_size > 1),
    ("--torch-compile", lambda a: a.training.torch_compile),
    ("--use-torch-fsdp2", lambda a: a.fsdp.use_torch_fsdp2),
    ("--use-megatron-fsdp", lambda a: a.fsdp.use_megatron_fsdp),
    (
        "--transformer-impl transformer_engine",
        lambda a: a.transformer_engine.transformer_impl == "transformer_engine",
    ),
)


def check_retro_flags(args: Args) -> str | None:
    """The one-line message for Retro flags that cannot apply, or None."""
    r = args.retro
    if args.family != "retro":
        defaults = RetroArgs()
        for f in fields(RetroArgs):
            if getattr(r, f.name) != getattr(defaults, f.name):
                flag = "--" + f.name.replace("_", "-")
                if f.name == "retro_verify_neighbor_count":
                    flag = "--retro-no-verify-neighbor-count"
                return f"{flag} is a Retro flag: use `mg-train retro`, not {args.family}"
        return None
    if not r.retro_add_retriever:
        return (
            "mg-train retro without --retro-add-retriever is a GPT (Megatron's pretrain_retro.py "
            "then builds one): add --retro-add-retriever, or use `mg-train gpt`"
        )
    if r.retro_project_dir is None:
        return "mg-train retro needs --retro-project-dir (a folder built by `mg-prep retro`)"
    for name in ("retro_encoder_layers", "retro_num_neighbors", "retro_num_retrieved_chunks"):
        if getattr(r, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(r, name)}"
    for name in ("retro_encoder_hidden_dropout", "retro_encoder_attention_dropout"):
        if not 0.0 <= getattr(r, name) < 1.0:
            return f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(r, name)}"
    for flag, given in _NOT_YET:
        if given(args):
            return f"{flag} with mg-train retro: not implemented for Retro yet; leave it out"
    project = read_project_config(r.retro_project_dir)
    chunk = int(project.get("retro_gpt_chunk_length") or 0)
    seq = args.model.seq_length
    tp = args.distributed.tensor_model_parallel_size
    if args.distributed.sequence_parallel and seq is not None and seq % tp:
        return (
            f"--sequence-parallel: --seq-length {seq} must be a multiple of "
            f"--tensor-model-parallel-size {tp} (each rank takes an equal slice)"
        )
    if seq is not None and (chunk <= 0 or seq % chunk):
        return (
            f"--seq-length {seq} is not a multiple of the project's --retro-gpt-chunk-length "
            f"{chunk} ({r.retro_project_dir}); use a multiple of {chunk}"
        )
    if args.sft.sft:
        return _sft_project_error(project, r.retro_project_dir)
    queried = project.get("retro_gpt_seq_length")
    if seq is not None and queried is not None and seq != queried:
        return (
            f"--seq-length {seq} differs from the project's --retro-gpt-seq-length {queried} "
            f"({r.retro_project_dir}): the neighbours were queried for {queried}-token samples"
        )
    given = [w for w in (args.data.data_path or []) if not _is_number(w)]
    recorded = [w for w in project.get("retro_gpt_data_path") or [] if not _is_number(w)]
    if given and [os.path.abspath(w) for w in given] != [os.path.abspath(w) for w in recorded]:
        return (
            f"--data-path {' '.join(given)} differs from the project's --retro-gpt-data-path "
            f"{' '.join(recorded)} ({r.retro_project_dir}): Retro trains on the data it queried"
        )
    split = project.get("retro_gpt_split")
    if (
        args.data.split is not None
        and split is not None
        and _weights(args.data.split) != _weights(split)
    ):
        return (
            f"--split {args.data.split} differs from the project's --retro-gpt-split {split} "
            f"({r.retro_project_dir}): Retro trains on the samples it queried"
        )
    saved = project.get("retro_query_num_neighbors_save")
    if saved is not None and r.retro_num_neighbors > saved:
        return (
            f"--retro-num-neighbors {r.retro_num_neighbors} is more than the project saved "
            f"(--retro-query-num-neighbors-save {saved})"
        )
    return None


def _sft_project_error(project: dict[str, Any], project_dir: str) -> str | None:
    """What --sft needs of the project besides its chunks: the BERT and the finished index
    that retrieve each conversation's neighbours, and Faiss to search it. The
    pretraining neighbours, data, split and sequence length do not matter then."""
    from mg.core.retro.project import ProjectPaths  # lazy: only a Retro run reads a project

    where = f"--sft with --retro-project-dir {project_dir}"
    bert = project.get("load")
    if not bert or not os.path.isdir(bert):
        return (
            f"{where}: its BERT checkpoint ({bert or 'none recorded'}, mg-prep retro --load) "
            "is missing, and each conversation's neighbours are retrieved with it; restore "
            "it or give a project that has it"
        )
    paths = ProjectPaths.of(project_dir)
    if not paths.added_index.is_file() or not paths.index_manifest.is_file():
        return (
            f"{where}: the project has no finished index to retrieve each conversation's "
            "neighbours from; run `mg-prep retro --retro-tasks index-build`"
        )
    if importlib.util.find_spec("faiss") is None:
        return f"{where}: searching its index needs Faiss: pip install faiss-cpu (or faiss-gpu)"
    return None


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _weights(split: str) -> list[float]:
    """A --split string as normalised weights ("98,2,0" and "49, 1, 0" are the same)."""
    values = [float(v) for v in split.replace(" ", "").split(",") if v]
    total = sum(values) or 1.0
    return [round(v / total, 9) for v in values]


def finalize_retro(args: Args) -> None:
    """--retro-cyclic-train-iters sets the training length, as Megatron's cyclic loader."""
    r = args.retro
    if args.family == "retro" and r.retro_cyclic_train_iters is not None:
        if args.training.train_samples is not None:
            fail("--retro-cyclic-train-iters sets --train-iters: leave out --train-samples")
        args.training.train_iters = r.retro_cyclic_train_iters


def check_retro(args: Args) -> None:
    error = check_retro_flags(args)
    if error:
        fail(error)
