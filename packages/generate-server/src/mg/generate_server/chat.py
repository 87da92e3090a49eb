"""Chat templates: the Jinja template a Hugging Face tokenizer folder ships, rendered as
transformers renders it (`apply_chat_template(..., add_generation_prompt=True)`) by
`mg.core.chat_format`, the renderer `mg-prep sft` writes training conversations with.

Only `HuggingFaceTokenizer` checkpoints can carry one (in `tokenizer_config.json`
or `chat_template.jinja` beside `tokenizer.json`); without one the server has
no `/v1/chat/completions`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mg.core.chat_format import (
    ChatRenderer,
    read_tokenizer_settings,
    special_tokens,
    template_source,
    token_text,
)
from mg.core.tokenizers import BaseTokenizer, TokenizerConfig

__all__ = ["ChatTemplate", "load_chat_template"]


class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to."""

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        special: dict[str, str] | None = None,
    ) -> None:
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._renderer = ChatRenderer(
            source, {**(special or {}), "bos_token": bos_token, "eos_token": eos_token}
        )

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text for `messages`, ending where the assistant's reply starts
        (a ValueError saying why when the template refuses them)."""
        return self._renderer.render(messages, add_generation_prompt=True)

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
    settings = read_tokenizer_settings(folder)
    source = template_source(folder, settings)
    if not source:
        return None
    return ChatTemplate(
        source,
        token_text(settings.get("bos_token")),
        token_text(settings.get("eos_token")),
        special_tokens(settings),
    )
