"""The experts: E small MLPs, run on the tokens routed to each, in two layouts.

Both take the dispatched tokens grouped by expert (`tokens_per_expert[i]`
rows for local expert i, in order) with each row's routing probability, and
compute Megatron's expert MLP:

    out = p · (linear_fc2(act(linear_fc1(x))))  with the bias of fc2 also times p

(the probability multiplies the activation before fc2, as Megatron-Core 0.16
does, so a dropped or padded row of probability 0 contributes nothing).

- `SequentialMLP`: one `ExpertMLP` per expert, `local_experts.{i}.linear_fc1.weight`
  (Megatron's `SequentialMLP` names).
- `GroupedMLP`: all experts' weights as `linear_fc1.weight{i}` / `linear_fc2.weight{i}`
  (Megatron's `TEGroupedMLP` names), multiplied in one `torch._grouped_mm` call
  where that kernel runs, else expert by expert; the results equal
  SequentialMLP's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.activations import activate
from mg.core.models.config import TransformerConfig
from mg.core.models.local_tensor import local
from mg.core.models.recompute_state import DiscardedOutput


def _activate(hidden: Tensor, config: TransformerConfig) -> Tensor:
    return activate(hidden, config)  # gated: [gate; up] rows of linear_fc1


def _product(linear: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """x·Wᵀ (+ bias); an mg-quantize'd linear (no .weight) through its own kernel."""
    if isinstance(linear, nn.Linear):
        return F.linear(x, local(linear.weight), bias)
    out = linear.matmul(x)
    return out if bias is None else out + bias


class ExpertMLP(nn.Module):
    """One expert (or the shared experts): linear_fc1 → act → linear_fc2, width `ffn`."""

    fc2_bias_scale = 1.0
    """1/tp under tensor parallelism: each TP rank adds its share of the bias to its
    partial output (mg.core.models.moe.tensor_parallel)."""

    def __init__(self, config: TransformerConfig, ffn: int) -> None:
        super().__init__()
        self.config = config
        fc1 = ffn * (2 if config.gated_linear_unit else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(ffn, config.hidden_size, bias=config.add_bias_linear)

    @torch.no_grad()
    def init_weights(self, std: float, output_std: float) -> None:
        for linear, sigma in ((self.linear_fc1, std), (self.linear_fc2, output_std)):
            nn.init.normal_(linear.weight, mean=0.0, std=sigma)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, hidden: Tensor, probs: Tensor | None = None) -> Tensor:
        # local(): a tensor-parallel rank's slices (mg.core.models.moe.tensor_parallel)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        bias1 = None if fc1.bias is None else local(fc1.bias)
        bias2 = None if fc2.bias is None else local(fc2.bias) * self.fc2_bias_scale
        hidden = _activate(_product(fc1, hidden, bias1), self.config)
        if probs is None:
            return _product(fc2, hidden, bias2)
        hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
        out = _product(fc2, hidden)
        if bias2 is not None:
            out = out + bias2.unsqueeze(0) * probs.unsqueeze(-1)
        return out


class SequentialMLP(nn.Module):
    """The local experts one after another (`local_experts.{i}`)."""

    def __init__(self, config: TransformerConfig, num_local_experts: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(
            ExpertMLP(config, config.moe_ffn_hidden_size) for _ in range(num_local_experts)
        )

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)

    def init_weights(self, std: float, output_std: float) -> None:
        for expert in self.local_experts:
            expert.init_weights(std, output_std)

    def keep_experts(self, indices: Sequence[int]) -> None:
        """Drop all but these experts (expert parallelism), renumbered from 0."""
        self.local_experts = nn.ModuleList(self.local_experts[i] for i in indices)

    def forward(self, tokens: Tensor, tokens_per_expert: list[int], probs: Tensor) -> Tensor:
        chunks = zip(
            self.local_experts,
            tokens.split(tokens_per_expert),
            probs.split(tokens_per_expert),
            strict=True,
        )
        return torch.cat([expert(x, p) for expert, x, p in chunks], dim=0)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (`_grouped_mm` on CPU
    rejects the expanded gradient a `.sum()` produces)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


_GROUPED_MM_FAILED: set[tuple[str, torch.dtype]] = set()


def grouped_mm_linear(x: Tensor, weights: Sequence[Tensor], tokens_per_expert: list[int]) -> Tensor:
    """`grouped_linear` as one `torch._grouped_mm` call (any device where it runs)."""
    w = torch.stack(list(weights))  # [E, out, in]
    offsets = torch.tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(1, 2), offs=offsets))


def grouped_linear(x: Tensor, weights: Sequence[Tensor], tokens_per_expert: list[int]) -> Tensor:
    """Rows of `x` grouped by expert times each expert's weight [out, in]: one grouped GEMM.

    On CUDA, `torch._grouped_mm` (rows 16-byte aligned). Elsewhere, and where that
    kernel refuses the shape or dtype, the experts are multiplied one by one: on a
    CPU the kernel is itself a loop, and stacking the weights for it costs a copy
    of every expert per call (bench/bench_moe.py measured it slower)."""
    key = (x.device.type, x.dtype)
    aligned = all(n * x.element_size() % 16 == 0 for n in weights[0].shape)
    if x.is_cuda and hasattr(torch, "_grouped_mm") and aligned and key not in _GROUPED_MM_FAILED:
        try:
            return grouped_mm_linear(x, weights, tokens_per_expert)
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_FAILED.add(key)
    parts = [F.linear(xi, wi) for xi, wi in zip(x.split(tokens_per_expert), weights, strict=True)]
    return torch.cat(parts, dim=0)


class GroupedLinear(nn.Module):
    """E linears of the same shape as parameters `weight{i}` (and `bias{i}`), TE's names."""

    bias_scale = 1.0  # 1/tp for a row-parallel one's biases (see ExpertMLP.fc2_bias_scale)

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(
                f"weight{i}", nn.Parameter(torch.empty(out_features, in_features))
            )
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(out_features)))
        self.has_bias = bias

    def params(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def weights(self) -> list[Tensor]:
        """The GEMMs' weights (a tensor-parallel rank's slices)."""
        return [local(getattr(self, f"weight{i}")) for i in range(self.num_gemms)]

    def bias_params(self) -> list[nn.Parameter]:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.has_bias else []

    def biases(self) -> list[Tensor]:
        """The GEMMs' biases (a tensor-parallel rank's slices, or its share: `bias_scale`)."""
        return [local(b) * self.bias_scale for b in self.bias_params()]

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        for w in self.params():
            nn.init.normal_(w, mean=0.0, std=std)
        for b in self.bias_params():
            nn.init.zeros_(b)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep these GEMMs only, renumbered weight0.. (expert parallelism)."""
        weights, biases = self.params(), self.bias_params()
        for i in range(self.num_gemms):
            delattr(self, f"weight{i}")
            if self.has_bias:
                delattr(self, f"bias{i}")
        for new, old in enumerate(indices):
            self.register_parameter(f"weight{new}", weights[old])
            if self.has_bias:
                self.register_parameter(f"bias{new}", biases[old])
        self.num_gemms = len(indices)

    def bias_per_row(self, tokens_per_expert: list[int], device: torch.device) -> Tensor:
        counts = torch.tensor(tokens_per_expert, device=device)
        return torch.stack(self.biases()).repeat_interleave(counts, dim=0)


class GroupedMLP(nn.Module):
    """All local experts in grouped GEMMs (`linear_fc1.weight{i}`, `linear_fc2.weight{i}`)."""

    recompute_activation = False
    """Megatron's `moe_act` recompute (`mg.core.models.recompute`)."""

    def __init__(self, config: TransformerConfig, num_local_experts: int) -> None:
        super().__init__()
        self.config = config
        ffn = config.moe_ffn_hidden_size
        fc1 = ffn * (2 if config.gated_linear_unit else 1)
        bias = config.add_bias_linear
        self.linear_fc1 = GroupedLinear(num_local_experts, config.hidden_size, fc1, bias)
        self.linear_fc2 = GroupedLinear(num_local_experts, ffn, config.hidden_size, bias)

    @property
    def num_local_experts(self) -> int:
        return self.linear_fc1.num_gemms

    def init_weights(self, std: float, output_std: float) -> None:
        # expert by expert, fc1 then fc2: the random draws of SequentialMLP's init
        for i in range(self.num_local_experts):
            for linear, sigma in ((self.linear_fc1, std), (self.linear_fc2, output_std)):
                with torch.no_grad():
                    nn.init.normal_(getattr(linear, f"weight{i}"), mean=0.0, std=sigma)
                    if linear.has_bias:
                        getattr(linear, f"bias{i}").zero_()

    def keep_experts(self, indices: Sequence[int]) -> None:
        self.linear_fc1.keep(indices)
        self.linear_fc2.keep(indices)

    def activation(self, hidden: Tensor, probs: Tensor) -> Tensor:
        """act(fc1 output) times each row's routing probability: linear_fc2's input."""
        out = _activate(hidden, self.config)
        return (out * probs.unsqueeze(-1)).to(out.dtype)

    def forward(self, tokens: Tensor, tokens_per_expert: list[int], probs: Tensor) -> Tensor:
        hidden = grouped_linear(tokens, self.linear_fc1.weights(), tokens_per_expert)
        if self.linear_fc1.has_bias:
            hidden = hidden + self.linear_fc1.bias_per_row(tokens_per_expert, hidden.device)
        # --recompute-modules moe_act: the activation's output is freed once linear_fc2 has
        # saved it, and recomputed when the backward pass reaches linear_fc2
        act = DiscardedOutput(self.activation) if self.recompute_activation else None
        hidden = act.run(hidden, probs) if act is not None else self.activation(hidden, probs)
        out = grouped_linear(hidden, self.linear_fc2.weights(), tokens_per_expert)
        if act is not None:
            act.discard(out)
        if self.linear_fc2.has_bias:
            bias = self.linear_fc2.bias_per_row(tokens_per_expert, out.device)
            out = out + bias * probs.unsqueeze(-1)
        return out


class SharedExpertMLP(ExpertMLP):
    """Experts every token goes through (`shared_experts.*`), optionally gated by
    sigmoid(x · gate_weight) as in Qwen2-MoE (`shared_experts.gate_weight` [1, h])."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config, config.moe_shared_expert_intermediate_size)
        self.gate_weight = (
            nn.Parameter(torch.empty(1, config.hidden_size))
            if config.moe_shared_expert_gate
            else None
        )

    @torch.no_grad()
    def init_weights(self, std: float, output_std: float) -> None:
        super().init_weights(std, output_std)
        if self.gate_weight is not None:
            nn.init.normal_(self.gate_weight, mean=0.0, std=std)

    def forward(self, hidden: Tensor, probs: Tensor | None = None) -> Tensor:
        out = super().forward(hidden)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden, local(self.gate_weight)))
        return out
