"""Run `mg-train` and kill it at one step of its checkpoint save (no hooks in the product).

    MG_KILL_AT=record:STEPS.txt python kill_during_save.py gpt ...   # list the save's steps
    MG_KILL_AT=3:SIGKILL        python kill_during_save.py gpt ...   # die before step 3
    MG_KILL_AT="replace latest_checkpointed_iteration.txt:SIGKILL" ...  # before that step

A save is a sequence of file-system steps (make the staging folder, fsync the
written files, rename the folder into place, replace the tracker); the
`os` functions behind them are wrapped once the trainer's first save begins,
and the process signals itself right before the chosen one, from whichever
thread runs it (an async save's writer thread too). Step numbers count from 0;
`record` writes one line per step ("fsync", "rename iter_0000003.tmp iter_0000003",
a temporary file's pid written as PID), and a step can be named by such a line
instead of its number.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

STEPS = ("mkdir", "fsync", "replace", "rename")  # the os functions a save goes through


def _describe(name: str, args: tuple) -> str:
    paths = [
        re.sub(r"\.tmp-\d+$", ".tmp-PID", Path(a).name)
        for a in args
        if isinstance(a, str | os.PathLike)
    ]
    return " ".join([name, *paths])


def install(spec: str) -> None:
    """Wrap the steps; count them from the start of the first save."""
    from mg.trainer import training

    armed = threading.Event()
    counter = itertools.count()
    lock = threading.Lock()
    if spec.startswith("record:"):
        record, target, signum = Path(spec.removeprefix("record:")), -1, 0
        record.write_text("")
    else:
        where, name = spec.rsplit(":", 1)
        record, target, signum = (
            None,
            int(where) if where.isdigit() else where,
            getattr(signal, name),
        )

    def wrap(name: str):
        real = getattr(os, name)

        def step(*args, **kwargs):
            if armed.is_set():
                with lock:
                    n, described = next(counter), _describe(name, args)
                    if record is not None:
                        with record.open("a") as out:
                            out.write(described + "\n")
                if target in (n, described):
                    os.kill(os.getpid(), signum)
                    if signal.getsignal(signum) == signal.SIG_DFL:
                        time.sleep(60)  # the signal may land on another thread: not a step more
            return real(*args, **kwargs)

        return step

    for name in STEPS:
        setattr(os, name, wrap(name))
    save = training.Trainer.save

    def armed_save(self) -> None:
        armed.set()
        save(self)

    training.Trainer.save = armed_save


def main() -> int:
    install(os.environ["MG_KILL_AT"])
    from mg.trainer.cli import main as train

    return train(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
