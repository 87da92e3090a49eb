"""Output layer and cross-entropy fused, a few tokens at a time (`--cross-entropy-loss-fusion`).

The unfused loss materialises the logits [tokens, vocab] in fp32 (412 MB for
2048 tokens of GPT-2's 50304 ids), runs log-softmax over them and, in backward,
log-softmax's backward over them again. Here each chunk of tokens computes its
logits (in the autocast dtype, as the unfused output layer does), turns them
into the per-token loss and, while they are still in cache, into the gradient
of that loss with respect to the logits, softmax − one-hot, in place (in fp32
the chunk's logits are computed into the stored gradient itself), which is all
backward needs: the two matmuls, each token's incoming gradient scaling its row
of the hidden states or of the result rather than the [tokens, vocab] gradient.
No fp32 logits stay alive beside it, and the vocabulary is swept twice fewer.

Results equal the unfused path's up to rounding (the same matmul precision and
fp32 softmax; the stored gradient is rounded to the compute dtype once, as the
unfused backward rounds it before its matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mg.core.models.language_model import LanguageModel
from mg.core.models.output_head import HasOutputWeight, OutputHead, is_plain_output, real_vocab_size
from mg.core.models.vocab_mask import mask_padded_vocab

DEFAULT_CHUNK_TOKENS = 256
"""Tokens per chunk: their fp32 logits (256 x vocab) stay in a CPU's last-level cache,
and the matmul is big enough to run at the library's full speed (MKL's fp32 GEMM of
256 x 512 x 50304 runs 8% faster than at 128 rows with AVX2)."""


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int, real_vocab: int | None
    ) -> Tensor:
        dtype = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            w = weight.to(dtype)
            tokens, vocab = h.shape[0], w.shape[0]
            loss = torch.empty(tokens, dtype=torch.float32, device=h.device)
            grad_logits = torch.empty(tokens, vocab, dtype=dtype, device=h.device)
            for start in range(0, tokens, chunk):
                end = min(tokens, start + chunk)
                target = labels[start:end].unsqueeze(1)
                in_place = dtype == torch.float32  # computed where the gradient is kept
                if in_place:
                    logits = torch.mm(h[start:end], w.t(), out=grad_logits[start:end])
                else:
                    logits = (h[start:end] @ w.t()).float()
                if real_vocab is not None and real_vocab < vocab:
                    logits[:, real_vocab:] = float("-inf")  # the padding takes no probability
                picked = logits.gather(1, target)
                peak = logits.amax(dim=-1, keepdim=True)
                exps = logits.sub_(peak).exp_()  # in place: five passes over the chunk in all
                total = exps.sum(dim=-1, keepdim=True)
                loss[start:end] = (peak + total.log() - picked).squeeze(1)
                probs = exps.div_(total)
                probs.scatter_add_(1, target, torch.full_like(target, -1, dtype=probs.dtype))
                if not in_place:
                    grad_logits[start:end] = probs
        ctx.save_for_backward(h, w, grad_logits)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        h, w, grad_logits = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # Each token's incoming gradient scales its row of the small operands, not the
        # [tokens, vocab] gradient: no second buffer of the logits' size.
        scale = grad_loss.to(grad_logits.dtype).unsqueeze(1)
        grad_hidden = ((grad_logits @ w) * scale).to(hidden_dtype)
        grad_weight = (grad_logits.t() @ (h * scale)).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    real_vocab_size: int | None = None,
) -> Tensor:
    """Per-token cross-entropy (fp32, shaped like `labels`) of `hidden @ weight.T`; the
    rows >= real_vocab_size (the padding) take no probability when it is given."""
    vocab = weight.shape[0] if real_vocab_size is None else min(weight.shape[0], real_vocab_size)
    flat_labels = labels.reshape(-1)
    if flat_labels.numel() and (flat_labels.min() < 0 or flat_labels.max() >= vocab):
        raise ValueError(f"labels must be token ids in [0, {vocab}); got values outside it")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    loss = _LinearCrossEntropy.apply(
        flat_hidden, weight, flat_labels, chunk_tokens, real_vocab_size
    )
    return loss.view(labels.shape)


class FusedCrossEntropyHead(OutputHead):
    """The loss by `linear_cross_entropy` (no bias: a decoder language model's output);
    logits without labels as the plain head makes them."""

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.chunk_tokens = chunk_tokens

    def __call__(self, model: HasOutputWeight, hidden: Tensor, labels: Tensor | None) -> Tensor:
        weight = model.output_weight()
        vocab = real_vocab_size(model)
        if labels is None:
            return mask_padded_vocab(F.linear(hidden, weight), vocab)
        return linear_cross_entropy(hidden, weight, labels, self.chunk_tokens, vocab)

    def __repr__(self) -> str:
        return f"FusedCrossEntropyHead(chunk_tokens={self.chunk_tokens})"


def apply_cross_entropy_fusion(model: LanguageModel) -> LanguageModel:
    """Give a GPTModel the fused loss (`FusedCrossEntropyHead`); returns the model.

    Before pipeline splitting (the last chunk takes the whole model's head) and on the
    plain output only: tensor parallelism has its own vocab-parallel loss."""
    if not isinstance(model, LanguageModel):
        raise TypeError(
            "cross-entropy fusion applies to a decoder language model (GPTModel, "
            f"MambaModel), not {type(model).__name__}: the fused loss takes no output bias"
        )
    if not is_plain_output(model):
        raise ValueError(
            f"the model's output is already {model.output_head!r} (tensor parallelism has "
            "its own vocab-parallel loss); cross-entropy fusion applies to a plain GPTModel"
        )
    model.output_head = FusedCrossEntropyHead()
    return model
