"""Mamba-2's PyTorch path (the chunked SSD scan, the causal conv1d, the gated RMSNorm) on
the device: a tiny hybrid model's logits and gradients equal the CPU's in fp32, and its
bf16 autocast forward stays within bf16 rounding of them."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from gpu_device import DEVICE, needs_device, relative_error

from mg.core.models.mamba import MambaModel, tiny_hybrid

pytestmark = needs_device


def _forward_backward(model, ids: torch.Tensor, bf16: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    return logits.detach().float().cpu(), grads


def _models():
    config = tiny_hybrid(  # M: Mamba, *: attention, -: MLP; sequence over 3 chunks of 8
        vocab_size=256, hybrid_override_pattern="M*M-", num_layers=4, init_method_std=0.02
    )
    torch.manual_seed(0)
    cpu = MambaModel(config)
    ids = torch.randint(0, 256, (2, 25), generator=torch.Generator().manual_seed(0))
    return cpu, copy.deepcopy(cpu).to(DEVICE), ids


def test_fp32_on_the_device_equals_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the conv1d in fp32
    cpu, device, ids = _models()
    expected, expected_grads = _forward_backward(cpu, ids)
    logits, grads = _forward_backward(device, ids.to(DEVICE))
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)
    errors = {n: relative_error(grads[n], expected_grads[n]) for n in expected_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-2, (worst, errors[worst])


def test_bf16_autocast_on_the_device_is_within_bf16_of_fp32() -> None:
    cpu, device, ids = _models()
    expected, expected_grads = _forward_backward(cpu, ids)
    logits, grads = _forward_backward(device, ids.to(DEVICE), bf16=True)
    torch.testing.assert_close(logits, expected, rtol=5e-2, atol=5e-2)
    errors = {n: relative_error(grads[n], expected_grads[n]) for n in expected_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-1, (worst, errors[worst])
