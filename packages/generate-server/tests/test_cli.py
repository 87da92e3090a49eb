"""The `mg-serve` command: starts on a checkpoint, answers, refuses what it cannot do; the
interactive client against a running server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from mg.generate_server import cpu_isa
from mg.generate_server.amx_matmul import amx_matmul
from mg.generate_server.cli import main
from mg.generate_server.client import run_client

SERVE = [sys.executable, "-c", "from mg.generate_server.cli import main; main()"]


@contextmanager
def _served(checkpoint, *flags: str) -> Iterator[tuple[str, str]]:
    """`mg-serve --load checkpoint --port 0 flags` running: (its URL, its start-up line)."""
    proc = subprocess.Popen(
        [*SERVE, "--load", str(checkpoint), "--port", "0", "--log-level", "warning", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + proc.stdout.read() if proc.poll() is not None else line
        yield match.group(1), line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_command_end_to_end(checkpoint) -> None:
    flags = ["--kv-cache-memory", "1MiB", "--num-threads", "1", "--max-num-batched-tokens", "8"]
    with _served(checkpoint, *flags, "--no-enable-prefix-caching") as (url, line):
        # 2 layers x (keys + values) x 16 positions x 32 channels x 4 bytes = 8 KiB a block
        assert "float32, 1 threads" in line and "KV cache 128 blocks x 16 = 2048 positions" in line
        r = httpx.put(
            url + "/api", json={"prompts": ["Hello"], "tokens_to_generate": 3}, timeout=60
        )
        assert r.status_code == 200 and r.json()["text"][0].startswith("Hello")
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 2
        metrics = httpx.get(url + "/metrics").text
        assert "mg_serve_kv_cache_blocks 128.0" in metrics
        assert "mg_serve_time_to_first_token_seconds_count 2.0" in metrics
        assert "mg_serve_inter_token_latency_seconds_count 3.0" in metrics  # 2 + 1 later tokens
        assert "mg_serve_kv_cache_used_blocks 0.0" in metrics


def test_serve_with_a_draft_model(checkpoint, server) -> None:
    """--draft-load with the served checkpoint itself: every draft token is accepted, the
    greedy completion is the one a server without a draft gives, /metrics counts them."""
    request = {"prompt": "The school", "max_tokens": 12, "temperature": 0}
    draft = ["--draft-load", str(checkpoint), "--num-speculative-tokens", "3"]
    with _served(checkpoint, *draft, "--num-threads", "1") as (url, line):
        assert f"draft {checkpoint.name} x 3 tokens" in line
        text = httpx.post(url + "/v1/completions", json=request, timeout=60).json()
        alone = httpx.post(server.url + "/v1/completions", json=request, timeout=60).json()
        assert text["choices"][0]["text"] == alone["choices"][0]["text"]
        metrics = httpx.get(url + "/metrics").text
        drafted = re.search(r"^mg_serve_spec_decode_draft_tokens_total (\S+)", metrics, re.M)
        accepted = re.search(r"^mg_serve_spec_decode_accepted_tokens_total (\S+)", metrics, re.M)
        assert float(drafted.group(1)) == float(accepted.group(1)) > 0


@pytest.mark.slow
def test_serve_with_compiled_decode_steps(checkpoint, server) -> None:
    """--enable-torch-compile: the buckets compile before the server listens (the start-up
    line says so) and a greedy completion is the eager server's."""
    request = {"prompt": "The school", "max_tokens": 12, "temperature": 0}
    flags = ["--enable-torch-compile", "--inference-max-requests", "2", "--num-threads", "1"]
    with _served(checkpoint, *flags) as (url, line):
        started = r"\(cpu, decode attention in place, decode compiled for 1, 2 sequences in \d+ s"
        assert re.search(started + ", float32", line)
        text = httpx.post(url + "/v1/completions", json=request, timeout=60).json()
        alone = httpx.post(server.url + "/v1/completions", json=request, timeout=60).json()
        assert text["choices"][0]["text"] == alone["choices"][0]["text"]


@pytest.mark.skipif(cpu_isa.available() not in ("avx2", "avx512", "amx"), reason="no AVX2")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_serve_a_llama_shape_with_avx2_fused_steps(tmp_path, dtype: str) -> None:
    """--cpu-isa avx2 (forced on a newer CPU): an fp32 or bf16 Llama-shaped model's steps
    run as one C++ call built for AVX2 (a bf16 model's weights left unpacked for it), the
    start-up line says so, and the greedy completion is the one --cpu-isa none gives (op by
    op)."""
    from mg.core.testing.serving_checkpoints import save_decisive_model

    ckpt = save_decisive_model(tmp_path)
    request = {"prompt": "The school", "max_tokens": 8, "temperature": 0}
    flags = ["--inference-max-requests", "2"] + (["--bf16"] if dtype == "bf16" else [])
    texts = []
    for isa in ("avx2", "none"):
        with _served(ckpt, "--cpu-isa", isa, *flags) as (url, line):
            assert (f"decode steps fused (avx2 {dtype})" in line) == (isa == "avx2"), line
            answer = httpx.post(url + "/v1/completions", json=request, timeout=60).json()
            assert answer["usage"]["completion_tokens"] == 8
            texts.append(answer["choices"][0]["text"])
    assert texts[0] == texts[1]


@pytest.mark.skipif(amx_matmul()[0] is None, reason=amx_matmul()[1])
def test_serve_a_llama_shape_in_bf16_with_fused_steps(tmp_path) -> None:
    """On a CPU with AMX a Llama-shaped bf16 model's steps run as one C++ call: the start-up
    line says so, and streamed and plain greedy completions agree."""
    from mg.core.testing.serving_checkpoints import save_decisive_model

    ckpt = save_decisive_model(tmp_path)
    request = {"prompt": "The school", "max_tokens": 8, "temperature": 0}
    with _served(ckpt, "--bf16", "--num-threads", "2", "--inference-max-requests", "2") as (
        url,
        line,
    ):
        assert "AMX-packed weights, decode steps fused (amx bf16), bfloat16, 2 threads" in line
        plain = httpx.post(url + "/v1/completions", json=request, timeout=60).json()
        assert plain["usage"]["completion_tokens"] == 8
        with httpx.stream("POST", url + "/v1/completions", json={**request, "stream": True},
                          timeout=60) as streamed:  # fmt: skip
            chunks = [x for x in streamed.iter_lines() if x.startswith("data: {")]
        text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in chunks)
        assert text == plain["choices"][0]["text"]


def test_draft_and_cuda_graph_refusals(checkpoint, tmp_path, capsys) -> None:
    from mg.core.checkpoint import load_model, save_model
    from mg.core.models import GPTModel
    from mg.core.models.presets import tiny_gpt2

    tokenizer = load_model(checkpoint)[2]
    short = tiny_gpt2(vocab_size=50304, seq_length=32, max_position_embeddings=32)
    save_model(tmp_path / "short", GPTModel(short), short, tokenizer)
    for flags, message in (
        (["--draft-load", str(tmp_path / "short")], "it has 32 positions, fewer than the 64"),
        (["--enable-cuda-graph", "--device", "cpu"], "--enable-cuda-graph needs a CUDA device"),
        (
            ["--enable-torch-compile", "--enable-cuda-graph"],
            "--enable-torch-compile and --enable-cuda-graph: pick one",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            threads = str(__import__("torch").get_num_threads())  # leave the process's as is
            main(["--load", str(checkpoint), "--port", "0", "--num-threads", threads, *flags])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no draft model: the model's MTP layers, and it has none
        threads = str(__import__("torch").get_num_threads())
        main(["--load", str(checkpoint), "--port", "0", "--num-threads", threads,
              "--num-speculative-tokens", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert "multi-token prediction layers" in err and "give --draft-load" in err


def _fails(*args: str, env: dict | None = None) -> str:
    result = subprocess.run(
        [*SERVE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


def _fails_in_process(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_clear_errors(checkpoint, tmp_path, capsys, monkeypatch) -> None:
    # one through the console entry point: exit status 2 and no traceback
    assert "does not exist" in _fails("--load", str(tmp_path / "nope"))
    # the rest in this process (each launch would import torch again)
    error = _fails_in_process(
        capsys, "--load", str(checkpoint), "--tensor-model-parallel-size", "2"
    )
    assert "torchrun --nproc-per-node 2 mg-serve" in error
    error = _fails_in_process(capsys, "--load", str(checkpoint), "--kv-cache-memory", "10KiB")
    assert "--kv-cache-memory 10KiB holds 1 KV-cache blocks" in error
    assert "one sequence of 64 positions needs 4" in error
    monkeypatch.setenv("WORLD_SIZE", "2")
    error = _fails_in_process(capsys, "--load", str(checkpoint))
    assert "start mg-serve with torchrun --nproc-per-node 2" in error


def test_bad_flags(checkpoint, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--load", str(checkpoint), "--inference-max-requests", "0"])
    assert exit_.value.code == 2
    assert "--inference-max-requests must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--load", str(checkpoint), "--kv-cache-memory", "lots"])
    assert "--kv-cache-memory: 'lots' is neither a size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--load", str(checkpoint), "--max-num-batched-tokens", "0"])
    assert "--max-num-batched-tokens must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--load", str(checkpoint), "--api-key", " "])
    assert "--api-key (or $MG_SERVE_API_KEY) is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--load", str(checkpoint), "--max-waiting-requests", "0"])
    assert "--max-waiting-requests must be >= 1" in capsys.readouterr().err


def test_interactive_client(server) -> None:
    answers = iter(["The school", "4", "Again", "x", "", "-1"])
    printed: list[str] = []

    def read(prompt: str) -> str:
        printed.append(prompt)
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    status = run_client(server.url.removeprefix("http://"), read=read, write=printed.append)
    assert status == 0
    assert printed[:2] == ["Enter prompt: ", "Enter number of tokens to generate: "]
    assert any(p.startswith("The school") for p in printed)
    assert "not a number of tokens: 'x'" in printed
    assert any(p.startswith("Error 400: tokens_to_generate must be") for p in printed)


def test_client_reports_unreachable_server() -> None:
    answers = iter(["a", "1"])
    printed: list[str] = []
    status = run_client("127.0.0.1:9", read=lambda _: next(answers), write=printed.append)
    assert status == 1 and "cannot reach" in printed[-1]
