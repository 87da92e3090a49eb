"""Building a megatron-core model in this process leaves no attention-backend variables
behind: megatron-core writes NVTE_FLASH_ATTN/NVTE_FUSED_ATTN/NVTE_UNFUSED_ATTN at a model's
construction and asserts on them at the next, so a leftover value broke a later test's
megatron-core subprocess (a different release whose default backend differs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.compat


def test_megatron_on_cpu_gives_back_the_environment(tmp_path: Path, monkeypatch) -> None:
    from mg.core.testing.megatron_reference import megatron_gpt_model, megatron_on_cpu, tiny_config

    monkeypatch.delenv("NVTE_FLASH_ATTN", raising=False)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")  # a caller's own value comes back as it was
    with megatron_on_cpu(tmp_path):
        megatron_gpt_model(tiny_config("gpt2"))
        assert os.environ.get("NVTE_FLASH_ATTN") is not None  # megatron-core set it
    assert "NVTE_FLASH_ATTN" not in os.environ
    assert os.environ["NVTE_FUSED_ATTN"] == "0"
