"""export-hf streams: its peak RSS above where it started stays well below the model size
from a `torch` and from a `torch_dist` checkpoint (bench/bench_convert_memory.py, each
run in a child process that resets the kernel's peak-RSS mark after its imports).
Before streaming it was about the model size."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units: Linux"),
]
BENCH = Path(__file__).resolve().parents[3] / "bench" / "bench_convert_memory.py"
EXPORTS = ("mg-convert export-hf", "mg-convert export-hf (torch_dist)")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_convert_memory", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not BENCH.is_file(), reason="needs the repository's bench/ folder")
def test_export_peak_rss_below_model_size(tmp_path) -> None:
    """~440 MB fp32, 8 Llama layers of ~47 MB: export holds about one layer."""
    results = _bench().run(8, 1024, 2816, 8000, tmp_path, contenders=EXPORTS)
    model = results["model"]["bytes"]
    for name in EXPORTS:
        above = results[name]["above_start"]
        print(f"model {model / 1e6:.0f} MB: {name} +{above / 1e6:.0f} MB")
        assert above < 0.5 * model, name
