"""Token choice: edge cases the API's validation lets through, and the batched choice of a
step's tokens, which must be what choosing row by row gives."""

from __future__ import annotations

import pytest
import torch

from mg.generate_server.sampling import (
    RowState,
    SamplingParams,
    TokenChoice,
    choose_token,
    choose_tokens,
    row_logsumexp,
    token_logprobs,
)

VOCAB = 50257


def _state(params: SamplingParams, seed: int = 0, previous=None, generated=()) -> RowState:
    generator = torch.Generator().manual_seed(seed)
    return RowState(params, params.top_p, generator, previous, list(generated))


@pytest.mark.parametrize("temperature", [5e-277, 1e-30, 1e-8])
@pytest.mark.parametrize("top_p", [0.0, 0.6, 5e-324])
def test_a_tiny_temperature_samples_the_argmax(temperature: float, top_p: float) -> None:
    """Found by fuzzing: logits / 5e-277 overflowed to inf and softmax gave NaN."""
    logits = torch.tensor([1.0, 3.5, -2.0, 3.25, 0.0])
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p)
    state = _state(params)
    for _ in range(5):
        assert choose_token(logits, state).token == 1


def test_an_ordinary_temperature_still_samples() -> None:
    logits = torch.tensor([0.0, 0.1, 0.2])
    state = _state(SamplingParams(max_new_tokens=1, temperature=0.7))
    assert {choose_token(logits, state).token for _ in range(50)} == {0, 1, 2}


def _mixed_rows(logits: torch.Tensor) -> list[tuple[int, SamplingParams, int | None, list[int]]]:
    """(row, params, previous token, generated) for every kind of row a step can hold."""
    best = [int(row.argmax()) for row in logits]
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    return [
        (5, greedy, None, []),
        (0, SamplingParams(max_new_tokens=4, top_k=1, logprobs=True), None, []),
        (
            3,
            SamplingParams(max_new_tokens=4, greedy=True, logit_bias={7: 50.0, best[3]: -50.0}),
            1,
            [],
        ),
        (
            1,
            SamplingParams(
                max_new_tokens=4,
                greedy=True,
                presence_penalty=0.5,
                frequency_penalty=1.5,
                top_logprobs=3,
            ),
            9,
            [best[1], best[1], 4],
        ),
        (6, SamplingParams(max_new_tokens=4, greedy=True, banned_after=((9, best[6]),)), 9, []),
        (2, SamplingParams(max_new_tokens=4, temperature=0.7, top_k=40, top_p=0.9), 3, [3]),
        (
            4,
            SamplingParams(max_new_tokens=4, temperature=1.3, top_p=0.8, logit_bias={11: 3.0}),
            None,
            [],
        ),
        (7, SamplingParams(max_new_tokens=4, top_k=20, top_logprobs=5, seed=3), 2, [2, 2]),
        (8, SamplingParams(max_new_tokens=4, frequency_penalty=0.4, logprobs=True), 0, [5, 0]),
    ]


@pytest.mark.parametrize("bf16", [False, True])
def test_a_batch_chooses_what_row_by_row_chooses(bf16: bool) -> None:
    """Same tokens (seeded draws included) and bit-identical log-probabilities; the
    caller's logits are left as they were. bf16-rounded logits hold many equal values."""
    torch.manual_seed(0)
    padded = torch.randn(10, VOCAB + 47) * 4
    if bf16:
        padded = padded.bfloat16().float()
    logits = padded[:, :VOCAB]  # the engine's view without the vocabulary padding
    before = logits.clone()
    rows = _mixed_rows(logits)
    states = [
        _state(params, seed=i, previous=prev, generated=gen)
        for i, (_, params, prev, gen) in enumerate(rows)
    ]
    batch = choose_tokens(logits, [row for row, *_ in rows], states)
    one_by_one = [
        choose_token(logits[row], _state(params, seed=i, previous=prev, generated=gen))
        for i, (row, params, prev, gen) in enumerate(rows)
    ]
    assert batch == one_by_one
    assert torch.equal(logits, before)


def test_adjustments_change_the_choice_not_the_logprobs() -> None:
    """Bias, penalties and banned pairs steer the choice; reported log-probabilities stay
    those of the raw logits."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 1.5]] * 3)
    states = [
        _state(SamplingParams(1, greedy=True, logit_bias={0: 5.0}, logprobs=True)),
        _state(SamplingParams(1, greedy=True, presence_penalty=2.0, logprobs=True), generated=[1]),
        _state(SamplingParams(1, greedy=True, banned_after=((6, 1),), logprobs=True), previous=6),
    ]
    choices = choose_tokens(logits, [0, 1, 2], states)
    assert [c.token for c in choices] == [0, 3, 3]
    raw = logits[0].log_softmax(-1)
    assert [c.logprob for c in choices] == pytest.approx(raw[[0, 3, 3]].tolist(), abs=1e-6)


def test_greedy_takes_the_first_of_equal_maxima() -> None:
    inf = float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [-inf, -inf, -inf, -inf], [0.0, 2.0, -1.0, 2.0]])
    states = [_state(SamplingParams(1, greedy=True))] * 3
    assert [c.token for c in choose_tokens(logits, [0, 1, 2], states)] == [1, 0, 1]


def test_greedy_is_argmax_row_by_row() -> None:
    """Few distinct values: many rows hold their maximum more than once."""
    logits = torch.randint(-3, 3, (12, VOCAB), generator=torch.Generator().manual_seed(4))
    logits = logits.float()
    states = [_state(SamplingParams(1, greedy=True))] * 12
    tokens = [c.token for c in choose_tokens(logits, list(range(12)), states)]
    assert tokens == [int(torch.argmax(row)) for row in logits]


def test_logprobs_only_when_asked() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 3
    asked = [
        SamplingParams(1, greedy=True),
        SamplingParams(1, greedy=True, logprobs=True),
        SamplingParams(1, greedy=True, top_logprobs=3),  # implies logprobs
        SamplingParams(1, temperature=0.9, seed=1),
    ]
    choices = choose_tokens(logits, [0, 1, 2, 3], [_state(p) for p in asked])
    assert choices[0] == TokenChoice(int(logits[0].argmax()), None, [])
    assert choices[3].logprob is None and choices[3].top == []
    for row in (1, 2):
        reference = logits[row].log_softmax(-1)
        assert choices[row].logprob == pytest.approx(float(reference[choices[row].token]), abs=1e-5)
    values, ids = torch.topk(logits[2].log_softmax(-1), 3)
    assert [t for t, _ in choices[2].top] == ids.tolist()
    assert [v for _, v in choices[2].top] == pytest.approx(values.tolist(), abs=1e-5)
    assert choices[2].top[0] == (choices[2].token, choices[2].logprob)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_lone_row_gets_the_batch_value(threads: int) -> None:
    """torch sums a lone long row in pieces across threads; the log-probability of a row
    must not depend on which rows share its step."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(2)
        logits = torch.randn(6, 151936) * 5
        together = row_logsumexp(logits)
        alone = torch.cat([row_logsumexp(logits[i : i + 1]) for i in range(6)])
        assert torch.equal(together, alone)
    finally:
        torch.set_num_threads(previous)


def test_token_logprobs_equal_log_softmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(5, 1000) * 4
    tokens = [3, 999, 0, 512, 7]
    expected = logits.log_softmax(-1)[torch.arange(5), torch.tensor(tokens)]
    torch.testing.assert_close(token_logprobs(logits, tokens), expected, rtol=0, atol=1e-5)
