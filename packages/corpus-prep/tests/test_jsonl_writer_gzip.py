"""A gzip JSONL output is the same bytes whatever temporary name it was written under."""

from __future__ import annotations

from mg.corpus_prep.jsonl_writer import AtomicJsonlWriter


def test_gzip_output_is_byte_identical_across_runs(tmp_path) -> None:
    outputs = []
    for run in ("a", "b"):
        path = tmp_path / run / "out.jsonl.gz"
        path.parent.mkdir()
        with AtomicJsonlWriter(path) as out:
            out.write({"text": "the same document"})
        outputs.append(path.read_bytes())
    assert outputs[0] == outputs[1]
