"""Every benchmark script still imports: the names it takes from the packages exist (a
benchmark is run by hand, so a moved function would otherwise go unnoticed until
someone runs it). Only the module's top level runs; `main()` does not."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("path", sorted(BENCH.glob("bench_*.py")), ids=lambda p: p.stem)
def test_bench_script_imports(path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] == "mg":
            raise  # a module of ours that moved
        pytest.skip(f"optional dependency {err.name} not installed")
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
