"""How the next token is chosen from a row of logits: greedy, temperature, top-k, top-p.

The rules are Megatron's (`megatron/core/inference/sampling` / text_generation's
`sample`): top_k == 1 is greedy (argmax); otherwise logits are divided by the
temperature, filtered by top-k and then top-p (Megatron's API allows only one of
the two; the OpenAI endpoints allow both), and one token is drawn from the
softmax. Reported log-probabilities are those of the model's raw
logits, before any of this, as Megatron's `output_log_probs` are, and are computed
only for the requests that ask for them.

A step's tokens are chosen together (`choose_tokens`): the logit changes are made
on one copy of the rows that sample, every greedy row takes its token from one
reduction, and only the rows that sample at random go one by one.

Each request draws from its own `torch.Generator`, so the same seed gives the
same tokens whatever else is being generated at the same time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides one request's tokens, already validated by the API layer."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    """After each token, top_p *= top_p_decay (Megatron's field; 0 = off)."""
    top_p_bound: float = 0.0
    """top_p never decays below this."""
    greedy: bool = False
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    """Generating one of these ends the request (finish reason "stop")."""
    stop_strings: tuple[str, ...] = ()
    """The completion text ending in one of these ends the request."""
    banned_after: tuple[tuple[int, int], ...] = ()
    """(previous token, token) pairs: `token` may not follow `previous`
    (Megatron's prevent_newline_after_colon)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    """Report each generated token's log-probability (computed only when asked)."""
    top_logprobs: int = 0
    """How many of the most likely tokens to report with each generated token
    (more than 0 implies `logprobs`)."""
    prompt_logprobs: bool = False
    """Also report the log-probability of each prompt token after the first."""

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.top_k == 1

    @property
    def reports_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


@dataclass
class TokenChoice:
    token: int
    logprob: float | None
    """log p(token) under the raw logits; None where the request did not ask for it."""
    top: list[tuple[int, float]]
    """The `top_logprobs` most likely (token, logprob), most likely first."""


@dataclass(frozen=True)
class RowState:
    """What one sequence's next token depends on besides its row of logits."""

    params: SamplingParams
    top_p: float
    """The current top-p (it decays as tokens are generated)."""
    generator: torch.Generator
    previous: int | None
    """The token before this one (Megatron's banned pairs)."""
    generated: Sequence[int]
    """The tokens generated so far (presence and frequency penalties)."""


MAX_SEED = 2**64 - 1
"""The largest seed `torch.Generator.manual_seed` takes (seeds are unsigned 64-bit)."""


def choice_seed(seed: int, index: int) -> int:
    """The seed of a request's `index`-th prompt or choice: `seed + index`, wrapped to stay
    within the generator's 64 bits (a request may ask for seed MAX_SEED and n = 4)."""
    return (seed + index) % (MAX_SEED + 1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # fresh entropy
    else:
        generator.manual_seed(seed)
    return generator


def _filter_top_k(logits: Tensor, k: int) -> Tensor:
    if k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _filter_top_p(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (the
    most likely one is always kept), as Megatron's modify_logits_for_top_p_filtering."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative > p
    drop[1:] = drop[:-1].clone()
    drop[0] = False
    return logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def row_logsumexp(logits: Tensor) -> Tensor:
    """logsumexp of each row of `logits` [rows, vocab], the same value for a row whatever
    rows come with it: torch sums a lone row in pieces across threads (another summation
    order than the per-row one of a batch), so a lone row is summed beside a copy of itself."""
    if logits.shape[0] == 1:
        return torch.logsumexp(logits.expand(2, -1), dim=-1)[:1]
    return torch.logsumexp(logits, dim=-1)


def token_logprobs(logits: Tensor, tokens: Sequence[int]) -> Tensor:
    """log_softmax(logits)[i, tokens[i]] for each row i, without subtracting whole rows."""
    chosen = logits.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0]
    return chosen - row_logsumexp(logits)


def _adjust_in_place(
    logits: Tensor, params: SamplingParams, previous: int | None, generated: Sequence[int]
) -> None:
    """The OpenAI-style logit changes (bias, penalties) and Megatron's banned pairs, on a
    row that is already the caller's own copy."""
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = Counter(generated)
        ids = torch.tensor(list(counts), dtype=torch.long)
        freq = torch.tensor(list(counts.values()), dtype=logits.dtype)
        logits[ids] -= params.frequency_penalty * freq + params.presence_penalty
    for before, token in params.banned_after:
        if previous == before:
            logits[token] = -1e10


def _sample(
    logits: Tensor, params: SamplingParams, top_p: float, generator: torch.Generator
) -> int:
    """One token drawn from an adjusted row with temperature, top-k and top-p."""
    if params.temperature != 1.0:
        scaled = logits / params.temperature
        if not torch.isfinite(scaled.max()):
            # a temperature so small that the scaled logits overflow (or that is 0
            # in fp32) is the limit T -> 0: only the most likely token(s) remain
            top = logits == logits.max()
            scaled = torch.full_like(logits, float("-inf")).masked_fill(top, 0.0)
        logits = scaled
    if params.top_k > 1:
        logits = _filter_top_k(logits, params.top_k)
    if 0.0 < top_p < 1.0:
        logits = _filter_top_p(logits, top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _greedy_tokens(logits: Tensor, positions: list[int]) -> list[int]:
    """The first most likely token of each row at `positions`, in one reduction: torch.max
    over a dimension returns the first maximal index, as argmax does, in less time."""
    if not positions:
        return []
    if len(positions) < logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(positions, dtype=torch.long))
    return torch.max(logits, dim=-1).indices.tolist()


def _choices(
    logits: Tensor, rows: Sequence[int], states: Sequence[RowState], tokens: list[int]
) -> list[TokenChoice]:
    """The chosen tokens with their log-probabilities under the raw `logits`, for the rows
    that report them: one logsumexp over those rows and a scalar read per chosen token."""
    choices = [TokenChoice(token, None, []) for token in tokens]
    wanted = [i for i, state in enumerate(states) if state.params.reports_logprobs]
    if not wanted:
        return choices
    index = torch.tensor([rows[i] for i in wanted], dtype=torch.long)
    lse = row_logsumexp(logits.index_select(0, index))
    chosen = logits[index, torch.tensor([tokens[i] for i in wanted], dtype=torch.long)] - lse
    for j, (i, value) in enumerate(zip(wanted, chosen.tolist(), strict=True)):
        choices[i].logprob = value
        if k := states[i].params.top_logprobs:
            values, ids = torch.topk(logits[rows[i]] - lse[j], k)
            choices[i].top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return choices


def choose_tokens(
    logits: Tensor, rows: Sequence[int], states: Sequence[RowState]
) -> list[TokenChoice]:
    """The next token of each sequence whose logits are row `rows[i]` of fp32 `logits`
    [n, vocab] (left unchanged): every greedy row in one reduction, the others drawn one by
    one from their own generator; log-probabilities only where asked."""
    if not rows:
        return []
    picked = logits.index_select(0, torch.tensor(rows, dtype=torch.long))  # a copy: adjust in place
    for row, state in zip(picked, states, strict=True):
        _adjust_in_place(row, state.params, state.previous, state.generated)
    greedy = [i for i, state in enumerate(states) if state.params.is_greedy]
    tokens = [0] * len(states)
    for i, token in zip(greedy, _greedy_tokens(picked, greedy), strict=True):
        tokens[i] = token
    for i, state in enumerate(states):
        if not state.params.is_greedy:
            tokens[i] = _sample(picked[i], state.params, state.top_p, state.generator)
    return _choices(logits, rows, states, tokens)


def choose_token(logits: Tensor, state: RowState) -> TokenChoice:
    """One token from fp32 logits [vocab] (the batch's code on a batch of one)."""
    return choose_tokens(logits[None], [0], [state])[0]


def next_top_p(top_p: float, params: SamplingParams) -> float:
    """Megatron's top-p decay: p ← max(p·decay, bound) after every token."""
    if params.top_p_decay > 0.0 and top_p > 0.0:
        return max(top_p * params.top_p_decay, params.top_p_bound)
    return top_p
