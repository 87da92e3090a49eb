"""Serving a Retro checkpoint: neighbours retrieved from the project's index per request.

The paged engine cannot host Retro's attention as it hosts GPT's: a chunk's
neighbours enter every later token's cross-attention, and a neighbour encoder that
attends to the chunk's hidden states has no per-token cache. `RetroRunner` therefore
recomputes: it is a runner for the same engine (queue, limits, sampling, streaming,
`PUT /api`, `/v1/completions` unchanged), but it keeps each running sequence's tokens
in its slot (as a Mamba state slot: no prefix caching, one slot per sequence) and runs
each step's sequences whole, right-padded to whole chunks, with the neighbours of
their complete chunks (`mg.core.retro.retrieval`, searched once per chunk per
sequence). The paged pool is only bookkeeping here: it holds no keys or values.

The project is ``--retro-project-dir``, else the one the checkpoint was trained on
(its saved args); it must fit the model's tokenizer and chunk length. One process,
no tensor parallelism, no draft model.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mg.core.checkpoint import CheckpointError
from mg.core.models.paged_kv_cache import GATHERED, PagedSegment
from mg.core.models.retro import RetroConfig, RetroModel
from mg.core.models.vocab_mask import set_real_vocab_size, unpadded_vocab_size
from mg.core.retro.checkpoint import load_retro_checkpoint
from mg.core.retro.project import RetroProjectError
from mg.core.retro.retrieval import Retriever, open_checkpoint_retriever
from mg.core.tokenizers import BaseTokenizer, TokenizerConfig, build_tokenizer
from mg.generate_server.errors import ServeSetupError


@dataclass
class LoadedRetro:
    """What the HTTP side needs of a loaded model (`loading.LoadedModel`'s fields)."""

    model: RetroModel
    config: RetroConfig
    tokenizer: BaseTokenizer
    tokenizer_config: TokenizerConfig
    name: str
    retriever: Retriever
    vlm: None = None


class RetroRunner:
    """The engine's runner for a RetroModel: each step's sequences recomputed whole."""

    recurrent_state = True  # a slot per running sequence (its tokens), no prefix caching
    description = "Retro: each step recomputed, neighbours retrieved per chunk"
    kv_cache_dtype = "auto"
    cache_decode_kernel = None
    fused_decode = None
    packed_linears = 0

    def __init__(
        self, model: RetroModel, retriever: Retriever, num_slots: int, max_length: int
    ) -> None:
        self.model = model.eval()
        self.retriever = retriever
        self.num_slots = num_slots
        self.max_length = max_length
        self.block_size = retriever.chunk_length
        self.num_blocks = num_slots * -(-max_length // self.block_size)
        self.device = next(model.parameters()).device
        self.num_threads = torch.get_num_threads()
        self.heartbeat_seconds: float | None = None
        self.attention_backend = "auto"
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._retrievers: list[Retriever] = [self._fresh() for _ in range(num_slots)]

    def _fresh(self) -> Retriever:
        """A retriever sharing the database, index and BERT, with its own chunk cache."""
        r = self.retriever
        return Retriever(
            r.database, r.index, r.embedder, r.tokenizer, r.num_neighbors, r.num_retrieved_chunks
        )

    def choose_decode_attention(self) -> str:
        return GATHERED

    @torch.inference_mode()
    def forward(
        self,
        segments: Sequence[PagedSegment],
        input_ids: Sequence[int],
        positions: Sequence[int],
        logit_rows: Sequence[int],
        image_rows: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """fp32 logits [len(logit_rows), vocab] on the CPU, as `ModelRunner.forward`."""
        if image_rows is not None:
            raise ValueError("a Retro model takes no images")
        out: dict[int, Tensor] = {}
        wanted = list(logit_rows)
        for segment in segments:
            slot = segment.slot
            if segment.context_start == 0:  # a new (or recomputed) sequence in this slot
                self._tokens[slot] = []
                self._retrievers[slot] = self._fresh()
            tokens = self._tokens[slot][: segment.context_start]
            first = segment.query_start
            tokens += list(input_ids[first : first + segment.query_length])
            self._tokens[slot] = tokens
            rows = [r for r in wanted if first <= r < first + segment.query_length]
            if not rows:
                continue
            logits = self._logits(tokens, self._retrievers[slot])
            for r in rows:
                out[r] = logits[segment.context_start + r - first]
        return torch.stack([out[r] for r in wanted]) if wanted else torch.zeros(0)

    def _logits(self, tokens: list[int], retriever: Retriever) -> Tensor:
        """Logits [len(tokens), vocab] of the sequence padded to whole chunks: a position
        sees only the chunks complete at it (`mg.core.retro.generation` says why)."""
        m = retriever.chunk_length
        s = len(tokens)
        ids = torch.full((1, -(-s // m) * m), retriever.database.eod_token_id, dtype=torch.long)
        ids[0, :s] = torch.tensor(tokens, dtype=torch.long)
        context = torch.from_numpy(retriever.neighbor_tokens(tokens))
        context = context.reshape(-1, context.shape[-1]).to(self.device)
        logits = self.model(ids.to(self.device), context_input_ids=context)
        return logits[0, :s].float().cpu()

    def heartbeat(self) -> None:
        """Nothing to do in one process."""

    def close(self) -> None:
        """Called once by the engine thread when it stops."""


def is_retro_checkpoint(load: str | Path, iteration: Any = None) -> bool:
    # lazy: reading the checkpoint's config only once the flags are good
    from mg.core.retro.checkpoint import is_retro_config, recorded_model_config

    return is_retro_config(recorded_model_config(load, iteration))


def load_retro_for_serving(
    args: argparse.Namespace, device: torch.device, dtype: str | None
) -> LoadedRetro:
    """The checkpoint's RetroModel on ``device`` and its project's retriever; what does not
    fit is a one-line ServeSetupError naming the flag."""
    if getattr(args, "tensor_model_parallel_size", 1) not in (None, 1):
        raise ServeSetupError(
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: {args.load} is a "
            "Retro model, served on one process only; use --tensor-model-parallel-size 1"
        )
    if args.draft_load or args.num_speculative_tokens is not None:
        raise ServeSetupError("--draft-load / --num-speculative-tokens: not for a Retro model")
    if args.enable_cuda_graph or args.enable_torch_compile:
        raise ServeSetupError(
            "--enable-cuda-graph / --enable-torch-compile: a Retro model runs eagerly"
        )
    if args.enable_prefix_caching:
        raise ServeSetupError("--enable-prefix-caching: a Retro model recomputes each step")
    if args.retro_num_neighbors is not None and args.retro_num_neighbors < 1:
        raise ServeSetupError(f"--retro-num-neighbors must be >= 1, got {args.retro_num_neighbors}")
    iteration = args.ckpt_step
    if isinstance(iteration, str) and iteration.isdigit():
        iteration = int(iteration)
    try:
        ckpt = load_retro_checkpoint(args.load, iteration, args.retro_num_neighbors)
    except CheckpointError as err:
        raise ServeSetupError(str(err)) from None
    if ckpt.tokenizer_config is None:
        raise ServeSetupError(f"{args.load} records no tokenizer; a server needs one")
    try:
        tokenizer = build_tokenizer(ckpt.tokenizer_config)
    except (ValueError, OSError) as err:
        raise ServeSetupError(f"{args.load}: cannot build its tokenizer: {err}") from None
    model = ckpt.model
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model = model.to(device).eval()
    set_real_vocab_size(model, unpadded_vocab_size(ckpt.config, tokenizer.vocab_size))
    try:
        # lazy: the indexed datasets only for a Retro model (an optional dependency here)
        from mg.indexed_dataset import IndexedDataset
    except ImportError:
        raise ServeSetupError(
            "serving a Retro model reads its chunk database: pip install mg-indexed-dataset"
        ) from None
    try:  # BERT embeds where the model runs (fp32)
        retriever = open_checkpoint_retriever(
            args.retro_project_dir, ckpt.args, args.load, tokenizer, ckpt.config,
            IndexedDataset, device,
        )  # fmt: skip
    except RetroProjectError as err:
        raise ServeSetupError(str(err)) from None
    name = Path(args.load).resolve().name
    return LoadedRetro(model, ckpt.config, tokenizer, ckpt.tokenizer_config, name, retriever)


def retro_max_length(args: argparse.Namespace, loaded: LoadedRetro) -> int:
    """The positions a sequence may use: the model's (or --inference-max-seq-length),
    in whole chunks, since a step runs the sequence padded to whole chunks."""
    positions = loaded.config.max_position_embeddings
    wanted = args.inference_max_seq_length or positions
    m = loaded.config.retro_chunk_length
    return min(wanted, positions // m * m)
