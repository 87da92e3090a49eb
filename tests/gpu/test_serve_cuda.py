"""On a CUDA GPU, mg-serve gives transformers' greedy `generate()` tokens (also on the GPU):
the eager paged runner under several schedules, and `--enable-cuda-graph`'s runner with
every decode-only step replayed from a captured graph, in-process and through the HTTP
server. Skipped without CUDA (the CPU suite checks the same static path uncaptured);
MG_GPU_TEST_DEVICE=cpu runs the eager runner's case on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
import torch
from gpu_device import DEVICE, ON_CUDA, cuda_only, needs_device

from mg.core.testing.serving_checkpoints import save_decisive_model
from mg.generate_server.batch import generate_batch
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

pytestmark = needs_device
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24
PROMPTS = [
    "The school master",
    "I",
    "It was a fine day and the boys were out in the field behind the school when",
    "You are a schoolmaster in a small town in the country; who broke the window?",
    "Why",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Llama-shaped model (RoPE, GQA, SwiGLU) saved as an mg checkpoint and loaded on the
    device; the prompts' ids and transformers' greedy continuations of each alone, there."""
    from mg.ckpt_convert.export_hf import export_hf
    from mg.generate_server.loading import load_for_serving

    folder = tmp_path_factory.mktemp("cuda")
    save_decisive_model(folder, positions=128)  # RoPE, GQA, SwiGLU
    export_hf(folder / "ckpt", folder / "hf", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").eval().to(DEVICE)
    loaded = load_for_serving(folder / "ckpt", device=str(DEVICE))
    assert next(loaded.model.parameters()).device.type == DEVICE.type
    prompts = [loaded.tokenizer.tokenize(p) for p in PROMPTS]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids], device=DEVICE),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected.append(out[0, len(ids) :].tolist())
    return folder, loaded, prompts, expected


def _generate(engine: GenerationEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    results = generate_batch(engine, prompts, params)
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return [r.tokens for r in results]


@pytest.mark.parametrize(
    "schedule",
    [{}, {"max_num_batched_tokens": 7}, {"num_blocks": 14, "block_size": 4}],
    ids=["default", "chunked-prefill", "preemption"],
)
def test_eager_runner_on_the_gpu_equals_transformers(served, schedule: dict) -> None:
    _, loaded, prompts, expected = served
    options = dict(schedule)
    runner = ModelRunner(
        loaded.model,
        num_slots=4,
        max_length=128,
        num_blocks=options.pop("num_blocks", None),
        block_size=options.pop("block_size", 16),
    )
    if ON_CUDA:  # on a CPU, auto would pick the CPU decode kernel (a C++ build)
        runner.choose_decode_attention()
    assert runner.device.type == DEVICE.type and runner.cache_decode_kernel is None
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, 50257, **options)
    try:
        assert _generate(engine, prompts) == expected
        if "num_blocks" in schedule:
            assert engine.stats.preemptions > 0
        assert engine.blocks.num_used == 0
    finally:
        engine.shutdown()


@cuda_only
def test_cuda_graph_runner_replays_captured_graphs_with_the_same_tokens(served) -> None:
    """Three prompts (decode steps of 3 sequences padded to the bucket of 4), then five on
    4 slots: every decode-only step replays a graph captured for its bucket."""
    from mg.generate_server.cuda_graphs import CudaGraphRunner

    _, loaded, prompts, expected = served
    runner = CudaGraphRunner(loaded.model, 4, 128, block_size=8)
    runner.choose_decode_attention()
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, 50257)
    try:
        assert _generate(engine, prompts[:3]) == expected[:3]
        assert _generate(engine, prompts) == expected
        assert not runner._eager_only, "a capture failed: decode steps ran eagerly"
        assert runner.graph_steps >= 2 * NEW_TOKENS
        assert runner._steps and all(s.graph is not None for s in runner._steps.values())
        assert set(runner._steps) <= {1, 2, 4}
    finally:
        engine.shutdown()


@cuda_only
def test_served_with_cuda_graphs_over_http(served) -> None:
    """`mg-serve --device cuda --enable-cuda-graph`: a greedy completion of token ids is
    transformers' continuation, and the log says a graph was captured."""
    folder, _, prompts, expected = served
    command = [
        sys.executable,
        "-m",
        "mg.generate_server.cli",
        *("--load", str(folder / "ckpt"), "--port", "0", "--device", "cuda"),
        *("--enable-cuda-graph", "--inference-max-requests", "4", "--log-level", "info"),
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                break
        banner = lines[-1] if lines else ""
        url = re.search(r"listening on (http://\S+)", banner)
        assert url, "".join(lines)
        assert "(cuda, decode steps as CUDA graphs, float32" in banner
        body = {"prompt": prompts[2], "max_tokens": NEW_TOKENS, "temperature": 0}
        reply = httpx.post(url.group(1) + "/v1/completions", json=body, timeout=120).json()
        choice = reply["choices"][0]
        assert reply["usage"]["completion_tokens"] == NEW_TOKENS
        assert choice["text"] == served[1].tokenizer.detokenize(expected[2])
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=60)[0]
    assert "CUDA graph captured for decode steps of 1 sequences" in "".join(lines) + rest
