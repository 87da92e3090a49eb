"""Retro's retrieval: BERT chunk embedding rate, and Faiss neighbour search against a
brute-force numpy search over the same embeddings, in one run on one machine.

    uv run --frozen python bench/bench_retro.py                         # MiniLM-L6, 100k vectors
    uv run --frozen python bench/bench_retro.py --quick                 # a smoke run
    uv run --frozen python bench/bench_retro.py --index Flat IVF1024,PQ32 --nprobe 16

1. Embedding: Botchan (real text) cut into chunks of --chunk-length GPT-2 tokens,
   detokenized and embedded by core's BertEmbedder (the code `mg-prep retro` runs;
   MiniLM-L6's real weights, or --bert tiny: a 2-layer random BERT) in batches of
   --batch-size: chunks per second.
2. Search: the database is --db-size unit vectors: the embedded chunks, and copies of
   them with Gaussian noise (σ --noise) up to that size, renormalized (real text to
   embed that many chunks would take hours on a CPU; the copies keep the real
   embeddings' spread). Queries are --queries of the real chunk embeddings, also
   perturbed. Each --index string is built the way `mg-prep retro` builds it
   (faiss.index_factory, inner product, trained on --ntrain vectors, nprobe and
   efSearch set) and timed: train and add seconds, its size on disk, queries per
   second for the top --k, and recall@k against the exact answer. The exact answer is
   numpy: the query block times the database (float32 BLAS), then argpartition;
   its "size" is the float32 matrix.

Threads: --threads for torch, Faiss (OpenMP) and numpy's BLAS alike (threadpoolctl),
named in the header with the CPU model and its vector extensions; the load average
before and after is printed, since the box may be shared.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from mg.core.fixtures import gpt2_bpe_tokenizer_config
from mg.core.retro.bert_embedder import BertEmbedder, load_bert_checkpoint
from mg.core.retro.faiss_index import set_search_parameters
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.corpus_prep.retro_index import import_faiss, new_index

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/corpus-prep/tests"))
from retro_corpus import bert_vocab, botchan_documents, minilm_bert, tiny_bert  # noqa: E402

WORK = Path(tempfile.gettempdir()) / "mg-bench-retro"


def cpu_line() -> str:
    model, flags = platform.processor() or "unknown CPU", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs ({', '.join(isa) or 'no AVX2'})"


def chunk_texts(chunk_length: int) -> list[str]:
    """Botchan in GPT-2 token chunks, detokenized (what `mg-prep retro` embeds)."""
    gpt = build_tokenizer(gpt2_bpe_tokenizer_config())
    texts = []
    for doc in botchan_documents():
        ids = gpt.tokenize(doc)
        texts += [
            gpt.detokenize(ids[i : i + chunk_length]) for i in range(0, len(ids), chunk_length)
        ]
    return texts


def embedder(kind: str, batch_size: int, max_length: int) -> BertEmbedder:
    folder = WORK / f"bert-{kind}"
    if not folder.exists():
        (minilm_bert if kind == "minilm" else tiny_bert)(folder)
    checkpoint = load_bert_checkpoint(folder)
    tokenizer = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=bert_vocab()))
    return BertEmbedder(checkpoint.model, tokenizer, max_length, batch_size, normalize=True)


def grow(vectors: np.ndarray, size: int, noise: float, seed: int) -> np.ndarray:
    """``size`` unit vectors: ``vectors`` and noisy copies of them."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(vectors), size=size)
    out = vectors[picks] + rng.normal(0.0, noise, size=(size, vectors.shape[1])).astype(np.float32)
    out[: min(size, len(vectors))] = vectors[: min(size, len(vectors))]
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def numpy_search(database: np.ndarray, queries: np.ndarray, k: int, block: int = 256):
    """Exact top-k by inner product: a BLAS product per query block, then argpartition."""
    out = np.empty((len(queries), k), dtype=np.int64)
    for first in range(0, len(queries), block):
        scores = queries[first : first + block] @ database.T
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
        out[first : first + block] = np.take_along_axis(top, order, axis=1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bert", choices=("minilm", "tiny"), default="minilm")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-length", type=int, default=64)
    parser.add_argument("--embed-chunks", type=int, default=1000, help="chunks embedded (timed)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=128, help="BERT tokens per chunk")
    parser.add_argument("--db-size", type=int, default=100_000)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument(
        "--index", nargs="+", default=["Flat", "IVF256,PQ32", "OPQ32_128,IVF256_HNSW16,PQ32"]
    )
    parser.add_argument("--ntrain", type=int, default=20_000)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--ef-search", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="tiny BERT, small sizes: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.bert, args.embed_chunks, args.db_size, args.queries = "tiny", 200, 5000, 200
        args.index, args.ntrain, args.nprobe = ["Flat", "IVF16,PQ8x4"], 2000, 4
    WORK.mkdir(parents=True, exist_ok=True)
    faiss = import_faiss()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    blas = threadpool_limits(limits=args.threads, user_api="blas")
    print(
        f"{cpu_line()}; {args.threads} threads for torch, Faiss {faiss.__version__} and numpy "
        f"{np.__version__}'s BLAS; load average {os.getloadavg()[0]:.1f}"
    )

    texts = chunk_texts(args.chunk_length)[: args.embed_chunks]
    model = embedder(args.bert, args.batch_size, args.max_length)
    model.embed(texts[: args.batch_size])  # warm-up
    began = time.perf_counter()
    vectors = model.embed(texts)
    seconds = time.perf_counter() - began
    print(
        f"\nembedding: {len(texts)} chunks of {args.chunk_length} GPT-2 tokens, BERT {args.bert} "
        f"(hidden {model.dimension}), batch {args.batch_size}: {len(texts) / seconds:,.1f} "
        f"chunks/s ({seconds:.1f} s)"
    )

    database = grow(vectors, args.db_size, args.noise, seed=0)
    queries = grow(vectors, args.queries, args.noise, seed=1)
    began = time.perf_counter()
    exact = numpy_search(database, queries, args.k)
    numpy_s = time.perf_counter() - began
    print(
        f"\nsearch: {len(database):,} database vectors x {model.dimension}, {len(queries):,} "
        f"queries, top {args.k}, nprobe {args.nprobe}, efSearch {args.ef_search}"
    )
    print(
        f"{'index':<32} {'train s':>8} {'add s':>7} {'on disk':>10} {'queries/s':>10} "
        f"{f'recall@{args.k}':>10}"
    )
    print(
        f"{'numpy brute force':<32} {'-':>8} {'-':>7} {database.nbytes / 2**20:>7.1f} MB "
        f"{len(queries) / numpy_s:>10,.0f} {1.0:>10.3f}"
    )
    for index_str in args.index:
        index = new_index(index_str, model.dimension)
        rng = np.random.default_rng(2)
        train = database[np.sort(rng.choice(len(database), min(args.ntrain, len(database)), False))]
        began = time.perf_counter()
        index.train(train)
        train_s = time.perf_counter() - began
        began = time.perf_counter()
        index.add(database)
        add_s = time.perf_counter() - began
        set_search_parameters(index, args.nprobe, args.ef_search)
        path = WORK / "index.faissindex"
        faiss.write_index(index, str(path))
        size = path.stat().st_size
        began = time.perf_counter()
        _, found = index.search(queries, args.k)
        search_s = time.perf_counter() - began
        recall = np.mean([len(set(f) & set(e)) / args.k for f, e in zip(found, exact, strict=True)])
        print(
            f"{index_str:<32} {train_s:>8.1f} {add_s:>7.1f} {size / 2**20:>7.1f} MB "
            f"{len(queries) / search_s:>10,.0f} {recall:>10.3f}",
            flush=True,
        )
    blas.restore_original_limits()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
