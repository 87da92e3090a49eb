"""A checkpoint save that runs out of space, on a real small file system.

mg-train runs inside its own mount namespace (`unshare -rm`, no privileges
needed where user namespaces are allowed) with `--save` on a tmpfs that holds
one checkpoint but not two: the second save fails with ENOSPC. The run ends with
one line (exit 2), the partial `iter_N.tmp` is removed, and the first checkpoint
and the tracker are as they were. Skipped, with the reason, where a tmpfs cannot
be mounted this way.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import train_argv


def _can_mount(tmp_path: Path) -> str | None:
    """None if `unshare -rm` can mount a tmpfs here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    target = tmp_path / "probe"
    target.mkdir()
    probe = subprocess.run(
        ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a user namespace: {probe.stderr.strip()[:200]}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist", "torch_dist --async-save"])
def test_save_on_a_full_disk_keeps_the_previous_checkpoint(fmt, tmp_path) -> None:
    if reason := _can_mount(tmp_path):
        pytest.skip(reason)
    disk, copy = tmp_path / "disk", tmp_path / "after"
    disk.mkdir()
    save = disk / "ckpt"
    argv = train_argv(
        tmp_path / "cache", "--save", str(save), "--ckpt-format", *fmt.split(), iters=4
    )
    argv += ["--save-interval", "2"]
    train = shlex.join([sys.executable, "-m", "mg.trainer.cli", *argv])
    # one checkpoint of the tiny model is ~270 KB: room for the first save, not the second
    script = (
        f"mount -t tmpfs -o size=420k tmpfs {shlex.quote(str(disk))} || exit 99\n"
        f"{train}\necho mg-train-exit=$? >&2\n"
        f"cp -a {shlex.quote(str(save))} {shlex.quote(str(copy))}\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=600
    )

    err = done.stderr
    assert "mg-train-exit=2" in err, (done.stdout[-2000:], err[-3000:])
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("mg-train: error")]
    assert len(errors) == 1, err
    assert "iteration 4" in errors[0] and "space" in errors[0], errors[0]
    assert "iteration 2" in errors[0] and "as they were" in errors[0], errors[0]
    assert (copy / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in copy.iterdir()) == [
        "iter_0000002",
        "latest_checkpointed_iteration.txt",
    ]
    # the kept checkpoint still loads
    from mg.core.checkpoint.model_io import load_model

    assert load_model(copy)[3].iteration == 2
