"""mg-quantize: quantization and deployable export."""

__version__ = "0.1.0"
