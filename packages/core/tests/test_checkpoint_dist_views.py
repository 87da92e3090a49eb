"""torch_dist saves of views into flat buffers (the distributed optimizer's buckets) make
no copy: DCP's writer would clone each view and keep every clone until its file is
written, a full copy of the rank's state. `dcp_ready` hands it storage slices instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mg.core.checkpoint.dist_format import (
    dcp_ready,
    load_dist_checkpoint,
    own_storage,
    save_dist_checkpoint,
)

ROWS, COLS, PIECES = 500, 1000, 50  # 50 views of 2 MB: 100 MB in all


def _views(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    size = ROWS * COLS
    return {f"t{i}": flat[i * size : (i + 1) * size].view(ROWS, COLS) for i in range(PIECES)}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_own_storage_shares_memory_without_excess() -> None:
    flat = torch.arange(12.0)
    view = flat[3:9].view(2, 3)
    exact = own_storage(view)
    assert exact.untyped_storage().nbytes() == view.nbytes
    assert exact.data_ptr() == view.data_ptr() and torch.equal(exact, view)
    flat[4] = -1.0
    assert exact[0, 1] == -1.0
    strided = flat.view(3, 4)[:, 1]  # not contiguous: left alone
    assert own_storage(strided) is strided
    assert dcp_ready({"a": [view]})["a"][0].untyped_storage().nbytes() == view.nbytes


def test_save_of_views_makes_no_copy_and_loads_through_them(tmp_path: Path) -> None:
    flat = torch.randn(PIECES * ROWS * COLS)
    state = _views(flat)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("needs Linux's clear_refs to reset the peak-RSS mark")
    start = _status("VmRSS")
    save_dist_checkpoint(tmp_path, 1, {"model": state}, {"note": "views"})
    grown = _status("VmHWM") - start
    assert grown < 0.25 * flat.nbytes, f"the save grew the resident set by {grown / 2**20:.0f} MiB"
    target = torch.zeros_like(flat)
    load_dist_checkpoint(tmp_path / "iter_0000001", {"model": _views(target)})
    assert torch.equal(target, flat)
