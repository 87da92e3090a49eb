"""`mg-eval ict-retrieval`: top-k retrieval accuracy of an ICT bi-encoder on held-out pairs.

REALM's evaluation of its retriever, on the Inverse Cloze Task's own pairs: each
block of the chosen split (``--data-path`` sentence-split, ``--split``, titles from
``--titles-data-path``) gets one query sentence, taken out of it; every block is
embedded by the context tower into a Faiss index (``--index-str``, inner product;
``Flat`` is exact), every query by the query tower, and a query counts as found
at k when its own block is among the index's k best. ``--load`` is an `mg-train
ict` checkpoint, or a BERT checkpoint: both towers are then that BERT (the
untrained bi-encoder ICT starts from), which gives the baseline to compare with.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mg.evaluate.errors import EvalInputError


def add_ict_retrieval_task(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ict-retrieval",
        help="top-k retrieval accuracy of an ICT bi-encoder (mg-train ict) on held-out pairs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--load", required=True, metavar="DIR", help="mg-train ict or BERT checkpoint")
    p.add_argument("--data-path", required=True, metavar="PREFIX", help="sentence-split dataset")
    p.add_argument("--titles-data-path", metavar="PREFIX", help="one title per document")
    p.add_argument("--split", default="969,30,1", help="train,valid,test weights (969,30,1)")
    p.add_argument(
        "--eval-split", choices=("train", "valid", "test"), default="valid", help="(valid)"
    )
    p.add_argument("--seq-length", type=int, default=None, help="default: the checkpoint's")
    p.add_argument("--max-pairs", type=int, default=None, help="at most this many blocks")
    p.add_argument(
        "--retriever-report-topk-accuracies",
        nargs="+",
        type=int,
        default=[1, 5, 20],
        metavar="K",
        help="the k of the accuracies (1 5 20)",
    )
    p.add_argument("--index-str", default="Flat", help="faiss.index_factory string (Flat)")
    p.add_argument("--micro-batch-size", type=int, default=32, help="texts per forward (32)")
    p.add_argument("--seed", type=int, default=1234, help="which sentence is each query")
    p.add_argument("--report", metavar="FILE.jsonl", help="append the results as a JSON line")
    p.set_defaults(run=run_ict_retrieval, print_result=_line)


def load_biencoder(load_dir: str) -> tuple[Any, Any, Any]:
    """(BiEncoderModel in eval mode, its TransformerConfig, the recorded TokenizerConfig)."""
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    from mg.core.checkpoint import load_checkpoint
    from mg.core.models.biencoder import BiEncoderModel
    from mg.core.models.config import TransformerConfig
    from mg.core.tokenizers import TokenizerConfig

    if not Path(load_dir).is_dir():
        raise EvalInputError("no such checkpoint folder (--load)", load_dir)
    state, _ = load_checkpoint(load_dir)
    meta = state.get("mg") or {}
    if not meta.get("model_config"):
        raise EvalInputError("the checkpoint records no model config", load_dir)
    config = TransformerConfig.from_dict(dict(meta["model_config"]))
    config.hidden_dropout = config.attention_dropout = 0.0
    weights = state["model"]
    settings = (config.extra or {}).get("biencoder")
    if settings is not None:
        model = BiEncoderModel(config, settings["projection_dim"], settings["shared"])
        model.load_state_dict(weights)
    elif "embedding.word_embeddings.weight" in weights:  # a BERT: the untrained bi-encoder
        model = BiEncoderModel(config)
        model.load_bert(weights)
    else:
        raise EvalInputError(
            "neither an mg-train ict nor a BERT checkpoint (no bi-encoder config, no embedding)",
            load_dir,
        )
    tokenizer = meta.get("tokenizer_config")
    return model.eval(), config, None if tokenizer is None else TokenizerConfig.from_dict(tokenizer)


def embed(tower: Any, tokens: Any, masks: Any, batch: int) -> Any:
    import torch  # lazy: see load_biencoder

    parts = []
    with torch.no_grad():
        for first in range(0, len(tokens), batch):
            parts.append(tower(tokens[first : first + batch], masks[first : first + batch]))
    return torch.cat(parts).float().numpy()


def run_ict_retrieval(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    # lazy: numpy, torch, Faiss and the datasets only once the flags are parsed
    import numpy as np
    import torch

    # lazy: as above (the model and dataset code pull in torch)
    from mg.evaluate.model_loading import eval_tokenizer
    from mg.indexed_dataset import IndexedDataset, IndexedDatasetError
    from mg.indexed_dataset.ict_dataset import ICTDataset
    from mg.indexed_dataset.split import parse_split, split_matrix, split_range

    try:
        import faiss  # lazy: an optional dependency, needed by this task only
    except ImportError:
        raise EvalInputError("ict-retrieval needs Faiss: pip install faiss-cpu") from None
    model, config, tok_config = load_biencoder(args.load)
    tokenizer = eval_tokenizer(tok_config, None, Path(args.load), config.vocab_size, text_only=True)
    seq_length = args.seq_length or config.seq_length
    try:
        sentences = IndexedDataset(args.data_path)
        titles = IndexedDataset(args.titles_data_path) if args.titles_data_path else None
    except (IndexedDatasetError, OSError) as err:
        raise EvalInputError(f"--data-path/--titles-data-path: {err}") from None
    bookends = split_matrix(parse_split(args.split))[
        ("train", "valid", "test").index(args.eval_split)
    ]
    documents = [] if bookends is None else split_range(bookends, sentences.num_documents)
    if len(documents) == 0:
        raise EvalInputError(f"--split {args.split} gives the {args.eval_split} split no documents")
    try:
        probe = ICTDataset(sentences, documents, 1, seq_length, tokenizer, titles=titles)
        pairs = (
            len(probe.blocks) if args.max_pairs is None else min(args.max_pairs, len(probe.blocks))
        )
        dataset = ICTDataset(
            sentences, documents, pairs, seq_length, tokenizer, titles=titles,
            query_in_block_prob=0.0, seed=args.seed,
        )  # fmt: skip
    except ValueError as err:
        raise EvalInputError(f"--data-path {args.data_path}: {err}") from None
    samples = [dataset[i] for i in range(pairs)]
    stack = {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}
    blocks = embed(
        model.context_tower,
        stack["context_tokens"],
        stack["context_pad_mask"],
        args.micro_batch_size,
    )
    queries = embed(
        model.query_tower, stack["query_tokens"], stack["query_pad_mask"], args.micro_batch_size
    )
    try:
        index = faiss.index_factory(blocks.shape[1], args.index_str, faiss.METRIC_INNER_PRODUCT)
        if not index.is_trained:
            index.train(blocks)
        index.add(blocks)
    except Exception as err:
        reason = " ".join(str(err).split())[-160:]
        raise EvalInputError(
            f"--index-str {args.index_str!r}: Faiss rejects it ({reason})"
        ) from None
    ks = sorted(set(args.retriever_report_topk_accuracies))
    if ks[0] < 1:
        raise EvalInputError("--retriever-report-topk-accuracies takes k >= 1")
    _, found = index.search(queries, min(max(ks), pairs))
    own = np.arange(pairs)[:, None]
    metrics: dict[str, Any] = {
        f"top{k}_acc": float((found[:, :k] == own).any(axis=1).mean() * 100) for k in ks
    }
    metrics["pairs"] = pairs
    return metrics, {"data_path": args.data_path, "split": args.eval_split, "index": args.index_str}


def _line(task: str, metrics: dict[str, Any]) -> str:
    accuracies = " | ".join(
        f"{key}: {value:.2f}" for key, value in metrics.items() if key.endswith("_acc")
    )
    return f" ict-retrieval | {accuracies} | pairs: {metrics['pairs']} |"
