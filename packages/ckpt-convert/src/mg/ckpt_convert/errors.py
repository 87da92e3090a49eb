"""The one exception type the CLI turns into `mg-convert <cmd>: error: ...`."""


class ConvertError(Exception):
    """A problem with the user's input (path, file, config option), said for the user."""
