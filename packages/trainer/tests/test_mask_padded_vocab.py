"""--mask-padded-vocab: the output layer's padding rows take no probability in the loss.

Megatron pads the vocabulary (here 128 ids to 200 rows with
--make-vocab-size-divisible-by 100); its loss keeps the padding rows in the
softmax, and so does mg-train by default. With the flag the loss is the
cross-entropy over the tokenizer's rows only, fused or not, and the padding
rows of the (tied) output weight get no gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mg.core.models.vocab_mask import set_real_vocab_size
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.training import Trainer

FLAGS = [
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--make-vocab-size-divisible-by",
    "100",
]


def _loss_and_grad(trainer: Trainer, batch: dict[str, torch.Tensor]):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], labels=batch["labels"])
    loss.sum().backward()
    return loss.detach(), model.embedding.word_embeddings.weight.grad.clone()


def test_loss_over_the_tokenizers_rows_only(tmp_path: Path, mock_argv) -> None:
    masked = Trainer(parse_args(mock_argv(tmp_path, *FLAGS, "--mask-padded-vocab")))
    fused = Trainer(
        parse_args(
            mock_argv(tmp_path, *FLAGS, "--mask-padded-vocab", "--cross-entropy-loss-fusion")
        )
    )
    model = masked.model
    real = masked.tokenizer.vocab_size
    rows = model.embedding.word_embeddings.weight.shape[0]
    assert (real, rows) == (128, 200)
    batch = next(masked.train_data)

    loss, grad = _loss_and_grad(masked, batch)
    with torch.no_grad():
        logits = model(batch["tokens"])
    assert torch.isinf(logits[..., real:]).all() and torch.isfinite(logits[..., :real]).all()
    reference = F.cross_entropy(
        logits[..., :real].flatten(0, 1), batch["labels"].flatten(), reduction="none"
    ).view(batch["labels"].shape)
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    assert grad[real:].abs().max() == 0  # the padding rows learn nothing

    fused.model.load_state_dict(model.state_dict())
    fused_loss, fused_grad = _loss_and_grad(fused, batch)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, grad, rtol=1e-4, atol=1e-6)

    set_real_vocab_size(model, None)  # Megatron's loss: the padding rows take probability
    unmasked, unmasked_grad = _loss_and_grad(masked, batch)
    assert (unmasked > loss).all()
    assert unmasked_grad[real:].abs().max() > 0


def test_refused_for_families_without_it(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="^--mask-padded-vocab"):
        parse_args(
            [
                "bert",
                *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
                *("--seq-length", "32", "--max-position-embeddings", "32"),
                *("--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1"),
                *("--mock-data", "--vocab-size", "127", "--lr", "1e-3", "--mask-padded-vocab"),
            ]
        )
