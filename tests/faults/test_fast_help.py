"""Every command's `--help` answers at once: no torch (30 s to import on a loaded box)
before argparse has printed the help."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

# (module with main, argv)
COMMANDS = [
    ("mg.corpus_prep.cli", ["--help"]),
    ("mg.corpus_prep.cli", ["tokenize", "--help"]),
    ("mg.corpus_prep.cli", ["clean", "--help"]),
    ("mg.trainer.cli", ["--help"]),
    ("mg.trainer.cli", ["gpt", "--help"]),
    ("mg.evaluate.cli", ["--help"]),
    ("mg.evaluate.cli", ["ppl", "--help"]),
    ("mg.evaluate.cli", ["race", "--help"]),
    ("mg.ckpt_convert.cli", ["--help"]),
    ("mg.ckpt_convert.cli", ["export-hf", "--help"]),
    ("mg.quantize_export.cli", ["--help"]),
    ("mg.generate_server.cli", ["--help"]),
]

PROBE = """
import sys, time
start = time.perf_counter()
from {module} import main
try:
    main({argv!r})
except SystemExit as stop:
    assert stop.code in (0, None), stop.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", time.perf_counter() - start)
"""


@pytest.mark.parametrize(("module", "argv"), COMMANDS)
def test_help_imports_no_torch(module: str, argv: list[str]) -> None:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, argv=argv)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    wall = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
    verdict, seconds = result.stdout.split()[-2:]
    assert verdict == "NO-TORCH", f"{module} {argv} imported torch before answering --help"
    # numpy/yaml only: well under a second on a quiet machine; generous for a loaded one
    assert float(seconds) < 3.0, (seconds, wall)


@pytest.mark.parametrize(
    ("family", "flag", "says"),
    [
        ("gpt", "--split", "969,30,1 (the default)"),
        ("bert", "--bert-no-binary-head", "BERT without the sentence-order (binary) head"),
    ],
)
def test_train_help_agrees_with_the_defaults(family, flag, says, capsys) -> None:
    """--split's default is 969,30,1 (not None); --bert-no-binary-head turns the head off,
    so no "(default: True)" may follow it; no flag's text shows two defaults."""
    from mg.trainer.cli import main

    with pytest.raises(SystemExit):
        main([family, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    entry = text[text.index(f"{flag} ", text.index("options:")) :][:200]
    assert says in entry, entry
    assert "default: None" not in entry and "default: True" not in entry, entry
    assert ") (default:" not in text  # a default stated twice
