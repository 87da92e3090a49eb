"""mg-convert import-hf converts layer by layer: its peak RSS above the fixed start-up
stays well below the model size (bench/bench_convert_memory.py, measured in child
processes with getrusage), while a converter holding the model needs about its size."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("safetensors")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units: Linux")


def _bench():
    path = Path(__file__).resolve().parent.parent / "bench" / "bench_convert_memory.py"
    spec = importlib.util.spec_from_file_location("bench_convert_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_import_peak_rss_below_model_size(tmp_path) -> None:
    """~160 MB fp32 (the embedding, the largest group, is 20% of it)."""
    results = _bench().run(8, 512, 1408, 16000, tmp_path, contenders=("mg-convert import-hf",))
    model, ours = results["model"]["bytes"], results["mg-convert import-hf"]["above_baseline"]
    print(f"model {model / 1e6:.0f} MB: import-hf +{ours / 1e6:.0f} MB")
    assert ours < 0.5 * model


@pytest.mark.slow
def test_import_peak_rss_of_a_1_4_gb_model(tmp_path) -> None:
    """~1.4 GB fp32; the whole-model reference shows the measurement sees a held model."""
    results = _bench().run(24, 1024, 2816, 32000, tmp_path)
    model = results["model"]["bytes"]
    ours = results["mg-convert import-hf"]["above_baseline"]
    whole = results["whole-model reference"]["above_baseline"]
    print(
        f"model {model / 1e6:.0f} MB: import-hf +{ours / 1e6:.0f} MB, whole +{whole / 1e6:.0f} MB"
    )
    assert whole > 0.9 * model
    assert ours < 0.35 * model
