"""Kill -9 and SIGTERM at every step of a checkpoint save, then resume.

A checkpoint at iteration 2 is resumed by a run that saves iteration 3 and is
killed right before one of the file-system steps of that save (listed by a
recording run, so every step of every format is covered: the staging folder,
each fsync, the renames, the tracker). After the kill:

- iteration 2's files and the tracker are byte-identical, or the tracker names
  iteration 3 and that save is complete;
- a run resuming from the folder (same --load and --save, as a user would)
  trains on, and its losses equal those of a run that was never interrupted.

SIGTERM without `--exit-signal-handler` kills as -9 does; with it, the save in
progress finishes and the run exits 0 at that iteration (Megatron's behaviour).
The kill happens in a subprocess running `kill_during_save.py`, which wraps the
`os` functions a save goes through: no test hooks in the product.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import train_argv, tree_digest

from mg.trainer.cli import main

WRAPPER = Path(__file__).with_name("kill_during_save.py")
TRACKER = "latest_checkpointed_iteration.txt"
FORMATS = {
    "torch": ("--ckpt-format", "torch"),
    "torch_dist": ("--ckpt-format", "torch_dist"),
    "torch_dist-async": ("--ckpt-format", "torch_dist", "--async-save"),
}
# one schedule for every run (train-iters 5), stopped early with --exit-interval
SCHEDULE = ("--lr-decay-iters", "8", "--log-interval", "1")
LOSS = re.compile(r"iteration +(\d+)/ *\d+ \|.* lm loss: ([\d.E+-]+) \|")


def losses(text: str) -> dict[int, str]:
    """Iteration -> the logged loss, as printed (equal runs print equal digits)."""
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(text)}


def train(cache: Path, *flags: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(train_argv(cache, *SCHEDULE, *flags, iters=5))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kill-cache")


@pytest.fixture(scope="module")
def reference(cache) -> dict[int, str]:
    """The losses of 5 iterations never interrupted."""
    code, out = train(cache)
    assert code == 0
    found = losses(out)
    assert sorted(found) == [1, 2, 3, 4, 5], out
    return found


@pytest.fixture(scope="module")
def at_two(cache, tmp_path_factory) -> dict[str, Path]:
    """Per format, a checkpoint folder saved at iteration 2 of the 5-iteration schedule."""
    root = tmp_path_factory.mktemp("kill-base")
    folders = {}
    for name, flags in FORMATS.items():
        folders[name] = root / name
        code, _ = train(cache, "--save", str(folders[name]), "--exit-interval", "2", *flags)
        assert code == 0
        assert (folders[name] / TRACKER).read_text() == "2"
    return folders


def killed_run(
    cache: Path, ckpt: Path, fmt: str, spec: str, *extra: str
) -> subprocess.CompletedProcess:
    """Resume from 2 and save 3, killed as `spec` says (or recording its steps)."""
    argv = train_argv(cache, *SCHEDULE, "--load", str(ckpt), "--save", str(ckpt), iters=5)
    argv += ["--exit-interval", "3", *FORMATS[fmt], *extra]
    env = dict(os.environ, MG_KILL_AT=spec, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(WRAPPER), *argv], env=env, capture_output=True, text=True, timeout=300
    )


def save_steps(cache: Path, base: Path, fmt: str, tmp_path: Path) -> list[str]:
    ckpt = tmp_path / "record"
    shutil.copytree(base, ckpt)
    record = tmp_path / "steps.txt"
    done = killed_run(cache, ckpt, fmt, f"record:{record}")
    assert done.returncode == 0, done.stderr
    steps = record.read_text().splitlines()
    assert any(s.startswith(("rename", "replace")) and TRACKER in s for s in steps), steps
    return steps


def check_kill_and_resume(
    cache: Path,
    base: Path,
    fmt: str,
    step: int | str,
    how: str,
    reference: dict[int, str],
    tmp_path,
) -> None:
    """Kill before `step` (a number or a recorded step line) of the save of 3, then resume."""
    ckpt = tmp_path / f"{how}-{step}".replace(" ", "_")
    shutil.copytree(base, ckpt)
    before = tree_digest(ckpt / "iter_0000002")
    handled = how == "SIGTERM-handled"
    signame = "SIGTERM" if handled else how
    extra = ("--exit-signal-handler",) if handled else ()
    done = killed_run(cache, ckpt, fmt, f"{step}:{signame}", *extra)
    expected = 0 if handled else -getattr(signal, signame)
    assert done.returncode == expected, (step, done.returncode, done.stderr[-2000:])

    assert tree_digest(ckpt / "iter_0000002") == before, f"step {step}: iteration 2 changed"
    tracker = (ckpt / TRACKER).read_text()
    assert tracker in ("2", "3"), tracker
    if handled:
        assert tracker == "3", "the save in progress finishes on a handled SIGTERM"
    if tracker == "3":
        assert (ckpt / "iter_0000003").is_dir()

    code, out = train(cache, "--load", str(ckpt), "--save", str(ckpt), *FORMATS[fmt])
    assert code == 0, out[-2000:]
    resumed = losses(out)
    assert min(resumed) == int(tracker) + 1, (tracker, sorted(resumed))
    assert resumed == {i: reference[i] for i in resumed}, (step, resumed, reference)
    assert (ckpt / TRACKER).read_text() == "5"


def test_kill_before_the_tracker_of_a_torch_dist_save(cache, at_two, reference, tmp_path):
    """The cheap case: -9 right before the tracker moves to the new, complete iteration."""
    step = f"replace {TRACKER}.tmp-PID {TRACKER}"
    check_kill_and_resume(
        cache, at_two["torch_dist"], "torch_dist", step, "SIGKILL", reference, tmp_path
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGTERM-handled"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kill_at_every_step_of_a_save(cache, at_two, reference, tmp_path, fmt, how):
    steps = save_steps(cache, at_two[fmt], fmt, tmp_path)
    assert len(steps) >= 4, steps
    for step in range(len(steps)):
        check_kill_and_resume(cache, at_two[fmt], fmt, step, how, reference, tmp_path)
