"""Ctrl-C and long silences in a running mg-train.

Ctrl-C (SIGINT) saves and exits cleanly, as SIGTERM does (Megatron's
`--exit-signal-handler`): a real signal to a real mg-train process. A slow run
prints a line when its first iteration completes and a heartbeat when no log
line has appeared for a while, from the log rank only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fault_helpers import train_argv

FIRST_LINE = "first iteration done"


def _start_training(tmp_path: Path, *extra: str) -> subprocess.Popen:
    argv = train_argv(tmp_path / "cache", "--save", str(tmp_path / "ckpt"), *extra, iters=100000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "mg.trainer.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _read_until(process: subprocess.Popen, marker: str, timeout: float = 240.0) -> str:
    """stdout up to the line holding ``marker`` (the process killed on a timeout)."""
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in process.stdout:
            seen.append(line)
            if marker in line:
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout):
        process.kill()
        pytest.fail(f"no {marker!r} line within {timeout:.0f} s: {''.join(seen)[-2000:]}")
    return "".join(seen)


def _iteration_of(line: str) -> int:
    """The iteration of a log, first-iteration or heartbeat line (a test's "log N" too)."""
    return int(re.search(r"(?:iteration|log)\s+(\d+)", line).group(1))


@pytest.mark.slow
def test_ctrl_c_saves_then_exits_cleanly(tmp_path) -> None:
    process = _start_training(tmp_path)
    try:
        _read_until(process, FIRST_LINE)
        time.sleep(1.0)  # a few more iterations
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()

    assert process.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "received SIGINT" in out, out
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    iteration = int(tracker.read_text())
    assert iteration >= 1
    assert f"exiting program at iteration {iteration}: received SIGINT" in out, out
    assert (tmp_path / "ckpt" / f"iter_{iteration:07d}").is_dir()
    assert not list((tmp_path / "ckpt").glob("*.tmp*")), list((tmp_path / "ckpt").iterdir())


def test_first_iteration_and_heartbeat_lines(tmp_path, monkeypatch, capsys) -> None:
    from mg.trainer.cli import main
    from mg.trainer.training import Trainer

    monkeypatch.setattr(Trainer, "heartbeat_seconds", 0.0)  # every silent iteration
    argv = train_argv(tmp_path / "cache", iters=4)  # --log-interval 1000: no log line at all
    capsys.readouterr()

    assert main(argv) == 0

    lines = capsys.readouterr().out.splitlines()
    first = [line for line in lines if FIRST_LINE in line]
    beats = [line for line in lines if "still training" in line]
    assert len(first) == 1 and "iteration        1/       4 |" in first[0], lines
    assert "elapsed time (ms):" in first[0]
    assert [_iteration_of(b) for b in beats] == [2, 3, 4], lines
    assert all("next at iteration 4" in b for b in beats), beats


def test_heartbeat_waits_for_silence() -> None:
    from mg.trainer.heartbeat import Heartbeat

    now = [0.0]
    printed: list[str] = []
    beat = Heartbeat(10, 100, printed.append, interval=60.0, clock=lambda: now[0])
    for iteration in range(1, 31):
        now[0] += 7.0  # 7 s per iteration
        beat.after_iteration(iteration, iteration * 8)
        if iteration % 10 == 0:
            printed.append(f"log {iteration}")
            beat.logged()

    assert FIRST_LINE in printed[0] and "iteration        1/     100 |" in printed[0]
    # silence counts from the last line: 9 iterations of 7 s after each log line
    assert [_iteration_of(line) for line in printed[1:]] == [10, 19, 20, 29, 30], printed
    assert "elapsed time per iteration (ms): 7000.0" in printed[2], printed
    assert "no log line for 63 s, next at iteration 20" in printed[2], printed


def test_no_first_line_when_the_first_iteration_logs(tmp_path, capsys) -> None:
    from mg.trainer.cli import main

    assert main(train_argv(tmp_path / "cache", "--log-interval", "1", iters=2)) == 0
    out = capsys.readouterr().out
    assert FIRST_LINE not in out and "still training" not in out


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path) -> None:
    process = _start_training(tmp_path)
    try:
        _read_until(process, FIRST_LINE)
        process.send_signal(signal.SIGINT)
        time.sleep(0.01)
        process.send_signal(signal.SIGINT)  # may land after the save: then it exits 0
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()

    assert process.returncode in (0, 130), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    if process.returncode == 130:
        (line,) = err.strip().splitlines()
        assert line.startswith("mg-train: interrupted (Ctrl-C)"), line
