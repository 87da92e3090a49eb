"""mg-serve takes mg-train's attention-kernel flags: the engine's attention over the paged KV
cache runs in the chosen SDPA kernels (the math kernel gives SDPA's own choice's log-probs),
and a CUDA kernel without CUDA is refused in one line naming the flag (exit 2)."""

from __future__ import annotations

import pytest
import torch

from mg.generate_server.cli import main
from mg.generate_server.engine import GenerationEngine, SamplingParams
from mg.generate_server.runner import ModelRunner


def _prompt_logprobs(loaded, backend: str) -> torch.Tensor:
    runner = ModelRunner(loaded.model, 2, 64, block_size=4)
    runner.attention_backend = backend
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, 50257, max_num_batched_tokens=5)
    prompt = loaded.tokenizer.tokenize("I had been teaching at the school for a month when")
    try:
        events = engine.generate(prompt, SamplingParams(max_new_tokens=3, prompt_logprobs=True))
    finally:
        engine.shutdown()
    return torch.tensor(events[0].prompt_logprobs)


def test_math_kernel_matches_auto(loaded) -> None:
    auto = _prompt_logprobs(loaded, "auto")
    torch.testing.assert_close(_prompt_logprobs(loaded, "unfused"), auto, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--attention-backend", "fused"], "--attention-backend fused"), (["--use-flash-attn"], "")],
)
def test_cuda_kernels_are_refused_by_name(checkpoint, capsys, flags, named) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--load", str(checkpoint), "--device", "cpu", *flags])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "CUDA" in lines[0]
