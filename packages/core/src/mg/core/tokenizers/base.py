"""The one tokenizer interface that preprocessing, training, evaluation and serving share."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .long_text import PIECE_CHARS

if TYPE_CHECKING:
    from .config import TokenizerConfig


@runtime_checkable
class Tokenizer(Protocol):
    """What every Megatron tokenizer type offers.

    Special ids hold exactly the values Megatron's classic tokenizer of the
    same type reports, so that datasets and checkpoints agree with
    Megatron-LM: ``-1`` where Megatron says -1 (e.g. ``pad`` of a
    SentencePiece model without a pad piece, ``cls`` of a GPT tokenizer), and
    ``None`` where Megatron's tokenizer has no such attribute at all. Treat
    both as "this tokenizer has no such token".
    """

    name: str
    vocab_size: int
    eod: int | None
    pad: int | None
    bos: int | None
    eos: int | None
    cls: int | None
    sep: int | None
    mask: int | None
    additional_special_tokens_ids: list[int]

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text``, as Megatron's ``tokenizer.tokenize(text)``."""
        ...

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """``[tokenize(t) for t in texts]``, through the library's batch path."""
        ...

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        """The ids of ``tokenize(text)`` as consecutive lists: a 50 MB document's
        ids need never all exist at once as Python ints (40 bytes each)."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, as Megatron's ``tokenizer.detokenize(ids)``."""
        ...

    def id_to_token(self, i: int) -> str:
        """One token as text, the way Megatron's generation server shows it in ``segments``."""
        ...


class BaseTokenizer:
    """Defaults shared by the implementations: no special tokens, a plain batch loop."""

    name: str = ""
    vocab_size: int = 0
    eod: int | None = None
    pad: int | None = None
    bos: int | None = None
    eos: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    # Set by build_tokenizer: what a checkpoint records to rebuild this tokenizer.
    config: TokenizerConfig | None = None
    # Longer texts are encoded in pieces (same ids, bounded memory): see long_text.
    piece_chars: int = PIECE_CHARS

    def __init__(self) -> None:
        self.additional_special_tokens_ids: list[int] = []

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        yield self.tokenize(text)

    def has_long_text(self, texts: list[str]) -> bool:
        """Whether a batch must go text by text, for one of them to be encoded in pieces."""
        return any(len(text) > self.piece_chars for text in texts)

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def id_to_token(self, i: int) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


def require_file(path: str | Path | None, flag: str, tokenizer_type: str, what: str) -> Path:
    """The path of a tokenizer file, or a ValueError that names the flag to fix."""
    if path is None or str(path) == "":
        raise ValueError(f"{tokenizer_type} needs {flag} ({what}); none was given")
    p = Path(path).expanduser()
    if not p.is_file():
        problem = "is a folder, not a file" if p.is_dir() else "does not exist"
        raise ValueError(f"{flag} {path}: {problem} ({tokenizer_type} needs {what})")
    return p


def as_id_list(ids: Sequence[int]) -> list[int]:
    """Ids from a list, tuple, numpy array or tensor as a list of Python ints."""
    tolist = getattr(ids, "tolist", None)
    if tolist is not None:
        out = tolist()
        return out if isinstance(out, list) else [out]
    return [int(i) for i in ids]


# Spaces that word-level decoding leaves before punctuation and contractions;
# the same list as transformers' and Megatron's `clean_up_tokenization`.
_TOKENIZATION_SPACES = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_tokenization(text: str) -> str:
    """Remove the spaces word-level decoding puts before punctuation and contractions."""
    for spaced, tight in _TOKENIZATION_SPACES:
        text = text.replace(spaced, tight)
    return text
