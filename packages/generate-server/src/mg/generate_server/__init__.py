"""mg-serve: the text-generation REST server and its client."""

__version__ = "0.1.0"
