"""A few training steps on Botchan, for tests that need a model whose predictions are words."""

from __future__ import annotations

import torch
from torch import nn

from mg.core.fixtures import fixture_path


def train_on_botchan(
    model: nn.Module,
    tokenizer,
    *,
    steps: int,
    window: int,
    batch_size: int,
    text_end: int,
) -> nn.Module:
    """AdamW (lr 3e-3) on random `window`-token slices of Botchan's characters
    20000:`text_end`, seeded, so tests that share a checkpoint shape share its weights."""
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")[20000:text_end]
    ids = torch.tensor(tokenizer.tokenize(text))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - window - 1, (batch_size,), generator=generator)
        batch = torch.stack([ids[s : s + window + 1] for s in starts.tolist()])
        loss = model(batch[:, :-1], labels=batch[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
