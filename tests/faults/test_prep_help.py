"""Every `mg-prep ... --help` answers at once: argparse only, none of the libraries the
commands run on (numpy, ftfy, the tokenizer engines, tqdm, zstandard). These cost
1-2.5 s on a loaded machine (numpy alone ~0.15 s idle); a --help that imports none of
them takes well under 0.5 s."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mg.corpus_prep.cli import SUBCOMMANDS

HEAVY = ("numpy", "ftfy", "tokenizers", "tiktoken", "sentencepiece", "tqdm", "zstandard", "torch")

PROBE = """
import sys, time
start = time.perf_counter()
from mg.corpus_prep.cli import main
try:
    main({argv!r})
except SystemExit as stop:
    assert stop.code in (0, None), stop.code
print(time.perf_counter() - start, *sorted(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_help_imports_nothing_heavy(command: str) -> None:
    argv = [command, "--help"] if command else ["--help"]
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv, heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: mg-prep" in result.stdout
    seconds, *imported = result.stdout.split("\n")[-2].split()
    assert imported == [], f"mg-prep {command} --help imported {imported}"
    assert float(seconds) < 3.0  # 0.05 s idle; generous for a loaded machine


def test_help_lists_what_the_trainer_can_train() -> None:
    from mg.corpus_prep.tokenizer_training import KINDS
    from mg.corpus_prep.train_tokenizer_flags import KINDS as OFFERED

    assert OFFERED == KINDS


def test_every_subcommand_runs_its_module() -> None:
    """`run_later` names a module whose `run` exists (a typo would surface only at run)."""
    import importlib

    from mg.corpus_prep.cli import build_parser

    for command in SUBCOMMANDS:
        parser = build_parser(command)
        action = next(a for a in parser._actions if a.dest == "command")
        func = action.choices[command].get_default("func")
        module_name = func.__closure__[0].cell_contents if func.__closure__ else None
        if module_name is not None:
            assert callable(importlib.import_module(f"mg.corpus_prep.{module_name}").run)
