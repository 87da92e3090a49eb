"""Token ids to text as they arrive, with stop strings cut off (OpenAI semantics).

Decoding token by token is wrong for byte-level vocabularies: one character
may span several tokens, and a stop string may span several too. So the
stream decodes the whole completion each time and releases only text that
can no longer change: nothing that ends in an unfinished character (U+FFFD)
and nothing that could still be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class TextStream:
    """Feed token ids with `push`; each call returns the newly final text."""

    def __init__(
        self, detokenize: Callable[[Sequence[int]], str], stop_strings: Sequence[str] = ()
    ) -> None:
        self._detokenize = detokenize
        self._stops = tuple(s for s in stop_strings if s)
        self._tokens: list[int] = []
        self._sent = 0
        self.stopped = False
        """True once a stop string was found; the text ends before it."""

    def _cut_at_stop(self, text: str) -> str:
        cuts = [text.find(s) for s in self._stops if s in text]
        if cuts:
            self.stopped = True
            return text[: min(cuts)]
        return text

    def _held_back(self, text: str) -> int:
        """How many trailing characters might still become part of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def push(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._tokens.extend(tokens)
        text = self._cut_at_stop(self._detokenize(self._tokens))
        if not self.stopped:
            final = len(text) - self._held_back(text)
            while final > self._sent and text[final - 1] == _REPLACEMENT:
                final -= 1
            text = text[:final]
        delta = text[self._sent :]
        self._sent = max(self._sent, len(text))
        return delta

    def finish(self) -> str:
        """The rest of the text once no more tokens will come."""
        if self.stopped:
            return ""
        text = self._cut_at_stop(self._detokenize(self._tokens))
        delta = text[self._sent :]
        self._sent = len(text)
        return delta
