"""Chat templates: the Jinja template a Hugging Face tokenizer folder ships, rendered as
transformers renders it (`apply_chat_template(..., add_generation_prompt=True)`).

Only `HuggingFaceTokenizer` checkpoints can carry one (in `tokenizer_config.json`
or `chat_template.jinja` beside `tokenizer.json`); without one the server has
no `/v1/chat/completions`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mg.core.tokenizers import BaseTokenizer, TokenizerConfig


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
        self._template = env.from_string(source)
        self._error = TemplateError
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text for `messages`, ending where the assistant's reply starts."""
        try:
            return self._template.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=True,
            )
        except self._error as exc:
            raise ValueError(str(exc)) from None

    def tokenize(self, tokenizer: BaseTokenizer, text: str) -> list[int]:
        """Token ids of a rendered prompt: the template writes BOS itself, so a BOS that
        the tokenizer adds in front again is dropped (transformers tokenizes chat
        prompts without special tokens for the same reason)."""
        ids = tokenizer.tokenize(text)
        bos = tokenizer.bos
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids


def load_chat_template(config: TokenizerConfig) -> ChatTemplate | None:
    """The template of a HuggingFaceTokenizer folder, or None when it has none."""
    if config.tokenizer_type != "HuggingFaceTokenizer" or not config.tokenizer_model:
        return None
    folder = Path(config.tokenizer_model)
    if folder.is_file():
        folder = folder.parent
    settings: dict[str, Any] = {}
    settings_file = folder / "tokenizer_config.json"
    if settings_file.is_file():
        settings = json.loads(settings_file.read_text(encoding="utf-8"))
    source = settings.get("chat_template")
    if isinstance(source, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_file = folder / "chat_template.jinja"
    if not source and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if not source:
        return None
    return ChatTemplate(
        source, _token_text(settings.get("bos_token")), _token_text(settings.get("eos_token"))
    )
