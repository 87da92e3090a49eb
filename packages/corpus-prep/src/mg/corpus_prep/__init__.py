"""mg-prep: raw JSON corpora to Megatron indexed datasets."""

__version__ = "0.1.0"
