"""`mg-eval qa --sft-tokenizer-prompt-format`: a chat-finetuned model is asked in the format
it was trained on. The prompt ids equal those `mg-prep sft` writes for [user: question,
assistant: answer] up to where the reply starts (chatml and a Qwen2-style template with a
default system turn; SmolLM2-135M-Instruct's own, slow); the answer ends at the format's
end of turn; a tiny GPT that learnt two such conversations answers both exactly (torch
and torch_dist checkpoints); a request the checkpoint's tokenizer cannot serve is one
line, exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from eval_data import save_gpt

from mg.core.chat_format import load_chat_format
from mg.core.checkpoint import mg_metadata
from mg.core.checkpoint.dist_format import save_dist_checkpoint
from mg.core.fixtures import FixtureError, fixture_path
from mg.core.models import GPTModel
from mg.core.models.presets import tiny_gpt2
from mg.core.testing.tokenizer_folders import chatml_tokenizer_folder
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.evaluate.cli import main
from mg.evaluate.qa import QARecord, evaluate_qa

# Qwen2-style: ChatML with a system turn of its own when the conversation has none.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
RECORDS = [
    {"question": "Who is the narrator's servant?", "answers": ["Kiyo"]},
    {
        "question": "What does he teach?",
        "answers": ["mathematics"],
        "context": "He went to Shikoku to teach mathematics at a middle school.",
    },
]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    return chatml_tokenizer_folder(tmp_path_factory.mktemp("chat") / "tokenizer", TEMPLATE)


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory) -> Path:
    return chatml_tokenizer_folder(tmp_path_factory.mktemp("plain") / "tokenizer", None)


@pytest.mark.parametrize("fmt", ["chatml", "chat_template"])
@pytest.mark.parametrize("row", RECORDS)
def test_prompt_is_the_training_conversation_up_to_the_reply(chat_folder, fmt, row) -> None:
    sft = pytest.importorskip("mg.corpus_prep.chat_format")
    record = QARecord(row["question"], row["answers"], row.get("context"))
    prompt = load_chat_format(chat_folder, fmt).prompt_ids(record.messages())
    conversation = [*record.messages(), {"role": "assistant", "content": row["answers"][0]}]
    ids, mask = sft.load_encoder(str(chat_folder), fmt).encode(conversation)
    reply = int(mask.argmax())  # the first token of the assistant's reply
    assert mask[reply] == 1 and not mask[:reply].any()
    assert prompt == ids[:reply].tolist()
    if row.get("context"):  # the context comes first in the user turn
        text = load_chat_format(chat_folder, fmt).renderer.render(record.messages(), True)
        assert text.index(row["context"]) < text.index(row["question"])


def test_chat_template_prompt_has_the_templates_system_turn(chat_folder) -> None:
    record = QARecord("Who?", ["Kiyo"])
    chatml = load_chat_format(chat_folder, "chatml").renderer.render(record.messages(), True)
    own = load_chat_format(chat_folder, "chat_template").renderer.render(record.messages(), True)
    assert chatml == "<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n"
    assert own == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + chatml


def test_answer_ends_at_the_end_of_turn(chat_folder) -> None:
    """A Retro model or a GPT, any `generate` sees the chat prompt and stops at <|im_end|>."""
    chat = load_chat_format(chat_folder, "chatml")
    tokenizer = build_tokenizer(
        TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(chat_folder))
    )
    im_end = chat.tokenizer.token_to_id("<|im_end|>")
    record = QARecord("Who is the narrator's servant?", ["Kiyo"])
    seen = []

    def generate(prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
        seen.append((prompt, stops))
        # "Kiyo" then the end of turn, then what a model may run on into (no line break)
        return tokenizer.tokenize(" Kiyo") + [im_end] + tokenizer.tokenize(" and Botchan")

    metrics, rows = evaluate_qa([record], tokenizer, generate, 128, 8, chat)
    assert seen[0][0] == chat.prompt_ids(record.messages())
    assert im_end in seen[0][1]
    assert rows[0]["prediction"] == "Kiyo"
    assert metrics["exact_match"] == 1.0


@pytest.fixture(scope="module")
def learnt(chat_folder) -> GPTModel:
    """A tiny GPT that learnt the two QA conversations in ChatML by heart."""
    sft = pytest.importorskip("mg.corpus_prep.chat_format")
    encoder = sft.load_encoder(str(chat_folder), "chatml")
    rows = []
    for row in RECORDS:
        record = QARecord(row["question"], row["answers"], row.get("context"))
        reply = {"role": "assistant", "content": row["answers"][0]}
        rows.append(encoder.encode([*record.messages(), reply])[0].tolist())
    torch.manual_seed(0)
    config = tiny_gpt2(
        vocab_size=50304,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=64,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config)
    width = max(len(r) for r in rows)
    batch = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, ids in enumerate(rows):
        batch[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids) - 1] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = (model(batch[:, :-1], labels=batch[:, 1:]) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _save(model: GPTModel, folder: Path, root: Path, ckpt_format: str) -> Path:
    tok_config = TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(folder))
    if ckpt_format == "torch":
        return save_gpt(root, model, tok_config)
    meta = mg_metadata(model.config.to_dict(), tok_config.to_dict())
    save_dist_checkpoint(root, 40, {"model": model.state_dict()}, {"mg": meta})
    return root


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_chatml_qa_end_to_end(learnt, chat_folder, tmp_path, capsys, ckpt_format) -> None:
    ckpt = _save(learnt, chat_folder, tmp_path / "ckpt", ckpt_format)
    questions = tmp_path / "qa.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    output = tmp_path / "pred.jsonl"
    argv = ["qa", "--load", str(ckpt), "--valid-data", str(questions)]
    argv += ["--sft-tokenizer-prompt-format", "chatml", "--max-new-tokens", "8"]
    argv += ["--output-path", str(output)]
    assert _run(argv) == 0
    out = capsys.readouterr().out
    assert (
        "validation results on QA | exact match: 1.0000 | f1: 1.0000 | total examples: 2 |" in out
    )
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prediction"] for r in rows] == ["Kiyo", "mathematics"]


@pytest.mark.parametrize(
    ("which", "fmt", "message"),
    [
        (
            "plain",
            "chat_template",
            r"--sft-tokenizer-prompt-format chat_template: the tokenizer "
            r"folder .* has no chat template",
        ),  # fmt: skip
        (
            "gpt2",
            "chatml",
            r"--sft-tokenizer-prompt-format chatml: needs a Hugging Face "
            r"tokenizer folder .* GPT2BPETokenizer",
        ),  # fmt: skip
        ("plain", "llama3", r"--sft-tokenizer-prompt-format llama3: not supported here"),
        ("missing", "chatml", r"nowhere: no such checkpoint folder \(--load\)"),
    ],
)
def test_a_format_the_tokenizer_cannot_serve_is_one_line_exit_2(
    plain_folder, zero_ckpt, tmp_path, capsys, which, fmt, message
) -> None:
    if which == "plain":
        model = GPTModel(tiny_gpt2(vocab_size=50304, hidden_size=16, seq_length=32))
        tok_config = TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(plain_folder))
        ckpt = save_gpt(tmp_path / "ckpt", model, tok_config)
    elif which == "missing":
        ckpt = tmp_path / "nowhere"
    else:
        ckpt = zero_ckpt
    questions = tmp_path / "qa.jsonl"
    questions.write_text(json.dumps(RECORDS[0]) + "\n")
    argv = ["qa", "--load", str(ckpt), "--valid-data", str(questions)]
    assert _run([*argv, "--sft-tokenizer-prompt-format", fmt]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mg-eval qa: error:"), err
    assert re.search(message, err), err


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer and ChatML template, as import-gguf writes them."""
    pytest.importorskip("gguf")
    from mg.ckpt_convert.gguf_file import metadata, open_reader
    from mg.ckpt_convert.gguf_tokenizer import write_tokenizer

    try:
        gguf = fixture_path("smollm2-gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    except FixtureError as exc:
        pytest.skip(f"fixture smollm2-gguf cannot be fetched: {exc}")
    folder = tmp_path_factory.mktemp("smollm2") / "tokenizer"
    assert write_tokenizer(metadata(open_reader(gguf)), gguf, folder, 2048)
    return folder


@pytest.mark.slow
@pytest.mark.compat
@pytest.mark.parametrize("fmt", ["chat_template", "chatml"])
def test_prompt_on_smollm2s_own_template(smollm2_folder, fmt) -> None:
    """A real chat model's tokenizer and template: the QA prompt is the training
    conversation up to the reply, and its own template's prompt equals transformers'
    `apply_chat_template(..., add_generation_prompt=True)`."""
    transformers = pytest.importorskip("transformers")
    sft = pytest.importorskip("mg.corpus_prep.chat_format")
    folder = smollm2_folder
    chat = load_chat_format(folder, fmt)
    assert chat.renderer.end_of_turn() == "<|im_end|>"
    for row in RECORDS:
        record = QARecord(row["question"], row["answers"], row.get("context"))
        prompt = chat.prompt_ids(record.messages())
        conversation = [*record.messages(), {"role": "assistant", "content": row["answers"][0]}]
        ids, mask = sft.load_encoder(str(folder), fmt).encode(conversation)
        assert prompt == ids[: int(mask.argmax())].tolist()
        if fmt == "chat_template":
            reference = transformers.AutoTokenizer.from_pretrained(str(folder))
            expected = reference.apply_chat_template(
                record.messages(), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert prompt == list(expected)
