"""The one error type every flag check raises: its message names the flag and the reason."""

from __future__ import annotations

from typing import NoReturn


class ArgumentError(ValueError):
    """A flag or a combination of flags that cannot work; the message says which and why."""


def fail(message: str) -> NoReturn:
    raise ArgumentError(message)
