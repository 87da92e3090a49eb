"""`mg-prep sft`: conversations to ids and a loss mask. The ids equal transformers'
`apply_chat_template` token for token (the real GPT-2 BPE vocabulary with ChatML tokens
added, and a template with a default system turn); the mask is 1 on the assistant's
tokens and their <|im_end|> only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mg.core.testing.tokenizer_folders import chatml_tokenizer_folder
from mg.corpus_prep.chat_format import ChatFormatError, load_encoder, messages_of
from mg.corpus_prep.cli import main
from mg.indexed_dataset import IndexedDataset

# Qwen2-style: ChatML with a system turn of its own when the conversation has none.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": " Rome, since 1871."},
]


@pytest.fixture(scope="module")
def chatml_folder(tmp_path_factory) -> Path:
    """A Hugging Face tokenizer folder: GPT-2's real BPE plus <|im_start|>, <|im_end|>."""
    return chatml_tokenizer_folder(
        tmp_path_factory.mktemp("chatml"), TEMPLATE, eos_token="<|im_end|>"
    )


def test_ids_equal_transformers_apply_chat_template(chatml_folder):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(chatml_folder))
    for messages in (CHAT, CHAT[1:]):
        expected = reference.apply_chat_template(messages, tokenize=True, return_dict=False)
        ids, mask = load_encoder(str(chatml_folder), None).encode(messages)
        assert ids.tolist() == list(expected)
        assert len(mask) == len(ids)
    # Megatron's chatml gives the same ids when the conversation has its own system turn.
    ids, _ = load_encoder(str(chatml_folder), "chatml").encode(CHAT)
    assert ids.tolist() == list(
        reference.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    )


def test_mask_is_the_assistant_replies_and_their_end_of_turn(chatml_folder):
    encoder = load_encoder(str(chatml_folder), None)
    ids, mask = encoder.encode(CHAT)
    decode = encoder.tokenizer.decode
    kept = [decode([int(i)], skip_special_tokens=False) for i in ids[mask == 1]]
    assert "".join(kept) == "Paris.<|im_end|> Rome, since 1871.<|im_end|>"
    im_end = encoder.tokenizer.token_to_id("<|im_end|>")
    # 5 turns end in <|im_end|>; only the two assistant ones count
    assert int((ids == im_end).sum()) == 5
    assert int(((ids == im_end) & (mask == 1)).sum()) == 2
    # no system or user token counts: the masked-out text holds every one of them
    dropped = decode([int(i) for i in ids[mask == 0]], skip_special_tokens=False)
    for message in CHAT[:2] + CHAT[3:4]:
        assert message["content"] in dropped
    assert "assistant\n" in dropped  # the role header is the prompt, not the reply


def test_sharegpt_records_and_bad_records():
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert messages_of(sharegpt) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    with pytest.raises(ChatFormatError, match="role 'bot'"):
        messages_of({"messages": [{"role": "bot", "content": "x"}]})
    with pytest.raises(ChatFormatError, match='neither "messages" nor "conversations"'):
        messages_of({"text": "x"})


def test_megatron_only_formats_are_refused_by_name(chatml_folder):
    with pytest.raises(ChatFormatError, match="nemotron-h-aligned: not supported"):
        load_encoder(str(chatml_folder), "nemotron-h-aligned")


def test_command_writes_tokens_and_mask_datasets(chatml_folder, tmp_path, capsys):
    rows = [
        {"messages": CHAT},
        {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
        {"messages": [{"role": "user", "content": "no reply"}]},
    ]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = tmp_path / "chats"
    with pytest.raises(SystemExit) as done:
        main(["sft", "--input", str(source), "--output-prefix", str(prefix),
              "--tokenizer-model", str(chatml_folder)])  # fmt: skip
    assert done.value.code == 0
    tokens = IndexedDataset(f"{prefix}_text_document")
    masks = IndexedDataset(f"{prefix}_text_document_loss_mask")
    assert len(tokens) == len(masks) == 2  # the conversation without a reply is skipped
    assert tokens.sequence_lengths.tolist() == masks.sequence_lengths.tolist()
    ids, mask = load_encoder(str(chatml_folder), None).encode(CHAT)
    assert np.array_equal(tokens[0], ids) and np.array_equal(masks[0], mask)
    assert masks[0].dtype == np.uint8
    assert "2 conversations" in capsys.readouterr().out


def test_command_errors_name_the_line(chatml_folder, tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": 3}\n')
    with pytest.raises(SystemExit) as done:
        main(["sft", "--input", str(source), "--output-prefix", str(tmp_path / "o"),
              "--tokenizer-model", str(chatml_folder)])  # fmt: skip
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"{source}:2:" in err and "Traceback" not in err
    assert not (tmp_path / "o_text_document.bin").exists()
