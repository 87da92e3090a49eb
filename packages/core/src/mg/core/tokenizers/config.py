"""The tokenizer settings, named after Megatron's flags, and vocab padding.

A ``TokenizerConfig`` is what a checkpoint records so that ``mg-eval --load``
and ``mg-serve --load`` rebuild the same tokenizer without flags; it is also
what ``mg-prep`` builds from its command line.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

# Megatron's --tokenizer-type choices that work offline (its classic,
# ``--legacy-tokenizer`` implementations), in the order of its argparse help.
TOKENIZER_TYPES: tuple[str, ...] = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "NullTokenizer",
)


@dataclass
class TokenizerConfig:
    """Which tokenizer, from which files: Megatron's tokenizer flags, one field each.

    ``vocab_file`` is ``--vocab-file``, ``merge_file`` ``--merge-file``,
    ``tokenizer_model`` ``--tokenizer-model`` (a SentencePiece ``.model``, a
    ``.tiktoken``/Megatron tiktoken ``.json`` file, or a Hugging Face folder),
    ``vocab_size`` ``--vocab-size`` (NullTokenizer, TikTokenizer),
    ``vocab_extra_ids`` ``--vocab-extra-ids`` (T5 sentinels),
    ``tiktoken_pattern`` ``--tiktoken-pattern`` (``v1``/``v2``; None means v2),
    ``tiktoken_num_special_tokens`` ``--tiktoken-num-special-tokens`` and
    ``tokenizer_special_tokens`` ``--tokenizer-special-tokens``.

    Paths are stored as given (not resolved), so a checkpoint moved together
    with its vocabulary files keeps working when the paths were relative.
    """

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    tokenizer_special_tokens: list[str] | None = None

    def __post_init__(self) -> None:
        # Accept pathlib.Path (and any os.PathLike) but store plain strings, so
        # that to_dict() is JSON- and torch.save-friendly.
        for name in ("vocab_file", "merge_file", "tokenizer_model"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, os.fspath(value))
        if self.tokenizer_special_tokens is not None:
            self.tokenizer_special_tokens = list(self.tokenizer_special_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str/int/list/None) for a checkpoint or a JSON file."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenizerConfig:
        """Inverse of ``to_dict``.

        Keys that are not fields are ignored, so ``vars(megatron_args)`` or a
        dict written by a newer version with more fields loads too.
        """
        if "tokenizer_type" not in data or not data["tokenizer_type"]:
            raise ValueError(
                "tokenizer config has no 'tokenizer_type'; "
                f"expected one of: {', '.join(TOKENIZER_TYPES)}"
            )
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def vocab_size_with_padding(
    orig: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Megatron's ``_vocab_size_with_padding``: the embedding-table size.

    Rounds the tokenizer's vocab size up to a multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size`` so that the
    table splits evenly across tensor-parallel ranks and stays GPU friendly.
    """
    if orig < 1:
        raise ValueError(f"vocab size must be positive, got {orig}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    if multiple < 1:
        raise ValueError(
            "make_vocab_size_divisible_by and tensor_model_parallel_size must be positive, "
            f"got {make_vocab_size_divisible_by} and {tensor_model_parallel_size}"
        )
    return int(math.ceil(orig / multiple) * multiple)
