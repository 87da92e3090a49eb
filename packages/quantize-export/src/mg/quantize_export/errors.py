"""The one error type users see: a one-line message, exit status 2."""


class QuantizeInputError(Exception):
    """Bad input to mg-quantize (flag, checkpoint, data); the message says what to do."""
