"""Conversations to token ids and a loss mask, for supervised finetuning (`mg-prep sft`).

A conversation is rendered to text by a prompt format: the tokenizer folder's own
`chat_template` (Jinja, rendered as transformers renders it) or Megatron's `chatml`.
The whole text is tokenized once, as transformers' `apply_chat_template` does (no
special tokens added), so the ids are exactly those; each token then gets mask 1
when it starts inside an assistant reply (its content and the end-of-turn token the
template writes after it), 0 elsewhere (system, user, the role headers).

Where a reply starts and ends is found by rendering prefixes of the conversation:
the text up to message i with the generation prompt ends where reply i starts, the
text through message i ends after it (trailing whitespace left out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}

CHAT_TEMPLATE = "chat_template"
"""The `--sft-tokenizer-prompt-format` meaning "the tokenizer folder's own template"."""

SUPPORTED_FORMATS = ("chatml", CHAT_TEMPLATE)
# Megatron-LM's other prompt formats (megatron/training/tokenizer/sft_tokenizer.py).
MEGATRON_ONLY_FORMATS = (
    "nemotron-h-aligned",
    "nemotron-nano-v2",
    "identity",
    "default",
    "gemma",
    "gemma3",
    "llama3",
    "mistral",
    "qwen2p0",
    "deepseek-v3.2",
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Megatron's `chatml`: `<|im_start|>role\\ncontent<|im_end|>\\n` per turn, no default system."""


class ChatFormatError(ValueError):
    """A conversation or template that cannot be turned into training data; says which."""


def messages_of(record: Any) -> list[dict[str, str]]:
    """The `messages` of an OpenAI/HF chat record or the `conversations` of a ShareGPT one,
    as [{"role", "content"}], checked."""
    if not isinstance(record, dict):
        raise ChatFormatError("a line is not a JSON object")
    if "messages" in record:
        turns, role_key, text_key, roles = record["messages"], "role", "content", None
    elif "conversations" in record:
        turns, role_key, text_key, roles = record["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise ChatFormatError('the record has neither "messages" nor "conversations"')
    if not isinstance(turns, list) or not turns:
        raise ChatFormatError("the conversation is not a non-empty list of turns")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise ChatFormatError(f'turn {k} lacks "{role_key}" or "{text_key}"')
        role, text = turn[role_key], turn[text_key]
        role = roles.get(role) if roles is not None else role
        if role not in ROLES:
            raise ChatFormatError(
                f"turn {k}: role {turn[role_key]!r} is not one of "
                + ", ".join(sorted(roles) if roles else ROLES)
            )
        if not isinstance(text, str):
            raise ChatFormatError(f'turn {k}: "{text_key}" is not a string')
        out.append({"role": role, "content": text})
    return out


class ChatRenderer:
    """A Jinja chat template compiled as transformers compiles it, with its special tokens."""

    def __init__(self, source: str, special: dict[str, str] | None = None) -> None:
        from jinja2 import TemplateError  # lazy: only `mg-prep sft` needs jinja2
        from jinja2.ext import loopcontrols  # lazy: as above
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy: as above

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._error = TemplateError
        self.special = special or {}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except self._error as exc:
            raise ChatFormatError(f"the chat template refused the conversation: {exc}") from None

    def assistant_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the [start, end) characters of each assistant reply."""
        text = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1], add_generation_prompt=False).rstrip()
            if not (text.startswith(through) and through.startswith(prompt)):
                raise ChatFormatError(
                    "the chat template does not render a conversation's beginning the same "
                    "way as the whole (so the assistant turns cannot be found); use "
                    "--sft-tokenizer-prompt-format chatml"
                )
            spans.append((len(prompt), len(through)))
        return text, spans


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


@dataclass
class ChatEncoder:
    """Turns conversations into (ids, loss mask) with one tokenizer and one prompt format."""

    renderer: ChatRenderer
    tokenizer: Any  # a `tokenizers.Tokenizer`
    prompt_format: str

    def encode(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        text, spans = self.renderer.assistant_spans(messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for start, end in spans:
            mask[(starts >= start) & (starts < end)] = 1
        return ids, mask


def load_encoder(tokenizer_folder: str, prompt_format: str | None) -> ChatEncoder:
    """The encoder of a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json)
    and a prompt format: None or `chat_template` for the folder's own template."""
    from tokenizers import Tokenizer  # lazy: only `mg-prep sft` needs it

    folder = Path(tokenizer_folder)
    fmt = prompt_format or CHAT_TEMPLATE
    if fmt in MEGATRON_ONLY_FORMATS:
        raise ChatFormatError(
            f"--sft-tokenizer-prompt-format {fmt}: not supported here; use chatml, or "
            f"{CHAT_TEMPLATE} (the default) for the tokenizer's own chat template"
        )
    if fmt not in SUPPORTED_FORMATS:
        raise ChatFormatError(
            f"--sft-tokenizer-prompt-format {fmt}: unknown; choose one of "
            + ", ".join(SUPPORTED_FORMATS)
        )
    if not (folder / "tokenizer.json").is_file():
        raise ChatFormatError(
            f"--tokenizer-model {folder}: no tokenizer.json there (a Hugging Face tokenizer "
            "folder is needed)"
        )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    settings: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    special = {key: _token_text(value) for key, value in settings.items() if key.endswith("_token")}
    if fmt == "chatml":
        for token in ("<|im_start|>", "<|im_end|>"):
            if tokenizer.token_to_id(token) is None:
                raise ChatFormatError(
                    f"--sft-tokenizer-prompt-format chatml: the tokenizer in {folder} has no "
                    f"{token} token; use a tokenizer with ChatML tokens or its own template"
                )
        return ChatEncoder(ChatRenderer(CHATML, special), tokenizer, fmt)
    source = settings.get("chat_template")
    if isinstance(source, list):  # named templates: transformers' default is "default"
        source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}.get(
            "default"
        )
    jinja_file = folder / "chat_template.jinja"
    if not source and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if not source:
        raise ChatFormatError(
            f"--tokenizer-model {folder}: tokenizer_config.json has no chat_template (nor is "
            "there a chat_template.jinja); give --sft-tokenizer-prompt-format chatml"
        )
    return ChatEncoder(ChatRenderer(source, special), tokenizer, fmt)
