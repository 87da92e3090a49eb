"""`mg-eval qa` end to end on tiny checkpoints: a Retro model retrieving from a real
`mg-prep retro` project as it generates, a GPT answering from the prompt, the report
and predictions written, and a project that does not fit refused in one line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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
