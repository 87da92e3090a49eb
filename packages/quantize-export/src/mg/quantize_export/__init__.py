"""mg-quantize: quantization and deployable export."""

__version__ = "0.2.0"
