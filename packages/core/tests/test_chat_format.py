"""mg.core.chat_format: the chat rendering `mg-prep sft`, `mg-serve` and `mg-eval qa` share.
Templates render as transformers renders them (its Jinja environment and helpers), a
reply's end of turn is found from the template itself, a folder's template is found where
transformers looks, and importing the module pulls in neither torch nor jinja2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mg.core.chat_format import (
    CHATML,
    ChatFormatError,
    ChatRenderer,
    check_format,
    read_tokenizer_settings,
    special_tokens,
    template_source,
    token_text,
)

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Où est la tour Eiffel ?"},
    {"role": "assistant", "content": "À Paris."},
]
# Llama-3 style: BOS and headers, <|eot_id|> after each turn, a loop cut short by {% break %}.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if loop.index > 8 %}{% break %}{% endif %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim }}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
TOOLS = "{{ messages | tojson }}{% if add_generation_prompt %}{{ eos_token }}{% endif %}"


def test_chatml_is_megatrons_format() -> None:
    text = ChatRenderer(CHATML).render(CHAT[1:], add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nOù est la tour Eiffel ?<|im_end|>\n"
        "<|im_start|>assistant\nÀ Paris.<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("source", [CHATML, LLAMA3, TOOLS])
@pytest.mark.parametrize("generation", [False, True])
def test_renders_as_transformers(source: str, generation: bool) -> None:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    expected = utils.render_jinja_template(
        conversations=[CHAT], chat_template=source, add_generation_prompt=generation, **special
    )[0][0]
    assert ChatRenderer(source, special).render(CHAT, generation) == expected


def test_tojson_keeps_unicode_as_transformers() -> None:
    text = ChatRenderer(TOOLS, {"eos_token": "</s>"}).render(CHAT[1:2], True)
    assert text == json.dumps(CHAT[1:2], ensure_ascii=False) + "</s>"


def test_end_of_turn_is_what_the_template_writes_after_a_reply() -> None:
    assert ChatRenderer(CHATML).end_of_turn() == "<|im_end|>"
    assert ChatRenderer(LLAMA3, {"bos_token": "<s>"}).end_of_turn() == "<|eot_id|>"
    eos_after = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert ChatRenderer(eos_after, {"eos_token": "</s>"}).end_of_turn() == "</s>"
    assert (
        ChatRenderer("{% for m in messages %}{{ m['content'] }}\n{% endfor %}").end_of_turn() == ""
    )


def test_a_refusal_is_a_chat_format_error() -> None:
    refusing = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ChatFormatError, match="refused the conversation: only user turns"):
        ChatRenderer(refusing).render(CHAT, True)


def test_template_and_special_tokens_of_a_folder(tmp_path: Path) -> None:
    assert read_tokenizer_settings(tmp_path) == {} and template_source(tmp_path, {}) is None
    settings = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "pad_token": None,
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    settings = read_tokenizer_settings(tmp_path)
    assert special_tokens(settings) == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": ""}
    assert template_source(tmp_path, settings) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert template_source(tmp_path, {}) == "J"  # transformers' newer place for it
    assert token_text(None) == "" and token_text({"content": "<|im_end|>"}) == "<|im_end|>"


def test_formats_megatron_has_and_this_does_not_are_named() -> None:
    check_format("chatml")
    check_format("chat_template")
    with pytest.raises(
        ChatFormatError, match="--sft-tokenizer-prompt-format llama3: not supported"
    ):
        check_format("llama3")
    with pytest.raises(ChatFormatError, match="chatmll: unknown; choose one of chatml, chat_t"):
        check_format("chatmll")


def test_importing_pulls_in_neither_torch_nor_jinja() -> None:
    code = (
        "import sys, mg.core.chat_format\n"
        "print(sorted(m for m in ('torch', 'jinja2', 'tokenizers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
