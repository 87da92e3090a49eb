"""mg-convert: Hugging Face import/export, resharding, format conversion."""

__version__ = "0.1.0"
