"""Real text through `mg-prep tokenize` into GPT samples, checked against Megatron-Core.

The whole first half of the workflow with real tools and data: a JSONL corpus
made of Botchan passages is tokenized by the `mg-prep` command (GPT-2 BPE,
`--append-eod`), opened by both our reader and Megatron-Core's, and cut into
GPT samples by both our `build_gpt_datasets` and Megatron-Core's
`BlendedMegatronDatasetBuilder`. The samples must be identical and decode
back to text of the corpus.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from mg.core.fixtures import fixture_path
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.indexed_dataset import GPTDatasetConfig, IndexedDataset, build_gpt_datasets

SEQ_LENGTH = 128
NUM_SAMPLES = [400, 40, 10]
# Botchan makes ~215 documents: 969,30,1 would leave the test split empty, on which
# Megatron-Core loops forever; 90,8,2 gives every split documents.
SPLIT = "90,8,2"


@pytest.fixture(scope="module")
def gpt2_tokenizer_config() -> TokenizerConfig:
    return TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    )


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_config) -> Path:
    """Botchan in passages of 20 lines, tokenized by the real `mg-prep tokenize` command."""
    folder = tmp_path_factory.mktemp("prep")
    lines = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8-sig").splitlines()
    corpus = folder / "botchan.jsonl"
    with corpus.open("w", encoding="utf-8") as out:
        for start in range(0, len(lines), 20):
            out.write(json.dumps({"text": "\n".join(lines[start : start + 20])}) + "\n")
    command = [
        sys.executable, "-m", "mg.corpus_prep", "tokenize",
        "--input", str(corpus),
        "--output-prefix", str(folder / "botchan"),
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", gpt2_tokenizer_config.vocab_file,
        "--merge-file", gpt2_tokenizer_config.merge_file,
        "--append-eod", "--workers", "2",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    return folder / "botchan_text_document"


def test_prep_output_is_what_the_tokenizer_says(prefix: Path, gpt2_tokenizer_config) -> None:
    tokenizer = build_tokenizer(gpt2_tokenizer_config)
    dataset = IndexedDataset(str(prefix))
    lines = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8-sig").splitlines()
    passages = ["\n".join(lines[s : s + 20]) for s in range(0, len(lines), 20)]
    assert len(dataset) == dataset.num_documents == len(passages)
    assert dataset.dtype == np.uint16
    for index in (0, 1, len(passages) // 2, len(passages) - 1):
        expected = tokenizer.tokenize(passages[index]) + [tokenizer.eod]
        assert dataset[index].tolist() == expected
        assert tokenizer.detokenize(dataset[index][:-1].tolist()) == passages[index]


def test_samples_match_megatron_core(prefix: Path, gpt2_tokenizer_config) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
        pytest.importorskip("megatron.core")
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
        from megatron.core.datasets.gpt_dataset import (
            GPTDatasetConfig as MegatronGPTDatasetConfig,
        )

    tokenizer = build_tokenizer(gpt2_tokenizer_config)

    class TokenizerForMegatron:
        eod = tokenizer.eod
        vocab_size = tokenizer.vocab_size
        unique_identifiers = {"class": "GPT2BPETokenizer"}

    theirs_config = MegatronGPTDatasetConfig(
        random_seed=1234,
        sequence_length=SEQ_LENGTH,
        blend=([str(prefix)], None),
        split=SPLIT,
        path_to_cache=str(prefix.parent / "megatron-cache"),
        tokenizer=TokenizerForMegatron(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=0.005,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = BlendedMegatronDatasetBuilder(
            MegatronGPTDataset, NUM_SAMPLES, lambda: True, theirs_config
        ).build()
    ours = build_gpt_datasets(
        [str(prefix)],
        NUM_SAMPLES,
        GPTDatasetConfig(
            seq_length=SEQ_LENGTH,
            seed=1234,
            split=SPLIT,
            eod_token_id=tokenizer.eod,
            path_to_cache=str(prefix.parent / "our-cache"),
        ),
    )
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8-sig")
    for our_split, their_split in zip(ours, theirs, strict=True):
        assert our_split is not None and their_split is not None
        assert len(our_split) == len(their_split)
        for k in range(min(50, len(our_split))):
            our_sample, their_sample = our_split[k], their_split[k]
            np.testing.assert_array_equal(our_sample["tokens"], their_sample["tokens"].numpy())
            np.testing.assert_array_equal(our_sample["labels"], their_sample["labels"].numpy())
            np.testing.assert_array_equal(
                our_sample["loss_mask"], their_sample["loss_mask"].numpy()
            )
        # A sample decodes to text of the corpus (up to the document breaks at eod).
        first = our_split[0]["tokens"].tolist()
        piece = max(tokenizer.detokenize(first).split("<|endoftext|>"), key=len)
        assert piece.strip()[:60] in text.replace("\r\n", "\n")
