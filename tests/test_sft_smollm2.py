"""SFT data from a real chat model's tokenizer: SmolLM2-135M-Instruct's, as import-gguf
writes it from the GGUF (fixture ``smollm2-gguf``), with its own ChatML template (a
default system turn when the conversation has none). `mg-prep sft` gives transformers'
`apply_chat_template` ids token for token, with the loss mask on the replies only; then
`mg-train gpt --sft` reads what it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from mg.ckpt_convert.gguf_file import metadata, open_reader  # noqa: E402
from mg.ckpt_convert.gguf_tokenizer import write_tokenizer  # noqa: E402
from mg.core.fixtures import FixtureError, fixture_path  # noqa: E402
from mg.corpus_prep.chat_format import load_encoder  # noqa: E402
from mg.corpus_prep.cli import main as prep_main  # noqa: E402
from mg.indexed_dataset import IndexedDataset  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compat]

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
        {"role": "assistant", "content": "Green."},
    ],
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory) -> Path:
    try:
        gguf = fixture_path("smollm2-gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    except FixtureError as exc:
        pytest.skip(f"fixture smollm2-gguf cannot be fetched: {exc}")
    folder = tmp_path_factory.mktemp("smollm2") / "tokenizer"
    assert write_tokenizer(metadata(open_reader(gguf)), gguf, folder, 2048)
    return folder


def test_ids_and_mask_on_smollm2s_own_template(smollm2_tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm2_tokenizer))
    encoder = load_encoder(str(smollm2_tokenizer), None)
    im_end = encoder.tokenizer.token_to_id("<|im_end|>")
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=True, return_dict=False)
        ids, mask = encoder.encode(messages)
        assert ids.tolist() == list(expected)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        kept = encoder.tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
        assert kept == "<|im_end|>".join(replies) + "<|im_end|>"
        # one <|im_end|> per turn (+1 for the default system turn); only replies' count
        assert int(((ids == im_end) & (mask == 1)).sum()) == len(replies)
    text = reference.decode(ids[mask == 0].tolist())
    assert "You answer in one word." in text and "And grass?" in text


def test_prep_then_sft_training_reads_it(smollm2_tokenizer, tmp_path, capsys):
    from mg.trainer.arguments import parse_args
    from mg.trainer.sft_data import sft_datasets

    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 20))
    prefix = tmp_path / "chats"
    with pytest.raises(SystemExit) as done:
        prep_main(["sft", "--input", str(source), "--output-prefix", str(prefix),
                   "--tokenizer-model", str(smollm2_tokenizer)])  # fmt: skip
    assert done.value.code == 0
    data = f"{prefix}_text_document"
    assert len(IndexedDataset(data)) == 40
    argv = [
        "gpt", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--lr", "1e-3",
        "--micro-batch-size", "2", "--train-iters", "2", "--split", "90,10,0",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(smollm2_tokenizer),
        "--data-path", data, "--sft", "--sft-tokenizer-prompt-format", "chat_template",
    ]  # fmt: skip
    train, valid, _ = sft_datasets(parse_args(argv), [4, 2, None])
    replies = {m["content"] for c in CONVERSATIONS for m in c if m["role"] == "assistant"}
    tokenizer = load_encoder(str(smollm2_tokenizer), None).tokenizer
    for sample in (train[0], train[1], valid[0]):
        targets = sample["labels"][sample["loss_mask"] == 1].tolist()
        text = tokenizer.decode(targets, skip_special_tokens=False)
        # the targets with loss are whole replies, each closed by its <|im_end|>
        pieces = text.split("<|im_end|>")
        assert pieces[-1] == "" and len(pieces) >= 3
        assert set(pieces[:-1]) <= replies
        assert (np.diff(np.flatnonzero(sample["position_ids"] == 0)) > 1).all()
