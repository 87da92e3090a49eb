"""`mg-prep retro`: Retro's retrieval database, its Faiss index and the pretraining neighbours.

    mg-prep retro --retro-project-dir retro/ --retro-tasks build \\
        --retro-gpt-data-path 1 data/corpus_text_document \\
        --retro-gpt-tokenizer-type GPT2BPETokenizer \\
        --retro-gpt-vocab-file gpt2-vocab.json --retro-gpt-merge-file gpt2-merges.txt \\
        --retro-gpt-seq-length 2048 --retro-gpt-chunk-length 64 \\
        --retro-gpt-train-samples 200000 --retro-gpt-global-batch-size 256 \\
        --retro-gpt-eval-interval 2000 --retro-gpt-eval-iters 50 \\
        --load checkpoints/bert --retro-bert-max-chunk-length 256 \\
        --retro-index-str OPQ32_64,IVF65536_HNSW8,PQ32 --retro-index-ntrain 1000000

The flags are those of Megatron-LM's tools/retro/preprocess_data.py. Tasks
(--retro-tasks, comma-separated, run in this order): db-build (documents of the
training split cut into chunks of --retro-gpt-chunk-length tokens), index-build
(= index-train, index-add: every chunk embedded by the BERT checkpoint --load,
a Faiss index by factory string trained on --retro-index-ntrain sampled chunks,
every chunk added), query-neighbors (also pretraining-query-neighbors: the
neighbours of every chunk of the train, valid and test samples, chunks of the
sample's own documents left out), or build (all). Every stage resumes where an
interrupted run stopped and is skipped when its output is complete. The
project folder records the arguments of its first run: later runs may leave
them out, and one that gives a different value is refused, naming the flag.
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import run_later

TASK_CHOICES = (
    "build",
    "db-build",
    "index-build",
    "index-train",
    "index-add",
    "query-neighbors",
    "pretraining-query-neighbors",
    "query-pretraining-neighbors",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "retro",
        help="Retro's chunk database, Faiss index and pretraining neighbours",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Defaults are None here: a value left out is taken from the project's record,
    # then from Megatron's default (retro_config.DEFAULTS).
    basic = parser.add_argument_group("Retro project")
    basic.add_argument("--retro-project-dir", required=True, metavar="DIR")
    basic.add_argument(
        "--retro-tasks",
        default="build",
        help=f"comma-separated, from: {', '.join(TASK_CHOICES)} (default build)",
    )
    basic.add_argument(
        "--retro-block-size", type=int, help="chunks per embedding and query block (100000)"
    )
    basic.add_argument(
        "--retro-doc-block-size", type=int, help="documents per chunk-database block (100000)"
    )

    gpt = parser.add_argument_group("GPT data (the corpus that is chunked and queried)")
    gpt.add_argument(
        "--retro-gpt-data-path",
        nargs="+",
        metavar="WEIGHT PREFIX",
        help="indexed datasets: PREFIX, or WEIGHT PREFIX pairs",
    )
    gpt.add_argument("--retro-gpt-split", help="train,valid,test weights (969,30,1)")
    gpt.add_argument("--retro-gpt-seed", type=int, help="sample shuffle seed (1234)")
    gpt.add_argument("--retro-gpt-data-cache-path", metavar="DIR", help="GPT sample index cache")
    gpt.add_argument("--retro-gpt-tokenizer-type")
    gpt.add_argument("--retro-gpt-tokenizer-model")
    gpt.add_argument("--retro-gpt-vocab-file")
    gpt.add_argument("--retro-gpt-merge-file")
    gpt.add_argument("--retro-gpt-seq-length", type=int)
    gpt.add_argument("--retro-gpt-chunk-length", type=int, help="tokens per chunk (64)")
    gpt.add_argument("--retro-gpt-train-samples", type=int)
    gpt.add_argument("--retro-gpt-global-batch-size", type=int)
    gpt.add_argument("--retro-gpt-eval-interval", type=int)
    gpt.add_argument("--retro-gpt-eval-iters", type=int)

    bert = parser.add_argument_group("BERT (the chunk embedder)")
    bert.add_argument(
        "--load", metavar="DIR", help="BERT checkpoint (mg-train bert, mg-convert import-hf)"
    )
    bert.add_argument(
        "--retro-bert-tokenizer-type", help="default: the tokenizer the checkpoint records"
    )
    bert.add_argument("--retro-bert-vocab-file")
    bert.add_argument("--retro-bert-batch-size", type=int, default=128, help="(128)")
    bert.add_argument(
        "--retro-bert-max-chunk-length", type=int, help="BERT tokens per chunk, cut (256)"
    )

    index = parser.add_argument_group("Faiss index")
    index.add_argument(
        "--retro-index-type",
        choices=("faiss-base", "faiss-par-add"),
        default="faiss-par-add",
        help="accepted for Megatron's command lines; both build the same index",
    )
    index.add_argument("--retro-index-str", help="faiss.index_factory string, e.g. IVF4096,PQ32")
    index.add_argument("--retro-index-ntrain", type=int, help="chunks the index is trained on")
    index.add_argument("--retro-index-train-load-fraction", type=float, help="(1.0)")
    index.add_argument("--retro-index-add-load-fraction", type=float, help="(1.0)")

    query = parser.add_argument_group("neighbour query")
    query.add_argument("--retro-query-ef-search", type=int, help="HNSW efSearch (256)")
    query.add_argument("--retro-query-nprobe", type=int, help="IVF nprobe (65536)")
    query.add_argument(
        "--retro-query-num-neighbors-query", type=int, help="neighbours searched (200)"
    )
    query.add_argument(
        "--retro-query-num-neighbors-save", type=int, help="neighbours kept after filtering (20)"
    )
    parser.set_defaults(func=run_later("retro_cmd"))
