"""A tiny GPT-2 (real GPT-2 BPE vocabulary) briefly trained on Botchan, saved as a checkpoint,
and servers for it running on loopback sockets in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import uvicorn

from mg.core.checkpoint import save_model
from mg.core.fixtures import fixture_path
from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.presets import tiny_gpt2
from mg.core.testing.botchan_training import train_on_botchan
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.generate_server import cpu_isa
from mg.generate_server.app import ServerSettings, create_app
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.loading import LoadedModel, load_for_serving
from mg.generate_server.megatron_api import Limits
from mg.generate_server.runner import ModelRunner

SEQ_LENGTH = 64


@pytest.fixture(params=["avx512", "avx2"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each instruction set the vector step (`vector_decode`) is built for, forced through
    `MG_CPU_ISA`; skipped where this CPU lacks it."""
    if cpu_isa.ORDER.index(cpu_isa.available()) < cpu_isa.ORDER.index(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv(cpu_isa.ENVIRONMENT, request.param)
    return request.param


def gpt2_tokenizer_config() -> TokenizerConfig:
    return TokenizerConfig(
        "GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    )


def train_tiny_gpt(
    steps: int = 20, window: int = 32, config: TransformerConfig | None = None
) -> GPTModel:
    """A few steps on Botchan so that predictions are words rather than uniform noise
    (a tiny GPT-2 unless another `config` with the GPT-2 vocabulary is given)."""
    tokenizer = build_tokenizer(gpt2_tokenizer_config())
    torch.manual_seed(1234)
    config = config or tiny_gpt2(
        vocab_size=50304,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=SEQ_LENGTH,
        max_position_embeddings=SEQ_LENGTH,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return train_on_botchan(
        GPTModel(config), tokenizer, steps=steps, window=window, batch_size=4, text_end=60000
    )


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("served") / "tiny-gpt2"
    model = train_tiny_gpt()
    save_model(folder, model, model.config, gpt2_tokenizer_config(), iteration=30)
    return folder


@pytest.fixture(scope="session")
def loaded(checkpoint) -> LoadedModel:
    return load_for_serving(checkpoint)


class RunningServer:
    def __init__(self, url: str, engine: GenerationEngine) -> None:
        self.url = url
        self.engine = engine


@contextmanager
def run_server(
    loaded: LoadedModel,
    slots: int = 4,
    chat_template=None,
    **settings,
) -> Iterator[RunningServer]:
    """uvicorn on a free loopback port in a thread; stopped (and the engine shut down) on exit."""
    max_length = loaded.config.max_position_embeddings
    engine = GenerationEngine(
        ModelRunner(loaded.model, slots, max_length),
        loaded.tokenizer.detokenize,
        vocab_size=loaded.tokenizer.vocab_size,
        max_waiting=settings.pop("max_waiting", 64),
    )
    limits = settings.pop("limits", Limits(max_length))
    app = create_app(
        engine, loaded.tokenizer, loaded.name, ServerSettings(limits, **settings), chat_template
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}", engine)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        sock.close()


@pytest.fixture(scope="session")
def server(loaded) -> Iterator[RunningServer]:
    with run_server(loaded) as running:
        yield running


@pytest.fixture(scope="session")
def start_server():
    """`with start_server(loaded, api_key=..., ...) as running:` for servers with other settings."""
    return run_server
