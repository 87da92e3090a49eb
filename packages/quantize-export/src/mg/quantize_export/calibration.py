"""Calibration data and the activation statistics the recipes need.

Samples are ``--calib-samples`` windows of ``--calib-seq-length`` tokens cut from the
documents of one or more indexed datasets (a blend: ``PREFIX`` or ``W1 P1 W2 P2``),
taken in order, so a run is reproducible. Statistics are gathered by forward hooks
on the linears being quantized (on an MoE expert, which multiplies by its linears'
weights without calling them, on the expert); their inputs are what matter.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from mg.core.models.activations import activate
from mg.core.models.moe.experts import ExpertMLP
from mg.indexed_dataset import IndexedDataset, IndexedDatasetError
from mg.quantize_export.errors import QuantizeInputError


def parse_blend(words: Sequence[str]) -> list[tuple[float, str]]:
    """``[PREFIX]`` or ``[W1, P1, W2, P2, ...]`` → [(weight, prefix)]."""
    if len(words) == 1:
        return [(1.0, words[0])]
    if len(words) % 2:
        raise QuantizeInputError(
            "--calib-data-path takes one prefix or weight/prefix pairs (0.7 a 0.3 b)"
        )
    try:
        return [(float(words[i]), words[i + 1]) for i in range(0, len(words), 2)]
    except ValueError:
        raise QuantizeInputError(
            "--calib-data-path: with several prefixes each one needs a weight before it"
        ) from None


def calibration_samples(
    blend: Sequence[str], samples: int, seq_length: int, vocab_size: int
) -> Tensor:
    """[samples, seq_length] token ids from the blend, each dataset giving its share."""
    parts = parse_blend(blend)
    total = sum(w for w, _ in parts)
    rows: list[np.ndarray] = []
    for k, (weight, prefix) in enumerate(parts):
        share = samples - len(rows) if k == len(parts) - 1 else round(samples * weight / total)
        try:
            dataset = IndexedDataset(prefix)
        except (IndexedDatasetError, OSError, ValueError) as exc:
            raise QuantizeInputError(f"--calib-data-path {prefix}: {exc}") from None
        buffer: list[np.ndarray] = []
        have = 0
        for i in range(len(dataset)):
            if have >= share * seq_length:
                break
            tokens = np.asarray(dataset[i], dtype=np.int64)
            buffer.append(tokens)
            have += len(tokens)
        stream = np.concatenate(buffer) if buffer else np.zeros(0, dtype=np.int64)
        count = min(share, len(stream) // seq_length)
        if count < share:
            raise QuantizeInputError(
                f"--calib-data-path {prefix} holds {len(stream)} tokens: not enough for "
                f"{share} samples of {seq_length}; lower --calib-samples or --calib-seq-length"
            )
        rows += list(stream[: count * seq_length].reshape(count, seq_length))
        top = int(stream.max()) if len(stream) else 0
        if top >= vocab_size:
            raise QuantizeInputError(
                f"--calib-data-path {prefix} has token id {top}, but the model's tokenizer has "
                f"{vocab_size} tokens: the data was made with another tokenizer; re-run "
                "mg-prep with the checkpoint's tokenizer"
            )
    return torch.from_numpy(np.stack(rows))


class Progress:
    """One line on stderr, rewritten: what is running, samples done, samples/s."""

    def __init__(self, what: str, total: int, enabled: bool = True) -> None:
        self.what, self.total, self.enabled = what, total, enabled
        self.start, self.done = time.perf_counter(), 0

    def update(self, n: int) -> None:
        self.done += n
        if self.enabled:
            rate = self.done / max(time.perf_counter() - self.start, 1e-9)
            end = "\n" if self.done >= self.total else ""
            print(
                f"\r{self.what}: {self.done}/{self.total} samples, {rate:.1f} samples/s",
                end=end,
                file=sys.stderr,
                flush=True,
            )


@torch.no_grad()
def run_with_hooks(
    model: nn.Module,
    samples: Tensor,
    observers: dict[str, Callable[[Tensor], None]],
    batch_size: int = 4,
    progress: Progress | None = None,
) -> None:
    """Forward the samples through the model; each named module's input goes to its observer."""
    handles = []
    for name, observe in observers.items():
        module = model.get_submodule(name)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else None
        if isinstance(parent, ExpertMLP):  # an expert computes with its linears' weights
            hook = functools.partial(_observe_expert_linear, leaf=leaf, observe=observe)
            handles.append(parent.register_forward_hook(hook))
            continue
        handles.append(
            module.register_forward_hook(lambda _m, args, _out, f=observe: f(args[0].detach()))
        )
    try:
        mtp = getattr(model, "mtp", None) is not None
        for start in range(0, len(samples), batch_size):
            batch = samples[start : start + batch_size]
            if mtp:  # the multi-token prediction layers run only given labels
                model(batch, labels=batch.roll(-1, dims=1), return_mtp=True)
            else:
                model(batch)
            if progress is not None:
                progress.update(len(batch))
    finally:
        for handle in handles:
            handle.remove()


def _observe_expert_linear(
    expert: nn.Module, args: tuple, _out: Tensor, *, leaf: str, observe: Callable
) -> None:
    """Hand `observe` the input of the expert's `leaf` linear: the expert's input for
    linear_fc1; for linear_fc2, act(linear_fc1(x)) times each row's routing probability,
    as the expert computes it (it multiplies by its linears' weights, so hooks on them
    would see nothing)."""
    hidden = args[0].detach()
    if len(hidden) == 0:  # no token was routed to this expert
        return
    if leaf == "linear_fc1":
        observe(hidden)
        return
    hidden = activate(expert.linear_fc1(hidden), expert.config)
    probs = args[1] if len(args) > 1 else None
    observe(hidden if probs is None else hidden * probs.detach().unsqueeze(-1))


class AbsMax:
    """Per-input-channel max |x|."""

    def __init__(self) -> None:
        self.value: Tensor | None = None

    def __call__(self, x: Tensor) -> None:
        if x.numel() == 0:  # an expert no token was routed to
            return
        m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        self.value = m if self.value is None else torch.maximum(self.value, m)


class RowSample:
    """Keeps up to ``limit`` input rows (tokens), for AWQ's output-error search."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit, self.rows = limit, []
        self.count = 0

    def __call__(self, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if len(x) and self.count < self.limit:  # an expert no token was routed to: nothing
            self.rows.append(x[: self.limit - self.count])
            self.count += len(self.rows[-1])

    def value(self) -> Tensor | None:
        """The rows seen, or None where the linear saw none (an expert never routed to)."""
        return torch.cat(self.rows) if self.rows else None


def layer_prefixes(names: Iterable[str]) -> list[str]:
    """``decoder.layers.{i}`` groups of the given linear names, in layer order (others last)."""
    seen: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[:2] == ["decoder", "layers"] else name
        seen.setdefault(key, None)
    return list(seen)
