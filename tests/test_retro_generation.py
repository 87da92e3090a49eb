"""Generation with retrieval on tiny checkpoints and a real `mg-prep retro` project:
`mg-eval qa` end to end (a Retro model retrieving as it generates, a GPT answering from
the prompt, the report and predictions written, a project that does not fit refused
in one line) and `mg-serve` answering a Retro checkpoint's requests with retrieval."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import uvicorn

pytest.importorskip("faiss")

from mg.core.checkpoint.model_io import save_model  # noqa: E402
from mg.core.fixtures import gpt2_bpe_tokenizer_config  # noqa: E402
from mg.core.models import GPTModel, TransformerConfig  # noqa: E402
from mg.core.models.retro import RetroConfig, RetroModel  # noqa: E402
from mg.core.retro.generation import next_token_logits, retro_greedy_generate  # noqa: E402
from mg.corpus_prep.cli import main as prep_main  # noqa: E402
from mg.evaluate.cli import main as eval_main  # noqa: E402
from mg.evaluate.retro_loading import load_retro, retriever_for  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "packages" / "corpus-prep" / "tests"))
from retro_corpus import botchan_documents, retro_argv, tiny_bert, write_dataset  # noqa: E402

SHAPE = dict(
    hidden_size=16,
    num_attention_heads=2,
    ffn_hidden_size=32,
    vocab_size=50304,
    seq_length=128,
    max_position_embeddings=128,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
QUESTIONS = [
    {"question": "Who is the narrator's servant?", "answers": ["Kiyo"]},
    {"question": "Where does he teach?", "answers": ["a middle school", "Shikoku"]},
    {"question": "What is he?", "answers": ["a teacher"], "context": "He is a teacher."},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("eval_retro_qa")
    data = write_dataset(root / "data" / "botchan", botchan_documents(count=60))
    project = root / "project"
    with pytest.raises(SystemExit) as stop:
        prep_main(retro_argv(project, [data], tiny_bert(root / "bert")))
    assert stop.value.code in (0, None)
    tokenizer = gpt2_bpe_tokenizer_config()
    torch.manual_seed(0)
    retro = {}
    for chunk in (32, 16):
        config = RetroConfig(
            num_layers=6,
            **SHAPE,
            retro_chunk_length=chunk,
            retro_encoder_num_layers=1,
            retro_num_neighbors=2,
            retro_num_retrieved_chunks=2,
            retro_encoder_hidden_dropout=0.0,
            retro_encoder_attention_dropout=0.0,
        )
        retro[chunk] = root / f"retro{chunk}"
        save_model(
            retro[chunk],
            RetroModel(config),
            config,
            tokenizer,
            args={"retro_project_dir": str(project)},
        )
    gpt_config = TransformerConfig(num_layers=2, **SHAPE)
    save_model(root / "gpt", GPTModel(gpt_config), gpt_config, tokenizer)
    questions = root / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return {
        "root": root,
        "project": project,
        "retro": retro[32],
        "retro16": retro[16],
        "gpt": root / "gpt",
        "questions": questions,
    }


def run(argv: list[str]) -> int:
    try:
        return eval_main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


def test_padding_to_whole_chunks_does_not_change_the_next_token(setup: dict) -> None:
    """The logits after s tokens are those of the sequence padded by a further chunk: the
    padding and an incomplete chunk's (unseen) neighbours cannot reach the last token."""
    loaded = load_retro(setup["retro"])
    retriever = retriever_for(loaded, None)
    tokens = loaded.tokenizer.tokenize(" ".join(botchan_documents(3, 1))[:400])[:70]
    assert len(tokens) == 70  # 2 complete chunks of 32 and 6 tokens
    logits = next_token_logits(loaded.model, retriever, tokens)
    ids = torch.full((1, 128), loaded.tokenizer.eod, dtype=torch.long)
    ids[0, :70] = torch.tensor(tokens)
    context = np.concatenate(
        [retriever.neighbor_tokens(tokens), np.full((1, 2, 64), loaded.tokenizer.eod)]
    )
    with torch.inference_mode():
        wide = loaded.model(ids, context_input_ids=torch.from_numpy(context).reshape(-1, 64))
    torch.testing.assert_close(logits, wide[0, 69], rtol=1e-5, atol=1e-5)
    out = retro_greedy_generate(loaded.model, retriever, tokens, 5)
    assert len(out) == 5 and out[0] == int(logits.argmax())
    assert len(retriever._cache) == 2  # the complete chunks, each searched once


def test_qa_on_a_retro_checkpoint_retrieves_and_reports(setup: dict) -> None:
    report, output = setup["root"] / "report.jsonl", setup["root"] / "pred.jsonl"
    argv = ["qa", "--load", str(setup["retro"]), "--valid-data", str(setup["questions"])]
    argv += ["--max-new-tokens", "4", "--report", str(report), "--output-path", str(output)]
    assert run(argv) == 0
    record = json.loads(report.read_text().splitlines()[-1])
    assert record["task"] == "qa" and record["retro_project_dir"] == str(setup["project"])
    metrics = record["metrics"]
    assert metrics["num_examples"] == 3 and 0 <= metrics["exact_match"] <= metrics["f1"] <= 1
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["answers"] for r in rows] == [q["answers"] for q in QUESTIONS]


def test_qa_on_a_gpt_checkpoint(setup: dict, capsys: pytest.CaptureFixture) -> None:
    argv = ["qa", "--load", str(setup["gpt"]), "--valid-data", str(setup["questions"])]
    assert run([*argv, "--max-new-tokens", "3"]) == 0
    assert "validation results on QA | exact match:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("which", "extra", "message"),
    [
        ("retro16", [], r"--retro-project-dir .*chunks are 32 tokens.*model's are 16"),
        ("retro", ["--retro-project-dir", "nowhere"], "--retro-project-dir nowhere: no such"),
        ("gpt", ["--retro-num-neighbors", "3"], "--retro-project-dir / --retro-num-neighbors"),
        ("retro", ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    setup: dict, capsys: pytest.CaptureFixture, which: str, extra: list[str], message: str
) -> None:
    argv = ["qa", "--load", str(setup[which]), "--valid-data", str(setup["questions"]), *extra]
    assert run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mg-eval qa: error:")
    assert re.search(message, err), err


@pytest.mark.slow
def test_qa_on_an_mg_train_retro_checkpoint(setup: dict, tmp_path: Path) -> None:
    """Two steps of `mg-train retro` on the project, saved; `mg-eval qa` finds the project
    in the checkpoint's args and answers."""
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    gpt = gpt2_bpe_tokenizer_config()
    data = str(setup["root"] / "data" / "botchan")
    argv = [
        "retro",
        *("--num-layers", "6", "--hidden-size", "16", "--num-attention-heads", "2"),
        *("--seq-length", "128", "--max-position-embeddings", "128"),
        *("--lr", "1e-3", "--micro-batch-size", "2", "--global-batch-size", "4"),
        *("--train-iters", "2", "--eval-iters", "0", "--log-interval", "1000"),
        *("--data-path", data, "--split", "90,10,0"),
        *("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt.vocab_file),
        *("--merge-file", gpt.merge_file, "--data-cache-path", str(tmp_path / "cache")),
        *("--retro-add-retriever", "--retro-project-dir", str(setup["project"])),
        *("--retro-encoder-layers", "1", "--save", str(tmp_path / "ckpt")),
        *("--ckpt-format", "torch", "--save-interval", "2"),
    ]
    Trainer(parse_args(argv)).train()
    report = tmp_path / "report.jsonl"
    qa = ["qa", "--load", str(tmp_path / "ckpt"), "--valid-data", str(setup["questions"])]
    assert run([*qa, "--max-new-tokens", "2", "--report", str(report)]) == 0
    record = json.loads(report.read_text())
    assert record["iteration"] == 2 and record["metrics"]["num_examples"] == 3
    assert Path(record["retro_project_dir"]) == setup["project"]


@contextmanager
def retro_server(setup: dict, **flags: object):
    """mg-serve's Retro path (load, runner, engine, app) on a loopback port in a thread."""
    import argparse

    from mg.generate_server.app import ServerSettings, create_app
    from mg.generate_server.cli import build_parser
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.megatron_api import Limits
    from mg.generate_server.retro_serving import (
        RetroRunner,
        is_retro_checkpoint,
        load_retro_for_serving,
        retro_max_length,
    )

    args: argparse.Namespace = build_parser().parse_args(["--load", str(setup["retro"])])
    for key, value in flags.items():
        setattr(args, key, value)
    assert is_retro_checkpoint(args.load) and not is_retro_checkpoint(setup["gpt"])
    loaded = load_retro_for_serving(args, torch.device("cpu"), None)
    max_length = retro_max_length(args, loaded)
    runner = RetroRunner(loaded.model, loaded.retriever, 2, max_length)
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, loaded.tokenizer.vocab_size)
    app = create_app(engine, loaded.tokenizer, loaded.name, ServerSettings(Limits(max_length)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", loaded
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        sock.close()


def test_serve_answers_with_retrieval_as_the_greedy_reference(setup: dict) -> None:
    """PUT /api and POST /v1/completions on a Retro checkpoint: two prompts at once, one
    completing a second chunk while it generates; the tokens are core's greedy Retro
    generation with the same retrieval."""
    text = " ".join(botchan_documents(5, 1))
    with retro_server(setup) as (url, loaded):
        tok = loaded.tokenizer
        long_prompt = tok.detokenize(tok.tokenize(text)[:40])
        prompts = [long_prompt, "The school"]
        body = {"prompts": prompts, "tokens_to_generate": 30, "top_k": 1}
        r = httpx.put(url + "/api", json=body, timeout=120)
        assert r.status_code == 200, r.text
        reference = setup_retriever(setup, loaded)
        for prompt, got in zip(prompts, r.json()["text"], strict=True):
            expected = retro_greedy_generate(loaded.model, reference, tok.tokenize(prompt), 30)
            assert tok.eod not in expected
            assert got == prompt + tok.detokenize(expected)
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": long_prompt, "max_tokens": 5, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        expected = retro_greedy_generate(loaded.model, reference, tok.tokenize(long_prompt), 5)
        assert r.json()["choices"][0]["text"] == tok.detokenize(expected)


def setup_retriever(setup: dict, loaded) -> object:
    """A second retriever of the project (its own chunk cache) for the reference."""
    from mg.core.retro.retrieval import open_retriever
    from mg.indexed_dataset import IndexedDataset

    c = loaded.config
    return open_retriever(
        setup["project"],
        loaded.tokenizer,
        c.retro_chunk_length,
        c.retro_num_neighbors,
        c.retro_num_retrieved_chunks,
        IndexedDataset,
    )


def test_serve_refuses_a_project_that_does_not_fit(setup: dict) -> None:
    from mg.generate_server.errors import ServeSetupError

    short = retro_server(dict(setup, retro=setup["retro16"]))
    with pytest.raises(ServeSetupError, match=r"^--retro-project-dir .*: its chunks are 32"), short:
        pass
    none = retro_server(setup, retro_num_neighbors=0)
    with pytest.raises(ServeSetupError, match="^--retro-num-neighbors must be >= 1"), none:
        pass


def test_mg_serve_cli_error_is_one_line_exit_2(setup: dict, capsys: pytest.CaptureFixture) -> None:
    from mg.generate_server.cli import main as serve_main

    with pytest.raises(SystemExit) as stop:
        serve_main(["--load", str(setup["retro"]), "--retro-project-dir", str(setup["root"])])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mg-serve: error: --retro-project-dir ") and "not a Retro project" in err
