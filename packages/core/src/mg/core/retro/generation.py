"""Greedy generation with a Retro model, neighbours retrieved as the text grows.

Full recompute: every step runs the whole sequence, right-padded with end-of-document
tokens to whole chunks, with the neighbours of its complete chunks (`Retriever`), and
takes the prediction at the last real token. The padding cannot change it: self-
attention is causal and a chunk's neighbours are attended only from its last token on,
so an incomplete chunk's (padded) rows are seen by padding alone. No KV cache: a new
complete chunk changes what every later token attends to, as in Megatron's Retro text
generation, which also recomputes the whole sequence each step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from mg.core.models.retro import RetroModel
from mg.core.retro.retrieval import Retriever


def longest_sequence(model: RetroModel, chunk_length: int) -> int:
    """The most tokens a step may run (the model's positions, in whole chunks)."""
    return (model.config.max_position_embeddings // chunk_length) * chunk_length


@torch.inference_mode()
def next_token_logits(
    model: RetroModel, retriever: Retriever, tokens: Sequence[int]
) -> torch.Tensor:
    """The logits [vocab] after ``tokens``, with their chunks' neighbours retrieved."""
    m = retriever.chunk_length
    s = len(tokens)
    padded = -(-s // m) * m
    device = model.embedding.word_embeddings.weight.device
    ids = torch.full((1, padded), retriever.database.eod_token_id, dtype=torch.long)
    ids[0, :s] = torch.as_tensor(list(tokens), dtype=torch.long)
    context = torch.from_numpy(retriever.neighbor_tokens(tokens))
    logits = model(
        ids.to(device), context_input_ids=context.reshape(-1, context.shape[-1]).to(device)
    )
    return logits[0, s - 1].float()


def retro_greedy_generate(
    model: RetroModel,
    retriever: Retriever,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
) -> list[int]:
    """Up to ``max_new_tokens`` greedy tokens after ``prompt`` (the stop token included
    when one ends it); stops early at the model's longest sequence."""
    if not prompt:
        raise ValueError("an empty prompt: Retro generation needs at least one token")
    limit = longest_sequence(model, retriever.chunk_length)
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_new_tokens and len(tokens) < limit:
        token = int(next_token_logits(model, retriever, tokens).argmax())
        tokens.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out
