"""A save that dies half-way leaves the previous checkpoint loadable and the pointer untouched;
a write that fails is one SaveError saying why and that the previous checkpoint is intact."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import (
    list_iterations,
    load_checkpoint,
    read_latest_iteration,
    save_checkpoint,
    serialization,
)
from mg.core.checkpoint.save_errors import SaveError


class Crash(Exception):
    pass


def _state(tag: float) -> dict:
    return {"model": {"w": torch.full((64, 64), tag)}, "args": {"tag": tag}}


def _assert_previous_intact(root: Path) -> None:
    assert read_latest_iteration(root) == 10
    assert list_iterations(root) == [10]
    state, it = load_checkpoint(root)
    assert it == 10 and state["args"]["tag"] == 1.0
    assert torch.equal(state["model"]["w"], torch.full((64, 64), 1.0))


def test_crash_inside_torch_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, 10, _state(1.0))
    real_save = torch.save

    def half_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        f.write(b"PK\x03\x04 partial bytes")  # type: ignore[attr-defined]
        raise Crash("disk full")

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(SaveError, match=r"iteration 20 \(disk full\).*iteration 10"):
        save_checkpoint(tmp_path, 20, _state(2.0))
    monkeypatch.setattr(torch, "save", real_save)
    _assert_previous_intact(tmp_path)
    # no temp file left beside the would-be model file
    staged = list((tmp_path / "iter_0000020.tmp").rglob("*"))
    assert all(".pt.tmp-" not in p.name for p in staged)
    # the next attempt cleans the leftovers and succeeds
    save_checkpoint(tmp_path, 20, _state(2.0))
    assert read_latest_iteration(tmp_path) == 20
    assert not (tmp_path / "iter_0000020.tmp").exists()


def test_crash_when_renaming_model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, 10, _state(1.0))

    def failing_replace(src: object, dst: object) -> None:
        raise Crash(f"replace {src} -> {dst}")

    monkeypatch.setattr(serialization.os, "replace", failing_replace)
    with pytest.raises(SaveError, match="could not save the checkpoint of iteration 20"):
        save_checkpoint(tmp_path, 20, _state(2.0))
    monkeypatch.undo()
    _assert_previous_intact(tmp_path)


def test_crash_when_writing_pointer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The iteration folder is complete, but the pointer still names the previous save."""
    save_checkpoint(tmp_path, 10, _state(1.0))
    real_replace = os.replace

    def replace(src: object, dst: object) -> None:
        if str(dst).endswith("latest_checkpointed_iteration.txt"):
            raise Crash("killed while writing the pointer")
        real_replace(src, dst)

    monkeypatch.setattr(serialization.os, "replace", replace)
    with pytest.raises(Crash):
        save_checkpoint(tmp_path, 20, _state(2.0))
    monkeypatch.undo()
    assert read_latest_iteration(tmp_path) == 10
    assert load_checkpoint(tmp_path)[1] == 10
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert not list(tmp_path.glob("latest_checkpointed_iteration.txt.tmp-*"))
    assert load_checkpoint(tmp_path, 20)[0]["args"]["tag"] == 2.0  # complete, just not latest


def test_crash_while_replacing_same_iteration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, 10, _state(1.0))
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(Crash("boom")))
    with pytest.raises(SaveError, match=r"iteration 10 \(boom\)"):
        save_checkpoint(tmp_path, 10, _state(2.0))
    monkeypatch.undo()
    _assert_previous_intact(tmp_path)


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from mg.core.checkpoint import save_checkpoint
    root = sys.argv[1]
    save_checkpoint(root, 10, {"model": {"w": torch.full((64, 64), 1.0)}, "args": {"tag": 1.0}})
    print("first-done", flush=True)
    big = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(96)}  # ~400 MB
    save_checkpoint(root, 20, {"model": big, "args": {"tag": 2.0}})
    print("second-done", flush=True)
    """
)


def test_kill_9_mid_save(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "first-done"
        staging = tmp_path / "iter_0000020.tmp" / "mp_rank_00"
        deadline = time.monotonic() + 120
        killed_at = None
        while time.monotonic() < deadline:
            partial = list(staging.glob("model_optim_rng.pt.tmp-*")) if staging.is_dir() else []
            if partial and partial[0].stat().st_size > 8 * 1024 * 1024:
                killed_at = partial[0].stat().st_size
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed_at is not None, "the child finished or never started the big save"
    assert proc.returncode == -signal.SIGKILL
    _assert_previous_intact(tmp_path)
    assert not (tmp_path / "iter_0000020").exists()
