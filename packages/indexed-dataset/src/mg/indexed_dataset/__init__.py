"""Megatron's MMIDIDX .bin/.idx format and the GPT/BERT/T5 sample datasets built on it."""

__version__ = "0.1.0"
