"""mg-eval: WikiText perplexity, LAMBADA and BERT downstream tasks."""

__version__ = "0.1.0"
