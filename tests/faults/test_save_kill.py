"""Kill -9 and SIGTERM at every step of a checkpoint save, then resume.

A checkpoint at iteration 2 is resumed by a run that saves iteration 3 and is
killed right before one of the file-system steps of that save (listed by a
recording run, so every step of every format is covered: the staging folder,
each fsync, the renames, the tracker). After the kill:

- iteration 2's files and the tracker are byte-identical, or the tracker names
  iteration 3 and that save is complete;
- a run resuming from the folder (same --load and --save, as a user would)
  trains on, and its losses equal those of a run that was never interrupted.

SIGTERM is handled (mg-train always sets Megatron's `--exit-signal-handler`
behaviour): the save in progress finishes and the run exits 0 at that
iteration, whichever step it arrived at.
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
from collections.abc import Callable
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
def at_two(cache, tmp_path_factory) -> Callable[[str], Path]:
    """A format's checkpoint folder saved at iteration 2 of the 5-iteration schedule
    (built on first use: the cheap case needs one format)."""
    root = tmp_path_factory.mktemp("kill-base")
    built: dict[str, Path] = {}

    def folder(fmt: str) -> Path:
        if fmt not in built:
            path = root / fmt
            code, _ = train(cache, "--save", str(path), "--exit-interval", "2", *FORMATS[fmt])
            assert code == 0
            assert (path / TRACKER).read_text() == "2"
            built[fmt] = path
        return built[fmt]

    return folder


def killed_run(cache: Path, ckpt: Path, fmt: str, spec: str) -> subprocess.CompletedProcess:
    """Resume from 2, save 3 (--save-interval) and go on, killed as `spec` says; a
    recording run stops after that save."""
    argv = train_argv(cache, *SCHEDULE, "--load", str(ckpt), "--save", str(ckpt), iters=5)
    argv += ["--save-interval", "3", *FORMATS[fmt]]
    if spec.startswith("record:"):
        argv += ["--exit-interval", "3"]
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
    """Signal before `step` (a number or a recorded step line) of the save of 3, then resume.

    SIGKILL: the tracker names 2 or 3. SIGTERM: the save finishes and the run stops
    at the end of the iteration in progress (3; an async save may still be writing
    when iteration 4 or the run ends, which is then saved as well)."""
    ckpt = tmp_path / f"{how}-{step}".replace(" ", "_")
    shutil.copytree(base, ckpt)
    before = tree_digest(ckpt / "iter_0000002")
    done = killed_run(cache, ckpt, fmt, f"{step}:{how}")
    tracker = (ckpt / TRACKER).read_text()
    context = (step, tracker, done.returncode, done.stderr[-2000:])
    if how == "SIGTERM":
        assert done.returncode == 0, context
        # an async save may still be writing when later iterations, or the whole run, end
        assert tracker in (("3", "4", "5") if "--async-save" in FORMATS[fmt] else ("3",)), context
        if tracker != "5":
            message = f"exiting program at iteration {tracker}: received SIGTERM"
            assert message in done.stdout, context
    else:
        assert done.returncode == -getattr(signal, how), context
        assert tracker in ("2", "3"), context
    assert tree_digest(ckpt / "iter_0000002") == before, f"step {step}: iteration 2 changed"
    for iteration in {3, int(tracker)} - {2} if tracker != "2" else ():  # the saves made
        assert (ckpt / f"iter_{iteration:07d}").is_dir(), context

    if tracker == "5":
        return  # the run finished: nothing left to resume
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
        cache, at_two("torch_dist"), "torch_dist", step, "SIGKILL", reference, tmp_path
    )


MAX_STEPS = 24  # more steps than any save takes (checked below: 17 for torch_dist), one case each


@pytest.fixture(scope="module")
def recorded(cache, at_two, tmp_path_factory) -> dict[str, list[str]]:
    """Per format, the file-system steps of the save of iteration 3 (recorded once)."""
    return {
        fmt: save_steps(cache, at_two(fmt), fmt, tmp_path_factory.mktemp(f"steps-{fmt}"))
        for fmt in FORMATS
    }


@pytest.mark.slow
def test_every_step_has_a_case(recorded) -> None:
    for fmt, steps in recorded.items():
        assert 4 <= len(steps) <= MAX_STEPS, (fmt, steps)


@pytest.mark.slow
@pytest.mark.parametrize("step", range(MAX_STEPS))
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kill_at_every_step_of_a_save(cache, at_two, reference, recorded, tmp_path, fmt, how, step):
    if step >= len(recorded[fmt]):
        pytest.skip(f"a {fmt} save has {len(recorded[fmt])} steps")
    check_kill_and_resume(cache, at_two(fmt), fmt, step, how, reference, tmp_path)
