"""`mg-prep retro` refuses bad input in one line (exit 2, no traceback) before any work:
a chunk length that does not divide the sequence length, an index string Faiss rejects, a
BERT checkpoint of another vocabulary, a query against another database, a later run
whose arguments differ from the project's record."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("faiss")

from mg.core.retro.project import ProjectPaths, RetroProjectError, read_neighbors  # noqa: E402
from mg.corpus_prep.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from retro_corpus import (  # noqa: E402
    bert_vocab,
    botchan_documents,
    retro_argv,
    tiny_bert,
    write_dataset,
)


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


def one_line_error(code: int, err: str) -> str:
    """The error line, checking it is the only one and comes without a traceback."""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(errors) == 1, err
    print(errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("retro_errors")
    return {
        "root": root,
        "data": write_dataset(root / "data" / "a", botchan_documents(count=40)),
        "other": write_dataset(root / "data" / "b", botchan_documents(first=200, count=40)),
        "bert": tiny_bert(root / "bert"),
    }


@pytest.fixture(scope="module")
def built(small: dict) -> Path:
    project = small["root"] / "built"
    try:
        main(retro_argv(project, [small["data"]], small["bert"], retro_block_size=100))
    except SystemExit as stop:
        assert not stop.code
    return project


def test_chunk_length_must_divide_the_sequence_length(small, capsys, tmp_path):
    argv = retro_argv(tmp_path / "p", [small["data"]], small["bert"], retro_gpt_seq_length=100)
    line = one_line_error(*run(argv, capsys))
    assert "--retro-gpt-seq-length 100" in line and "--retro-gpt-chunk-length 32" in line
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("index_str", ["IVFbogus,PQ8", "PQ7", "Flat,Flat"])
def test_index_string_faiss_rejects(small, capsys, tmp_path, index_str):
    """Refused before the database is built (the BERT's width is known from --load)."""
    argv = retro_argv(tmp_path / "p", [small["data"]], small["bert"], retro_index_str=index_str)
    line = one_line_error(*run(argv, capsys))
    assert f"--retro-index-str {index_str!r}" in line and "Faiss rejects it" in line
    assert not (tmp_path / "p").exists()


def test_bert_vocabulary_differs_from_the_database_tokenizer(small, capsys, tmp_path):
    """A BERT trained with another vocabulary (two ids swapped) than --retro-bert-vocab-file."""
    words = Path(bert_vocab()).read_text().splitlines()
    words[2000], words[2001] = words[2001], words[2000]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    bert = tiny_bert(tmp_path / "bert", vocab_file=str(tmp_path / "vocab.txt"))
    argv = retro_argv(tmp_path / "p", [small["data"]], bert, retro_bert_vocab_file=bert_vocab())
    argv += ["--retro-bert-tokenizer-type", "BertWordPieceLowerCase"]
    line = one_line_error(*run(argv, capsys))
    assert f"--load {bert}" in line and "another vocabulary" in line and "id 2000" in line


def test_bert_smaller_than_the_vocabulary(small, capsys, tmp_path):
    """A BERT whose embedding table has fewer rows than the tokenizer has ids."""
    from mg.core.checkpoint.model_io import save_model
    from mg.core.models.bert import BertModel
    from mg.core.models.config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=1000,
        seq_length=64,
        max_position_embeddings=64,
        transformer_layer_order="post_ln",
    )
    save_model(tmp_path / "bert", BertModel(config), config, None)
    argv = retro_argv(tmp_path / "p", [small["data"]], str(tmp_path / "bert"))
    argv += ["--retro-bert-tokenizer-type", "BertWordPieceLowerCase"]
    argv += ["--retro-bert-vocab-file", bert_vocab()]
    line = one_line_error(*run(argv, capsys))
    assert "embeds 1000 token ids" in line and "30524" in line


def test_query_against_another_database(small, built, capsys, tmp_path):
    """An index (or neighbours) made from one database is refused against another."""
    other = tmp_path / "other"
    argv = retro_argv(other, [small["other"]], small["bert"], retro_tasks="db-build")
    assert run(argv, capsys)[0] == 0
    shutil.copytree(built / "index", other / "index")
    argv = retro_argv(other, [small["other"]], small["bert"], retro_tasks="query-neighbors")
    line = one_line_error(*run(argv, capsys))
    assert "added.faissindex was built from database" in line and "index-build" in line
    shutil.copytree(built / "query", other / "query")
    with pytest.raises(RetroProjectError, match="queried against database") as caught:
        read_neighbors(ProjectPaths.of(other), "train")
    assert "\n" not in str(caught.value)


def test_later_run_must_agree_with_the_record(small, built, capsys):
    """A differing flag is refused by name; flags left out are taken from the record, and a
    finished project is skipped stage by stage."""
    argv = retro_argv(built, [small["data"]], small["bert"], retro_gpt_chunk_length=16)
    line = one_line_error(*run(argv, capsys))
    assert "--retro-gpt-chunk-length 16 differs from the 32" in line
    code, err = run(
        ["retro", "--retro-project-dir", str(built), "--retro-tasks", "query-neighbors"], capsys
    )
    assert code == 0, err
    assert "train is complete, skipped" in err and "valid is complete, skipped" in err


def test_other_mistakes(small, built, capsys, tmp_path):
    line = one_line_error(
        *run(
            retro_argv(
                tmp_path / "p", [small["data"]], small["bert"], retro_tasks="db-build,query"
            ),
            capsys,
        )
    )
    assert "--retro-tasks: unknown task 'query'" in line
    argv = retro_argv(tmp_path / "q", [small["data"]], small["bert"], retro_index_ntrain=10**6)
    line = one_line_error(*run(argv, capsys))
    assert "--retro-index-ntrain 1000000" in line
    argv = retro_argv(tmp_path / "r", [str(tmp_path / "missing")], small["bert"])
    line = one_line_error(*run(argv, capsys))
    assert "--retro-gpt-data-path" in line
    argv = retro_argv(tmp_path / "s", [small["data"]], str(tmp_path / "nobert"))
    line = one_line_error(*run(argv, capsys))
    assert "--load" in line and "no such checkpoint folder" in line
