"""The pipeline's guarantees: bounded read-ahead, input order, no hang when a worker dies."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mg.core.fixtures import fixture_path
from mg.core.tokenizers import TokenizerConfig
from mg.corpus_prep import pipeline
from mg.corpus_prep.encoder import Chunk, DocumentEncoder, EncoderSpec
from mg.corpus_prep.splitter import SplitterSpec

SPEC = EncoderSpec(
    json_keys=("text",),
    append_eod=True,
    tokenizer_config=TokenizerConfig(
        "GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    ),
    splitter=SplitterSpec("none"),
    dtype="uint16",
)


def chunks(count: int, pulled: list[int]):
    for i in range(count):
        pulled.append(i)
        line = json.dumps({"text": f"document number {i}"}).encode()
        yield Chunk("mem.jsonl", i + 1, [line], len(line) + 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_read_ahead_is_bounded_and_results_come_in_input_order(workers):
    pulled: list[int] = []
    limit = max(2, pipeline.IN_FLIGHT_PER_WORKER * workers)
    results = pipeline.encode_in_order(chunks(200, pulled), SPEC, workers)
    for done, encoded in enumerate(results, start=1):
        # never more than `limit` chunks read but not yet handed back
        assert len(pulled) - done <= limit
        assert encoded.documents == 1
        ids = encoded.keys["text"].tokens
        assert ids[-1] == 50256 and ids.dtype == np.uint16
    assert len(pulled) == 200


def test_order_is_kept_even_when_early_chunks_are_slow():
    lines = [
        json.dumps({"text": "word " * (20000 if i % 7 == 0 else 1)}).encode() for i in range(40)
    ]
    chunk_list = [Chunk("o.jsonl", i + 1, [line], len(line)) for i, line in enumerate(lines)]
    got = [c.keys["text"].document_tokens[0] for c in pipeline.encode_in_order(chunk_list, SPEC, 2)]
    assert got == [20002 if i % 7 == 0 else 3 for i in range(40)]  # words, " ", eod


def test_a_worker_that_dies_is_an_error_not_a_hang(monkeypatch):
    def die(self, chunk):
        os._exit(9)

    monkeypatch.setattr(DocumentEncoder, "encode", die)  # inherited by the forked workers
    with pytest.raises(pipeline.WorkerDiedError, match=r"mem\.jsonl lines 1-1 .*fewer --workers"):
        list(pipeline.encode_in_order(chunks(5, []), SPEC, 1))
