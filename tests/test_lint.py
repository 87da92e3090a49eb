"""The repository stays `ruff check` and `ruff format` clean (configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    beside_python = Path(sys.executable).with_name("ruff")
    if beside_python.exists():
        return [str(beside_python)]
    found = shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed")
    return [found]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command: list[str]) -> None:
    result = subprocess.run(
        [*_ruff(), *command, "."], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
