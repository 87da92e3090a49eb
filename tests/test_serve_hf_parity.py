"""mg-serve's greedy output equals transformers' `generate()` token for token, on the same
model exported with `mg-convert export-hf` (GPT-2 and Llama shapes), with prompts of
different lengths decoded together in one continuous batch."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from mg.core.models import presets
from mg.core.testing.serving_checkpoints import save_decisive_model
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.loading import load_for_serving
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
export_hf = pytest.importorskip("mg.ckpt_convert.export_hf").export_hf

PROMPTS = ["The school master", "I", "It was a fine day and the boys were out in the"]
NEW_TOKENS = 24
SHAPES = {
    "gpt2": presets.tiny_gpt2,
    "llama": presets.tiny_llama,  # RoPE, GQA, RMSNorm, SwiGLU, untied output layer
}


def _checkpoint(shape: str, folder: Path) -> Path:
    save_decisive_model(folder, SHAPES[shape])
    export_hf(folder / "ckpt", folder / "hf", progress=False)
    return folder


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_equals_transformers_generate(shape: str, tmp_path: Path) -> None:
    folder = _checkpoint(shape, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").eval()
    hf.generation_config.eos_token_id = None  # generate all NEW_TOKENS on both sides
    hf.generation_config.pad_token_id = 0
    loaded = load_for_serving(folder / "ckpt")
    tok = loaded.tokenizer
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.tokenize(prompt)])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())

    engine = GenerationEngine(ModelRunner(loaded.model, 4, 64), tok.detokenize, tok.vocab_size)
    try:
        results: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
        done = threading.Semaphore(0)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
        for i, prompt in enumerate(PROMPTS):  # all in flight at once: one batch

            def emit(event, i=i) -> None:
                if event.choice is not None:
                    results[i].append(event.choice.token)
                if event.finish_reason is not None:
                    done.release()

            engine.submit(tok.tokenize(prompt), params, emit)
        for _ in PROMPTS:
            assert done.acquire(timeout=120)
        assert [results[i] for i in range(len(PROMPTS))] == expected
    finally:
        engine.shutdown()


@contextmanager
def mg_serve(load: Path) -> Iterator[str]:
    """The `mg-serve` command on a free port; yields its URL."""
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("mg-serve")), "--load", str(load), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = next((x for x in proc.stdout if "listening on" in x), "")  # after progress
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + (proc.stdout.read() if proc.poll() is not None else "")
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_served_text_equals_transformers_generate(tmp_path: Path) -> None:
    """Over HTTP: PUT /api with top_k=1 gives the prompt + transformers' greedy continuation."""
    folder = _checkpoint("gpt2", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").eval()
    hf.generation_config.pad_token_id = 0
    with mg_serve(folder / "ckpt") as url:
        body = {"prompts": PROMPTS, "tokens_to_generate": 10, "top_k": 1}
        texts = httpx.put(url + "/api", json=body, timeout=120).json()["text"]
    tok = load_for_serving(folder / "ckpt").tokenizer
    for prompt, text in zip(PROMPTS, texts, strict=True):
        ids = torch.tensor([tok.tokenize(prompt)])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=10, do_sample=False)
        assert text == tok.detokenize(out[0].tolist())
