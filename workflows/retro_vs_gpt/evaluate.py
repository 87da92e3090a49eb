"""Validation perplexity of a GPT and a Retro checkpoint on the same tokens, and of the Retro
model with its retrieval switched off.

    python workflows/retro_vs_gpt/evaluate.py --gpt ckpt/gpt --retro ckpt/retro \
        --retro-project-dir retro/ --corpus corpus.jsonl --output eval.json

The samples are the Retro project's validation samples (those `mg-prep retro` queried
neighbours for, built from its data path, split, seed and sequence length, as `mg-train
retro` builds them), read by the trainer's own `RetroSampleDataset`. Every model scores
the same tokens with the trainer's loss (per-token cross entropy times the loss mask);
the perplexity is exp of the mean. Four ways:

- gpt: the GPT checkpoint
- retro: the Retro checkpoint with its neighbours (the first --retro-num-neighbors
  saved for each chunk, each with its continuation)
- retro_no_retrieval: the Retro checkpoint with every neighbour missing: each reads as
  end-of-document tokens, as a chunk without neighbours reads in training (`-1` ids)
- retro_random_neighbours: the Retro checkpoint with neighbours drawn at random from
  the database (retrieval that finds nothing relevant)

Each is also split by the document a predicted token belongs to (corpus.jsonl's
`near_duplicate`: the validation documents with a near-duplicate in the database, and
the rest). mg-eval ppl scores GPT checkpoints only, hence this script.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from mg.core.checkpoint import load_checkpoint
from mg.core.checkpoint.model_io import load_model, resolve_tokenizer_paths
from mg.core.models.retro import RetroConfig, RetroModel
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.trainer.arguments.retro import RetroArgs
from mg.trainer.family_retro import retro_datasets

WAYS = ("gpt", "retro", "retro_no_retrieval", "retro_random_neighbours")


def load_retro(load_dir: Path) -> tuple[RetroModel, RetroConfig, TokenizerConfig]:
    """A `mg-train retro` checkpoint (torch format) as a RetroModel in eval mode."""
    state, _ = load_checkpoint(load_dir)
    meta = state["mg"]
    config = RetroConfig.from_dict(dict(meta["model_config"]))
    model = RetroModel(config)
    weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
    model.load_state_dict(weights, strict=True)
    tokenizer = TokenizerConfig.from_dict(dict(meta["tokenizer_config"]))
    return model.eval(), config, resolve_tokenizer_paths(tokenizer, load_dir)


def valid_samples(project_dir: Path, tokenizer, num_neighbors: int, retrieved_chunks: int):
    """The project's queried validation samples with their neighbours (`mg-train retro`'s
    own `retro_datasets`), each once: the GPT samples, the chunk database, the neighbours."""
    retro = RetroArgs(
        retro_project_dir=str(project_dir),
        retro_num_neighbors=num_neighbors,
        retro_num_retrieved_chunks=retrieved_chunks,
    )
    _, samples, _ = retro_datasets(SimpleNamespace(retro=retro), tokenizer, (0, 1, 0))
    if samples is None:
        raise SystemExit(f"--retro-project-dir {project_dir}: no validation samples were queried")
    samples.size = min(samples.queried, len(samples.samples))  # each queried sample once
    return samples, samples.samples, samples.database, samples.neighbors


def label_documents(dataset, index: int) -> np.ndarray:
    """The document id of each label of GPT sample ``index`` (the token it predicts)."""
    position = int(dataset.shuffle_index[index])
    first_doc, first_offset = (int(v) for v in dataset.sample_index[position])
    lengths = dataset.indexed.sequence_lengths
    wanted = dataset.config.seq_length + 1
    out, doc_pos, offset = [], first_doc, first_offset
    while len(out) < wanted and doc_pos < len(dataset.document_index):
        doc = int(dataset.document_index[doc_pos])
        take = min(int(lengths[doc]) - offset, wanted - len(out))
        out += [doc] * take
        doc_pos, offset = doc_pos + 1, 0
    out += [-1] * (wanted - len(out))
    return np.asarray(out[1:])


def per_token_loss(model, batch: dict[str, torch.Tensor], neighbours: torch.Tensor | None):
    tokens = batch["tokens"]
    kwargs = {"position_ids": batch["position_ids"], "labels": batch["labels"]}
    if neighbours is not None:
        kwargs["context_input_ids"] = neighbours.reshape(-1, neighbours.shape[-1])
    with torch.no_grad():
        return model(tokens, **kwargs).float() * batch["loss_mask"].float()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpt", type=Path, required=True, help="mg-train gpt checkpoint")
    parser.add_argument("--retro", type=Path, required=True, help="mg-train retro checkpoint")
    parser.add_argument("--retro-project-dir", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, required=True, help="make_corpus.py's output")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234, help="of the random neighbours")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    began = time.monotonic()
    gpt, _, _, _ = load_model(args.gpt)
    retro, config, tokenizer_config = load_retro(args.retro)
    tokenizer = build_tokenizer(tokenizer_config)
    eod = tokenizer.eod
    samples, valid, database, neighbors = valid_samples(
        args.retro_project_dir,
        tokenizer,
        config.retro_num_neighbors,
        config.retro_num_retrieved_chunks,
    )
    near = np.array([json.loads(line)["near_duplicate"] for line in args.corpus.open()])
    rng = np.random.default_rng(args.seed)
    n_chunks = len(database.chunks)
    k, chunks_per_sample = config.retro_num_neighbors, samples.chunks_per_sample
    retrieved = config.retro_num_retrieved_chunks

    sums = {w: np.zeros(2) for w in WAYS}  # [near-duplicate, fresh] loss sums
    counts = np.zeros(2)
    for first in range(0, len(samples), args.micro_batch_size):
        rows = range(first, min(first + args.micro_batch_size, len(samples)))
        items = [samples[i] for i in rows]
        batch = {key: torch.as_tensor(np.stack([s[key] for s in items])) for key in items[0]}
        docs = np.stack([label_documents(valid, i) for i in rows])
        is_near = np.where(docs >= 0, near[np.maximum(docs, 0)], False)
        mask = batch["loss_mask"].numpy() > 0
        counts += [(mask & is_near).sum(), (mask & ~is_near).sum()]
        missing = torch.full_like(batch["neighbor_tokens"], eod)
        random_ids = rng.integers(0, n_chunks, (len(items) * chunks_per_sample, k))
        random = torch.as_tensor(
            np.stack([database.retrieved_tokens(ids, retrieved) for ids in random_ids])
        ).reshape(batch["neighbor_tokens"].shape)
        losses = {
            "gpt": per_token_loss(gpt, batch, None),
            "retro": per_token_loss(retro, batch, batch["neighbor_tokens"]),
            "retro_no_retrieval": per_token_loss(retro, batch, missing),
            "retro_random_neighbours": per_token_loss(retro, batch, random),
        }
        for way, loss in losses.items():
            loss = loss.numpy()
            sums[way] += [loss[mask & is_near].sum(), loss[mask & ~is_near].sum()]

    result = {"samples": len(samples), "tokens": int(counts.sum()), "ways": {}}
    result["tokens_near_duplicate"], result["tokens_fresh"] = (int(c) for c in counts)
    for way in WAYS:
        total = sums[way].sum() / counts.sum()
        parts = sums[way] / np.maximum(counts, 1)
        result["ways"][way] = {
            "loss": float(total),
            "ppl": math.exp(total),
            "ppl_near_duplicate": math.exp(parts[0]),
            "ppl_fresh": math.exp(parts[1]),
        }
    result["top_neighbour_from_near_duplicate"] = neighbour_hits(
        args.corpus, valid, samples, neighbors, database
    )
    result["params"] = {
        "gpt": sum(p.numel() for p in gpt.parameters()),
        "retro": sum(p.numel() for p in retro.parameters()),
    }
    result["seconds"] = time.monotonic() - began
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for way, r in result["ways"].items():
        print(
            f"{way:<24} ppl {r['ppl']:8.2f}  near-duplicate {r['ppl_near_duplicate']:8.2f}  "
            f"fresh {r['ppl_fresh']:8.2f}"
        )


def neighbour_hits(corpus: Path, valid, samples, neighbors: np.ndarray, database) -> float | None:
    """Of the validation chunks that start in a document with a near-duplicate, the
    share whose first neighbour is a chunk of that near-duplicate (the retrieval works)."""
    pair = [json.loads(line)["pair"] for line in corpus.open()]
    m = database.chunk_length
    hits = total = 0
    for i in range(len(samples)):
        docs = label_documents(valid, i)
        for c in range(samples.chunks_per_sample):
            doc = int(docs[max(c * m - 1, 0)])  # the document of the chunk's first token
            best = int(neighbors[i * samples.chunks_per_sample + c, 0])
            if doc < 0 or pair[doc] is None or best < 0:
                continue
            total += 1
            hits += pair[int(database.chunks[best, 1])] == pair[doc]
    return hits / total if total else None


if __name__ == "__main__":
    main()
