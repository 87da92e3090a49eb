"""Paged serving steps for tests of a runner's step (mg-serve's fused decode tests): three
sequences prefilled and decoded together, and one sequence alone and among others (the
check that a step's numbers do not depend on what else it holds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mg.core.models.config import RopeScaling
from mg.core.models.paged_kv_cache import PagedSegment

PROMPT_LENGTHS = (7, 2, 11)
TABLES = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
"""`prefill_and_decode`'s three sequences: prompt lengths and block tables (blocks of 4)."""

LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mha-partial-rope": {"num_query_groups": 4, "rotary_percent": 0.5},
    "sliding-window": {"window_size": (5, 0)},
    "llama3-scaling": {"rope_scaling": RopeScaling(8.0, 1.0, 4.0, 16)},
}
"""`presets.tiny_llama` overrides a fused step must serve as the eager model does: grouped
and full multi-head attention, partial RoPE, a sliding window, Llama 3's RoPE scaling."""


def prefill_and_decode(runner: Any, steps: int = 4, vocab: int = 128) -> list[torch.Tensor]:
    """Three prompts (seed 1) in one prefill step, then `steps` decode steps of all three:
    the logits of each step (`forward(segments, ids, positions, rows)` as `ModelRunner`'s;
    at least 3 slots of 4 blocks of 4)."""
    torch.manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in PROMPT_LENGTHS]
    ids, positions, segments, rows = sum(prompts, []), [], [], 0
    for i, prompt in enumerate(prompts):
        segments.append(PagedSegment(rows, len(prompt), 0, TABLES[i]))
        positions += range(len(prompt))
        rows += len(prompt)
    logits = [runner.forward(segments, ids, positions, [0, 1, 2, 6, 8, 19])]
    for step in range(steps):
        decodes = [PagedSegment(i, 1, len(prompts[i]) + step, TABLES[i]) for i in range(3)]
        new = [(11 * step + 5 * i) % vocab for i in range(3)]
        where = [len(prompts[i]) + step for i in range(3)]
        logits.append(runner.forward(decodes, new, where, [0, 1, 2]))
    return logits


def logits_among_others(
    make_runner: Callable[[], Any], mine: list[int], others: int, place: int, vocab: int = 128
) -> list[torch.Tensor]:
    """Sequence 0 (prompt `mine`) prefilled with `others` other sequences' prompts, itself
    at `place` in the step, then 3 decode steps of all: its logits at each step.
    `make_runner()` gives a fresh runner with at least `others + 1` slots of 4 blocks of 4
    (`forward(segments, ids, positions, rows)` as `ModelRunner`'s)."""
    runner = make_runner()
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(others + 1)]
    order = list(range(1, others + 1))
    order.insert(place, 0)
    lengths = {0: len(mine), **{k: 3 + k for k in order if k}}
    prompts = {0: mine, **{k: [(7 * k + j) % vocab for j in range(lengths[k])] for k in order}}
    segments, ids, positions, rows, mine_row = [], [], [], 0, 0
    for k in order:
        if k == 0:
            mine_row = rows + len(mine) - 1
        segments.append(PagedSegment(rows, lengths[k], 0, tables[k]))
        ids += prompts[k]
        positions += range(lengths[k])
        rows += lengths[k]
    logits = [runner.forward(segments, ids, positions, [mine_row])[0]]
    for step in range(3):
        decodes = [PagedSegment(k, 1, lengths[k] + step, tables[k]) for k in order]
        new = [(13 * step + k) % vocab for k in order]
        where = [lengths[k] + step for k in order]
        logits.append(runner.forward(decodes, new, where, [place])[0])
    return logits


def assert_logits_do_not_depend_on_the_batch(
    make_runner: Callable[[], Any],
    places: tuple[tuple[int, int], ...] = ((1, 1), (3, 0), (5, 2), (8, 8)),
    vocab: int = 128,
) -> None:
    """A 6-token sequence's prompt and decode logits alone, then among (others, its place)
    of `places`: bitwise equal each time (`make_runner()`: a fresh runner with 9 slots)."""
    torch.manual_seed(2)
    mine = torch.randint(0, vocab, (6,)).tolist()
    alone = logits_among_others(make_runner, mine, 0, 0, vocab)
    for others, place in places:
        among = logits_among_others(make_runner, mine, others, place, vocab)
        for want, got in zip(alone, among, strict=True):
            assert torch.equal(got, want), (others, place)


def bf16_rounding_model() -> Any:
    """A one-layer bf16 Llama with larger weights and norm weights other than 1, where a
    rounding to bf16 missed or doubled shows in the decode logits (a fused step's against
    the eager model's: all bitwise equal when each op rounds where eager's does, a fifth to
    a third with one rounding missed or doubled)."""
    from mg.core.models import GPTModel, presets  # lazy: the testing helpers import light

    torch.manual_seed(0)
    config = presets.tiny_llama(
        hidden_dropout=0.0, attention_dropout=0.0, num_layers=1, init_method_std=0.2
    )
    model = GPTModel(config).eval()
    for name, weight in model.named_parameters():
        if "layernorm" in name:
            nn.init.normal_(weight, 1.0, 0.3)
    return model.to(torch.bfloat16)


def assert_prompt_chunks_do_not_change_logits(
    make_runner: Callable[[], Any], length: int = 60, chunk: int = 5, vocab: int = 128
) -> None:
    """A `length`-token prompt in one step and in steps of `chunk` tokens: every row's logits
    bitwise equal (a fused step takes the GEMM form for the long step and the dot-product
    form for the short ones; `make_runner()`: a fresh runner with one slot of `length` + 4
    positions in blocks of 4)."""
    torch.manual_seed(4)
    prompt = torch.randint(0, vocab, (length,)).tolist()
    table = list(range(-(-length // 4) + 1))
    rows = list(range(length))
    whole = make_runner().forward([PagedSegment(0, length, 0, table)], prompt, rows, rows)
    runner = make_runner()
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        part = runner.forward(
            [PagedSegment(0, end - start, start, table)],
            prompt[start:end],
            rows[start:end],
            list(range(end - start)),
        )
        assert torch.equal(part, whole[start:end]), f"rows {start}-{end - 1}"
