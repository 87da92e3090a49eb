"""Chat prompt formats: conversations to the text a chat model was trained on.

One place for what `mg-prep sft` writes, `mg-train --sft` learns, `mg-serve` answers
and `mg-eval qa` asks, so that all four render a turn the same way. A format is the
tokenizer folder's own Jinja `chat_template` (rendered as transformers renders it:
sandboxed, `trim_blocks`/`lstrip_blocks`, its `tojson`, `raise_exception` and
`strftime_now`, every `*_token` of tokenizer_config.json as a variable) or Megatron's
`chatml`. The text is tokenized once without special tokens added, as transformers'
`apply_chat_template` does: the template writes any BOS itself.

No torch here; jinja2 and tokenizers are imported only when a format is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

FLAG = "--sft-tokenizer-prompt-format"

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

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")

_REPLY_MARK = "\x00reply\x00"  # a reply no template writes on its own: where it ends is found


class ChatFormatError(ValueError):
    """A conversation, template or tokenizer folder a chat format cannot use; says which."""


def token_text(value: Any) -> str:
    """A special token's text as tokenizer_config.json writes it: a string or an AddedToken
    dict ({"content": ...})."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatRenderer:
    """A Jinja chat template compiled as transformers compiles it, with its special tokens."""

    def __init__(self, source: str, special: dict[str, str] | None = None) -> None:
        from jinja2 import TemplateError  # lazy: only the chat formats need jinja2
        from jinja2.ext import loopcontrols  # lazy: as above
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy: as above

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(
            value: Any,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False,
        ) -> str:
            return json.dumps(
                value,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._error = TemplateError
        self.special = special or {}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except self._error as exc:
            raise ChatFormatError(f"the chat template refused the conversation: {exc}") from None

    def assistant_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the [start, end) characters of each assistant reply: the
        text up to message i with the generation prompt ends where reply i starts, the
        text through message i ends after it (trailing whitespace left out)."""
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
                    f"{FLAG} chatml"
                )
            spans.append((len(prompt), len(through)))
        return text, spans

    def end_of_turn(self) -> str:
        """What the template writes right after an assistant's reply (chatml: `<|im_end|>`;
        empty when it writes nothing there): where a generated reply ends."""
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _REPLY_MARK},
        ]
        try:
            text = self.render(messages, add_generation_prompt=False)
        except ChatFormatError:
            return ""
        if _REPLY_MARK not in text:
            return ""
        after = text.split(_REPLY_MARK, 1)[1].strip()
        return after.split(None, 1)[0] if after else ""


def read_tokenizer_settings(folder: str | Path) -> dict[str, Any]:
    """tokenizer_config.json of a Hugging Face tokenizer folder ({} when there is none)."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def special_tokens(settings: dict[str, Any]) -> dict[str, str]:
    """Every `*_token` of tokenizer_config.json as text: the variables a template may use."""
    return {key: token_text(value) for key, value in settings.items() if key.endswith("_token")}


def template_source(folder: str | Path, settings: dict[str, Any]) -> str | None:
    """The folder's own chat template: tokenizer_config.json's `chat_template` (of a list of
    named ones, "default", as transformers takes), else chat_template.jinja; None if none."""
    source = settings.get("chat_template")
    if isinstance(source, list):
        source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}.get(
            "default"
        )
    jinja_file = Path(folder) / "chat_template.jinja"
    if not source and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    return source or None


def check_format(prompt_format: str) -> None:
    """Refuse, by name, a `--sft-tokenizer-prompt-format` that is not supported here."""
    if prompt_format in MEGATRON_ONLY_FORMATS:
        raise ChatFormatError(
            f"{FLAG} {prompt_format}: not supported here; use chatml, or "
            f"{CHAT_TEMPLATE} for the tokenizer's own chat template"
        )
    if prompt_format not in SUPPORTED_FORMATS:
        raise ChatFormatError(
            f"{FLAG} {prompt_format}: unknown; choose one of " + ", ".join(SUPPORTED_FORMATS)
        )


@dataclass
class ChatFormat:
    """A prompt format bound to one Hugging Face tokenizer folder."""

    renderer: ChatRenderer
    tokenizer: Any  # a `tokenizers.Tokenizer`
    prompt_format: str

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of `messages` and the generation prompt: where the assistant's reply
        starts, exactly as a training conversation with that reply begins."""
        text = self.renderer.render(messages, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def end_of_turn_id(self) -> int | None:
        """The id of the template's end-of-turn when it is one token, else None."""
        marker = self.renderer.end_of_turn()
        if not marker:
            return None
        ids = self.tokenizer.encode(marker, add_special_tokens=False).ids
        return int(ids[0]) if len(ids) == 1 else None


def load_chat_format(tokenizer_folder: str | Path, prompt_format: str | None) -> ChatFormat:
    """The format of a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json):
    `chatml`, or None / `chat_template` for the folder's own template."""
    from tokenizers import Tokenizer  # lazy: only the chat formats need it

    folder = Path(tokenizer_folder)
    fmt = prompt_format or CHAT_TEMPLATE
    check_format(fmt)
    if not (folder / "tokenizer.json").is_file():
        raise ChatFormatError(
            f"--tokenizer-model {folder}: no tokenizer.json there (a Hugging Face tokenizer "
            "folder is needed)"
        )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    settings = read_tokenizer_settings(folder)
    special = special_tokens(settings)
    if fmt == "chatml":
        for token in CHATML_TOKENS:
            if tokenizer.token_to_id(token) is None:
                raise ChatFormatError(
                    f"{FLAG} chatml: the tokenizer in {folder} has no {token} token; use a "
                    "tokenizer with ChatML tokens or its own template"
                )
        return ChatFormat(ChatRenderer(CHATML, special), tokenizer, fmt)
    source = template_source(folder, settings)
    if not source:
        raise ChatFormatError(
            f"--tokenizer-model {folder}: tokenizer_config.json has no chat_template (nor is "
            f"there a chat_template.jinja); give {FLAG} chatml"
        )
    return ChatFormat(ChatRenderer(source, special), tokenizer, fmt)
