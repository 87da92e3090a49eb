"""NullTokenizer: text that already is ids, for benchmarks and mock data."""

from __future__ import annotations

from collections.abc import Sequence

from .base import BaseTokenizer, as_id_list


class NullTokenizer(BaseTokenizer):
    """Megatron's ``_NullTokenizer``: ``"5 17 3"`` -> ``[5, 17, 3]``.

    ``--vocab-size N`` makes ids 0..N-1 and eod = N, so ``vocab_size`` is
    N + 1 as in Megatron. Megatron splits on single spaces only (and fails on
    anything else); we split on any whitespace, which agrees wherever Megatron
    succeeds, and give ``[]`` for blank text.
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: int | None) -> None:
        super().__init__()
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"{self.name} needs --vocab-size N (N >= 1), got {vocab_size}")
        n = int(vocab_size)
        self.vocab_size = n + 1
        self.eod = self.eos = n
        self.cls = self.sep = self.mask = -1

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError as err:
            raise ValueError(f"{self.name} reads space-separated integers: {err}") from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in as_id_list(ids))

    def id_to_token(self, i: int) -> str:
        return str(i)
