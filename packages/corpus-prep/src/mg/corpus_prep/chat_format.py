"""Conversations to token ids and a loss mask, for supervised finetuning (`mg-prep sft`).

A conversation is rendered to text by a prompt format (`mg.core.chat_format`: the
tokenizer folder's own `chat_template`, rendered as transformers renders it, or
Megatron's `chatml`). The whole text is tokenized once, as transformers'
`apply_chat_template` does (no special tokens added), so the ids are exactly those;
each token then gets mask 1 when it starts inside an assistant reply (its content and
the end-of-turn token the template writes after it), 0 elsewhere (system, user, the
role headers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mg.core.chat_format import ChatFormatError, ChatRenderer, load_chat_format

__all__ = [
    "ROLES",
    "SHAREGPT_ROLES",
    "ChatEncoder",
    "ChatFormatError",
    "load_encoder",
    "messages_of",
]

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


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
    chat = load_chat_format(Path(tokenizer_folder), prompt_format)
    return ChatEncoder(chat.renderer, chat.tokenizer, chat.prompt_format)
