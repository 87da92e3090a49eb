"""Every --attention-backend on the device, in bf16 autocast as --bf16 trains: a tiny GPT's
logits and gradients (forward and backward through the chosen SDPA kernels; flash-attn's
where it is installed for flash) equal the math kernel's (unfused) within bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_device import DEVICE, cuda_only, needs_device, relative_error

from mg.core.models import GPTModel, presets
from mg.core.models.attention_backend import CUDA_ONLY, choices
from mg.core.models.core_attention import set_attention_backend

pytestmark = needs_device

LOGITS_TOLERANCE = 3e-2  # absolute and relative, bf16 logits of order 1
GRAD_TOLERANCE = 3e-2  # ‖Δgrad‖ / ‖grad‖ per parameter


def _forward_backward(model: GPTModel, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach().float(), grads


@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=cuda_only) if b in CUDA_ONLY else b for b in choices()]
)
def test_backend_matches_the_math_kernel_forward_and_backward(backend: str) -> None:
    # 4 heads of 64 (a head size every CUDA kernel takes); one key/value head per query
    # head, as not every fused kernel takes grouped queries (core's tests check GQA)
    config = presets.tiny_llama(
        attention_backend="unfused",
        attention_dropout=0.0,
        hidden_dropout=0.0,
        kv_channels=64,
        num_query_groups=4,
    )
    torch.manual_seed(0)
    model = GPTModel(config).to(DEVICE)
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    ids = ids.to(DEVICE)
    reference, reference_grads = _forward_backward(model, ids)
    set_attention_backend(model, backend)
    logits, grads = _forward_backward(model, ids)
    assert logits.device.type == DEVICE.type
    torch.testing.assert_close(logits, reference, rtol=LOGITS_TOLERANCE, atol=LOGITS_TOLERANCE)
    errors = {n: relative_error(grads[n], reference_grads[n]) for n in reference_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_TOLERANCE, (worst, errors[worst])
