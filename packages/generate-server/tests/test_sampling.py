"""Token choice edge cases: what the API's validation lets through must not break sampling."""

from __future__ import annotations

import pytest
import torch

from mg.generate_server.sampling import SamplingParams, choose_token


@pytest.mark.parametrize("temperature", [5e-277, 1e-30, 1e-8])
@pytest.mark.parametrize("top_p", [0.0, 0.6, 5e-324])
def test_a_tiny_temperature_samples_the_argmax(temperature: float, top_p: float) -> None:
    """Found by fuzzing: logits / 5e-277 overflowed to inf and softmax gave NaN."""
    logits = torch.tensor([1.0, 3.5, -2.0, 3.25, 0.0])
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        choice = choose_token(
            logits, logits.log_softmax(-1), params, top_p, generator, previous=None, generated=[]
        )
        assert choice.token == 1


def test_an_ordinary_temperature_still_samples() -> None:
    logits = torch.tensor([0.0, 0.1, 0.2])
    params = SamplingParams(max_new_tokens=1, temperature=0.7)
    generator = torch.Generator().manual_seed(0)
    tokens = {
        choose_token(logits, logits.log_softmax(-1), params, 0.0, generator, None, []).token
        for _ in range(50)
    }
    assert tokens == {0, 1, 2}
