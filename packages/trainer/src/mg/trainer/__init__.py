"""mg-train: GPT, BERT and T5 pretraining with Megatron's flags."""

__version__ = "0.1.0"
