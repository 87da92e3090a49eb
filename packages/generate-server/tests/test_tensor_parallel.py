"""`torchrun --nproc-per-node 2 mg-serve`: tensor-parallel serving answers as one process does
(greedy tokens, logprobs, seeded samples), and stops cleanly or fails fast as a whole job."""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mg.core.checkpoint import save_model
from mg.core.models.presets import tiny_llama
from mg.generate_server.loading import load_for_serving


def _sibling_conftest() -> Any:
    """This folder's conftest.py by path: under --import-mode=importlib a bare `import
    conftest` may find another package's conftest when several packages' tests run."""
    path = Path(__file__).with_name("conftest.py")
    spec = importlib.util.spec_from_file_location("generate_server_tests_conftest", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_conftest = _sibling_conftest()
SEQ_LENGTH = _conftest.SEQ_LENGTH
gpt2_tokenizer_config = _conftest.gpt2_tokenizer_config
run_server = _conftest.run_server
train_tiny_gpt = _conftest.train_tiny_gpt

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="finds the ranks' processes through /proc"
)

BIN = Path(sys.executable).parent
PROMPTS = ["The school", "I had been teaching at the school for a month when", "Hello"]


class TorchrunServer:
    """A `torchrun --standalone` job of mg-serve ranks; rank 0's URL and every rank's pid."""

    def __init__(self, proc: subprocess.Popen, lines: queue.Queue[str], log: list[str]) -> None:
        self.proc = proc
        self.log = log
        deadline = time.monotonic() + 180
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("mg-serve did not start:\n" + "".join(log)) from None
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                return
            if not line:  # EOF: torchrun exited
                raise AssertionError("mg-serve exited:\n" + "".join(log))

    def rank_pids(self) -> dict[int, int]:
        """RANK -> pid of torchrun's worker processes."""
        pids = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != self.proc.pid:
                    continue
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            for entry in environ:
                if entry.startswith(b"RANK="):
                    pids[int(entry[5:])] = int(stat.parent.name)
        return pids

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log = "".join(self.log)
            raise AssertionError(f"job still running after {timeout} s:\n{log}") from None


@contextmanager
def torchrun_server(checkpoint: Path, nproc: int = 2) -> Iterator[TorchrunServer]:
    command = [
        str(BIN / "torchrun"),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--no-python",
        str(BIN / "mg-serve"),
        *("--load", str(checkpoint), "--port", "0", "--inference-max-requests", "4"),
        *("--log-level", "warning"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def drain() -> None:
        for line in proc.stdout:
            log.append(line)
            lines.put(line)
        lines.put("")

    threading.Thread(target=drain, daemon=True).start()
    try:
        yield TorchrunServer(proc, lines, log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _answers(url: str) -> dict:
    """Greedy (Megatron API with logprobs, OpenAI with top logprobs) and seeded samples,
    the OpenAI ones sent concurrently so that decode steps batch sequences at
    different positions."""
    with httpx.Client(base_url=url, timeout=120) as client:
        api = client.put(
            "/api",
            json={"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 1, "logprobs": True},
        ).json()
        requests = [
            {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3}
            for prompt in PROMPTS[:2]
        ] + [
            {"prompt": PROMPTS[seed % 3], "max_tokens": 10, "temperature": 1.0, "top_p": 0.95}
            | {"seed": seed}
            for seed in range(3)
        ]
        with ThreadPoolExecutor(len(requests)) as pool:
            post = lambda body: client.post("/v1/completions", json=body)  # noqa: E731
            replies = list(pool.map(post, requests))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return {"api": api, "openai": [r.json()["choices"][0] for r in replies]}


def assert_same_answers(tp: dict, reference: dict) -> None:
    assert tp["api"]["segments"] == reference["api"]["segments"]
    for got, want in zip(tp["api"]["logprobs"], reference["api"]["logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    for got, want in zip(tp["openai"], reference["openai"], strict=True):
        assert got["text"] == want["text"]
        if want["logprobs"] is not None:
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            assert got["logprobs"]["token_logprobs"] == pytest.approx(
                want["logprobs"]["token_logprobs"], abs=1e-4
            )
            for top_got, top_want in zip(
                got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"], strict=True
            ):
                assert top_got.keys() == top_want.keys()
                assert list(top_got.values()) == pytest.approx(list(top_want.values()), abs=1e-4)
    samples = [c["text"] for c in reference["openai"] if c["logprobs"] is None]
    assert len(set(samples)) > 1, "seeded samples should differ from each other"


def test_tp2_gpt2_answers_equal_one_process_and_sigterm_stops_all_ranks(checkpoint, server) -> None:
    with torchrun_server(checkpoint) as job:
        assert_same_answers(_answers(job.url), _answers(server.url))
        health = httpx.get(job.url + "/health", timeout=30).json()
        assert health["status"] == "ok"
        pids = job.rank_pids()
        assert sorted(pids) == [0, 1]
        os.kill(pids[0], signal.SIGTERM)
        assert job.wait(timeout=60) == 0, "".join(job.log)
        assert not Path(f"/proc/{pids[1]}").exists() or "zombie" in _state(pids[1])


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


@pytest.fixture(scope="module")
def llama_tp2_checkpoint(tmp_path_factory) -> Path:
    """A GQA + SwiGLU model saved by one process, resharded to a TP=2 `torch` checkpoint."""
    root = tmp_path_factory.mktemp("llama")
    config = tiny_llama(
        vocab_size=50304,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        seq_length=SEQ_LENGTH,
        max_position_embeddings=SEQ_LENGTH,
    )
    model = train_tiny_gpt(config=config)
    save_model(root / "tp1", model, config, gpt2_tokenizer_config(), iteration=20)
    subprocess.run(
        [
            str(BIN / "mg-convert"),
            "reshard",
            *("--load", str(root / "tp1"), "--save", str(root / "llama-tp2")),
            "--target-tensor-parallel-size=2",
        ],
        check=True,
        capture_output=True,
    )
    assert (root / "llama-tp2" / "iter_0000020" / "mp_rank_01").is_dir()
    return root / "llama-tp2"


@pytest.mark.slow
def test_tp2_llama_gqa_swiglu_from_tp2_checkpoint_and_a_dead_rank_ends_the_job(
    llama_tp2_checkpoint,
) -> None:
    with run_server(load_for_serving(llama_tp2_checkpoint)) as reference:
        expected = _answers(reference.url)
    with torchrun_server(llama_tp2_checkpoint) as job:
        assert_same_answers(_answers(job.url), expected)
        pids = job.rank_pids()
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        assert job.wait(timeout=90) != 0
        assert time.monotonic() - started < 90
        assert "exitcode" in "".join(job.log)


@pytest.mark.slow
def test_tp2_serves_a_torch_dist_checkpoint(checkpoint, server, tmp_path) -> None:
    dist_checkpoint = tmp_path / "tiny-gpt2-dist"
    subprocess.run(
        [
            str(BIN / "mg-convert"),
            "format",
            *("--to", "torch_dist", "--load", str(checkpoint), "--save", str(dist_checkpoint)),
            "--target-tensor-parallel-size=2",
        ],
        check=True,
        capture_output=True,
    )
    with torchrun_server(dist_checkpoint) as job:
        assert_same_answers(_answers(job.url), _answers(server.url))


def test_idle_engine_heartbeats_and_closes_its_runner_once(loaded) -> None:
    """What keeps the other ranks' wait under the timeout, and what stops them."""
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.runner import ModelRunner
    from mg.generate_server.sampling import SamplingParams

    class CountingRunner(ModelRunner):
        beats = 0
        closed = 0

        def heartbeat(self) -> None:
            self.beats += 1

        def close(self) -> None:
            self.closed += 1

    runner = CountingRunner(loaded.model, 2, 32)
    runner.heartbeat_seconds = 0.02
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, loaded.tokenizer.vocab_size)
    time.sleep(0.3)
    events = engine.generate([464, 1524], SamplingParams(max_new_tokens=3, top_k=1))
    assert events[-1].finish_reason == "length" and len(events) == 4
    engine.shutdown()
    assert runner.beats >= 3 and runner.closed == 1
