"""`run_ranks` runs a launch again once when a rank dies by a signal, and only once."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from mg.core.testing.launch import run_ranks

if __name__ == "__main__":  # one rank: abort while the marker file holds fewer than N lines
    marker, aborts = Path(sys.argv[1]), int(sys.argv[2])
    runs = marker.read_text().count("\n") if marker.exists() else 0
    marker.write_text("run\n" * (runs + 1))
    if runs < aborts:
        os.abort()
    sys.exit(0)


def test_a_rank_killed_by_a_signal_is_retried_once(tmp_path: Path) -> None:
    marker = tmp_path / "once"
    [outcome] = run_ranks(__file__, 1, [str(marker), "1"], timeout=60)
    assert outcome.returncode == 0 and marker.read_text().count("\n") == 2


def test_a_second_death_is_reported(tmp_path: Path) -> None:
    marker = tmp_path / "twice"
    [outcome] = run_ranks(__file__, 1, [str(marker), "5"], timeout=60)
    assert outcome.returncode == -signal.SIGABRT and marker.read_text().count("\n") == 2
