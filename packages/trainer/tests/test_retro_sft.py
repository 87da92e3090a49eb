"""`mg-train retro --sft` (InstructRetro): `mg-prep sft` conversations, one a sample, with
the neighbours generation retrieves for them; a short finetune whose held-out
assistant-token loss falls; combinations refused in one line.

The project is test_retro_training's (its corpus and chunk database) plus what
retrieval needs: a small random BERT over the MiniLM vocabulary and a Flat index of
the database chunks' embeddings."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

faiss = pytest.importorskip("faiss")

from mg.core.checkpoint.model_io import save_model  # noqa: E402
from mg.core.fixtures import fixture_path  # noqa: E402
from mg.core.models.bert import BertModel  # noqa: E402
from mg.core.models.config import TransformerConfig  # noqa: E402
from mg.core.retro.bert_embedder import BertEmbedder, load_bert_checkpoint  # noqa: E402
from mg.core.retro.files import read_json, write_json  # noqa: E402
from mg.core.retro.project import ProjectPaths, read_database_fingerprint  # noqa: E402
from mg.core.retro.retrieval import open_retriever  # noqa: E402
from mg.core.tokenizers import TokenizerConfig, build_tokenizer  # noqa: E402
from mg.indexed_dataset import IndexedDataset  # noqa: E402
from mg.trainer.arguments import ArgumentError, parse_args  # noqa: E402
from mg.trainer.families import get_family  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_retro_training import CHUNK, write_corpus, write_project  # noqa: E402
from test_sft import ASSISTANT, END, SYSTEM, USER, write_sft_data  # noqa: E402

VOCAB = 127  # --vocab-size: NullTokenizer ids 0..126, end of document 127
SEQ = 16  # two chunks: a conversation (12-15 tokens) fills the first, not the second


def add_retrieval(root: Path, project: Path) -> None:
    """A random 2-layer BERT and a Flat inner-product index over every database chunk's
    text, recorded in the project as `mg-prep retro` records them."""
    torch.manual_seed(0)
    bert_config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=30592,
        seq_length=64,
        max_position_embeddings=64,
        transformer_layer_order="post_ln",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    vocab = str(fixture_path("minilm-bert", "vocab.txt"))
    bert_dir = root / "bert"
    save_model(
        bert_dir,
        BertModel(bert_config, add_binary_head=True, num_tokentypes=2),
        bert_config,
        TokenizerConfig("BertWordPieceLowerCase", vocab_file=vocab),
    )
    paths = ProjectPaths.of(project)
    config = read_json(paths.config)
    config.update(
        load=str(bert_dir),
        retro_bert_tokenizer_type="BertWordPieceLowerCase",
        retro_bert_vocab_file=vocab,
        retro_bert_max_chunk_length=64,
    )
    write_json(paths.config, config)
    gpt = build_tokenizer(TokenizerConfig("NullTokenizer", vocab_size=VOCAB))
    source = IndexedDataset(read_json(paths.datasets)[0]["prefix"])
    texts = [
        gpt.detokenize(source.get(int(doc), offset=int(start), length=int(end - start)))
        for _, doc, start, end, _ in np.load(paths.chunks)
    ]
    bert = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=vocab))
    embedder = BertEmbedder(load_bert_checkpoint(bert_dir).model, bert, 64, 64, normalize=True)
    vectors = embedder.embed(texts)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    paths.index_dir.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(paths.added_index))
    write_json(
        paths.index_manifest, {"database": read_database_fingerprint(paths), "added": len(texts)}
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("retro_sft")
    prefix = write_corpus(root / "data" / "corpus")
    project_dir = write_project(root / "project", prefix)
    add_retrieval(root, project_dir)
    chats = root / "chats"
    chats.mkdir()
    return {"dir": str(project_dir), "chats": write_sft_data(chats, 600)}


def sft_argv(project: dict, tmp_path: Path, *extra: str, iters: int = 30) -> list[str]:
    return [
        "retro",
        "--sft",
        *("--retro-add-retriever", "--retro-project-dir", project["dir"]),
        *("--retro-encoder-hidden-dropout", "0", "--retro-encoder-attention-dropout", "0"),
        *("--retro-encoder-layers", "1", "--retro-num-neighbors", "2"),
        *("--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4"),
        *("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)),
        *("--position-embedding-type", "rope"),
        *("--lr", "6e-3", "--min-lr", "6e-4", "--lr-decay-style", "cosine"),
        *("--lr-warmup-iters", "3", "--micro-batch-size", "8", "--global-batch-size", "8"),
        *("--train-iters", str(iters), "--eval-interval", "3", "--eval-iters", "4"),
        *("--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1000"),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)),
        *("--data-path", project["chats"], "--split", "90,10,0", "--seed", "1234"),
        *("--ckpt-format", "torch"),
        *extra,
    ]


def test_a_sample_is_one_conversation_with_the_neighbours_generation_retrieves(
    project: dict, tmp_path: Path
) -> None:
    args = parse_args(sft_argv(project, tmp_path))
    tokenizer = build_tokenizer(TokenizerConfig("NullTokenizer", vocab_size=VOCAB))
    train, valid, test = get_family("retro").build_datasets(args, tokenizer, [40, 16, 0])
    assert len(train) == 40 and len(valid) == 16 and test is None
    # a retriever of its own (an empty cache), as mg-eval qa opens one
    retriever = open_retriever(project["dir"], tokenizer, CHUNK, 2, 2, IndexedDataset)
    eod = tokenizer.eod
    searched = 0
    for data, i in ((train, 0), (train, 7), (train, 39), (valid, 3)):
        sample = data[i]
        tokens, labels, loss = sample["tokens"], sample["labels"], sample["loss_mask"]
        # one conversation, from position 0, then padding without loss
        assert tokens[0] == SYSTEM and (tokens == SYSTEM).sum() == 1
        length = int(np.flatnonzero(tokens == END)[-1]) + 1  # through its last END token
        assert (tokens[length:] == 0).all() and not loss[length:].any()
        assert (sample["position_ids"][:length] == np.arange(length)).all()
        # the loss on the answer (ids 70..119) and its END only
        assert set(labels[loss == 1].tolist()) <= set(range(70, 120)) | {END}
        for token in (SYSTEM, USER, ASSISTANT, *range(10, 60)):
            assert not loss[labels == token].any()
        assert int(loss.sum()) == 4  # three answer tokens and END
        # neighbours [l, k, r]: Retriever.neighbor_tokens of the conversation's tokens
        neighbours = sample["neighbor_tokens"]
        assert neighbours.shape == (SEQ // CHUNK, 2, 2 * CHUNK)
        expected = retriever.neighbor_tokens(tokens[:length].tolist())
        np.testing.assert_array_equal(neighbours[: len(expected)], expected)
        assert (neighbours[len(expected) :] == eod).all()
        assert length < 2 * CHUNK and (neighbours[1] == eod).all()  # incomplete chunk
        searched += (neighbours[0] != eod).any()
    assert searched == 4  # every first chunk found database text


def test_short_instruct_retro_run_held_out_assistant_loss_falls(
    project: dict, tmp_path: Path
) -> None:
    from mg.trainer.training import Trainer

    argv = sft_argv(project, tmp_path, "--sft-tokenizer-prompt-format", "chatml")
    result = Trainer(parse_args(argv)).train()
    assert len(result.losses) == 30
    (first_it, first), *_, (last_it, last) = result.validation
    assert (first_it, last_it) == (3, 30)
    # held-out answers (32 conversations, 128 assistant tokens): 4.65 at iteration 3, about
    # a guess over the vocabulary; 3.32 at iteration 30 (the answers' range and END learnt)
    assert last < first - 1.0, result.validation
    assert last < 3.6, result.validation


def test_megatron_instruct_retro_gate_zero_trains(project: dict, tmp_path: Path) -> None:
    """`--retro-attention-gate 0`, as Megatron's InstructRetro scripts run it."""
    from mg.trainer.training import Trainer

    argv = sft_argv(project, tmp_path, "--retro-attention-gate", "0", iters=6)
    trainer = Trainer(parse_args(argv))
    assert trainer.model_config.retro_attention_gate == 0.0
    result = trainer.train()
    assert len(result.losses) == 6 and all(np.isfinite(result.losses))


def test_bad_combinations_are_refused_in_one_line(
    project: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from mg.trainer.cli import main

    # a project whose BERT is gone
    copy = tmp_path / "project"
    shutil.copytree(project["dir"], copy)
    config = json.loads((copy / "config.json").read_text())
    config["load"] = str(tmp_path / "no_bert")
    (copy / "config.json").write_text(json.dumps(config))
    gone = {**project, "dir": str(copy)}
    with pytest.raises(ArgumentError, match=r"^--sft with --retro-project-dir .*BERT checkpoint"):
        parse_args(sft_argv(gone, tmp_path))
    assert main(sft_argv(gone, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_bert" in err and "--sft" in err
    # no finished index
    (copy / "index" / "added.faissindex").unlink()
    config["load"] = read_json(ProjectPaths.of(project["dir"]).config)["load"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArgumentError, match="no finished index"):
        parse_args(sft_argv(gone, tmp_path))
    # a sequence length off the chunk grid
    assert main(sft_argv(project, tmp_path, "--seq-length", "20")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--seq-length 20 is not a multiple of the project's --retro-gpt-chunk-length" in err
