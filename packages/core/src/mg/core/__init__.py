"""Shared library: tokenizers, models, parallelism, checkpoints, fixtures."""

__version__ = "0.1.0"
