"""`mg-prep retro` stopped part-way (Ctrl-C) resumes where it stopped: blocks already on
disk are not redone, and the finished project equals one built without interruption; a
finished project is skipped stage by stage."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss")

import mg.corpus_prep.retro_db as retro_db  # noqa: E402
from mg.core.retro.bert_embedder import BertEmbedder  # noqa: E402
from mg.core.retro.files import load_array  # noqa: E402
from mg.core.retro.project import ProjectPaths, read_neighbors  # noqa: E402
from mg.corpus_prep.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from retro_corpus import botchan_documents, retro_argv, tiny_bert, write_dataset  # noqa: E402

FLAGS = {"retro_block_size": 60, "retro_doc_block_size": 10}  # ~5 embedding blocks, 4 db blocks


def run(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("retro_resume")
    data = write_dataset(root / "data" / "a", botchan_documents(count=45))
    bert = tiny_bert(root / "bert")
    reference = root / "reference"
    assert run(retro_argv(reference, [data], bert, **FLAGS)) == 0
    return {"root": root, "data": data, "bert": bert, "reference": reference}


def same_project(a: Path, b: Path) -> None:
    pa, pb = ProjectPaths.of(a), ProjectPaths.of(b)
    assert np.array_equal(load_array(pa.chunks), load_array(pb.chunks))
    files = sorted(p.name for p in pa.db_embeddings.glob("*.npy"))
    assert files == sorted(p.name for p in pb.db_embeddings.glob("*.npy"))
    for name in files:
        assert np.array_equal(
            load_array(pa.db_embeddings / name), load_array(pb.db_embeddings / name)
        )
    for split in ("train", "valid"):
        assert np.array_equal(read_neighbors(pa, split), read_neighbors(pb, split))
    assert not list(a.rglob(".*.tmp-*")), "a temporary file was left behind"


class Counting:
    """Counts calls of a function and raises KeyboardInterrupt at call ``stop_at``."""

    def __init__(self, function, stop_at: int | None = None) -> None:
        self.function, self.stop_at, self.calls = function, stop_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return self.function(*args, **kwargs)


def test_interrupted_embedding_resumes(inputs, monkeypatch, tmp_path):
    project = tmp_path / "p"
    argv = retro_argv(project, [inputs["data"]], inputs["bert"], **FLAGS)
    stopper = Counting(BertEmbedder.embed, stop_at=3)
    monkeypatch.setattr(BertEmbedder, "embed", lambda self, texts: stopper(self, texts))
    assert run(argv) == 130  # 128 + SIGINT, as the other mg-prep commands
    paths = ProjectPaths.of(project)
    assert len(list(paths.db_embeddings.glob("*.npy"))) == 2
    assert not paths.trained_index.exists()
    counter = Counting(BertEmbedder.embed)
    monkeypatch.setattr(BertEmbedder, "embed", lambda self, texts: counter(self, texts))
    assert run(argv) == 0
    db_blocks = len(list(paths.db_embeddings.glob("*.npy")))
    query_blocks = len(list((project / "query").rglob("0*.npy")))
    assert (db_blocks, query_blocks) == (5, 3)
    assert counter.calls == (db_blocks - 2) + query_blocks  # only the missing blocks
    same_project(project, inputs["reference"])


def test_interrupted_database_build_resumes(inputs, monkeypatch, tmp_path):
    project = tmp_path / "p"
    argv = retro_argv(project, [inputs["data"]], inputs["bert"], **FLAGS)
    stopper = Counting(retro_db.chunk_document, stop_at=25)  # in the third block of 10
    monkeypatch.setattr(retro_db, "chunk_document", stopper)
    assert run(argv) == 130
    paths = ProjectPaths.of(project)
    assert sorted(p.name for p in paths.db_blocks(0).glob("*.npy")) == [
        "000000000000-000000000010.npy",
        "000000000010-000000000020.npy",
    ]
    assert not paths.chunks.exists() and not paths.db_manifest.exists()
    counter = Counting(retro_db.chunk_document)
    monkeypatch.setattr(retro_db, "chunk_document", counter)
    assert run(argv) == 0
    assert counter.calls == 40 - 20  # round(0.9 * 45) = 40 training documents, 20 done
    same_project(project, inputs["reference"])


def test_finished_project_is_skipped(inputs, monkeypatch):
    """Nothing is recomputed or rewritten when every stage is complete."""
    reference = inputs["reference"]
    before = {p: p.stat().st_mtime_ns for p in reference.rglob("*") if p.is_file()}
    counter = Counting(BertEmbedder.embed)
    monkeypatch.setattr(BertEmbedder, "embed", lambda self, texts: counter(self, texts))
    chunker = Counting(retro_db.chunk_document)
    monkeypatch.setattr(retro_db, "chunk_document", chunker)
    assert run(retro_argv(reference, [inputs["data"]], inputs["bert"], **FLAGS)) == 0
    assert counter.calls == 0 and chunker.calls == 0
    after = {p: p.stat().st_mtime_ns for p in reference.rglob("*") if p.is_file()}
    changed = [p.relative_to(reference) for p in after if after[p] != before.get(p)]
    assert changed == [Path("config.json")], changed
