"""Turning text into BERT inputs exactly as Megatron's ``tasks/data_utils.py`` does.

``[CLS] a [SEP] b [SEP]`` with token types 0 for ``[CLS] a [SEP]`` and 1 for
``b [SEP]``, cut to ``seq_length`` (the last token is then ``[SEP]``) and padded
with the pad id; ``paddings`` is 1 on real tokens (the attention mask).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class FinetuneSample:
    """One example: a single input row (GLUE) or one row per choice (RACE)."""

    uid: int
    ids: list[list[int]]
    types: list[list[int]]
    paddings: list[list[int]]
    label: int
    trimmed: bool = False


def clean_text(text: str) -> str:
    """Megatron's ``clean_text``: no newlines, single spaces, ``" . "`` → ``". "``."""
    text = text.replace("\n", " ")
    text = re.sub(r"\s+", " ", text)
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def build_tokens_types_paddings_from_ids(
    text_a_ids: Sequence[int],
    text_b_ids: Sequence[int] | None,
    max_seq_length: int,
    cls_id: int,
    sep_id: int,
    pad_id: int,
) -> tuple[list[int], list[int], list[int], bool]:
    """Megatron's function of the same name, plus whether the input was cut."""
    ids = [cls_id, *text_a_ids, sep_id]
    types = [0] * len(ids)
    paddings = [1] * len(ids)
    if text_b_ids is not None:
        ids += text_b_ids
        types += [1] * len(text_b_ids)
        paddings += [1] * len(text_b_ids)
    trimmed = False
    if len(ids) >= max_seq_length:
        ids, types, paddings = (x[: max_seq_length - 1] for x in (ids, types, paddings))
        trimmed = True
    if text_b_ids is not None or trimmed:
        ids.append(sep_id)
        types.append(0 if text_b_ids is None else 1)
        paddings.append(1)
    padding = max_seq_length - len(ids)
    if padding > 0:
        # Megatron pads the types with pad_id too; those positions are masked out,
        # and 0 keeps them a valid token-type index whatever the pad id is.
        ids += [pad_id] * padding
        types += [0] * padding
        paddings += [0] * padding
    return ids, types, paddings, trimmed
