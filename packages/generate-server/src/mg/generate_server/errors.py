"""The server's two error types: a request it refuses, and a start it cannot make."""

from __future__ import annotations


class ApiError(Exception):
    """`message` goes back to the client with HTTP `status`; `param` names the field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class ServeSetupError(Exception):
    """The server cannot start; the message says what to change."""
