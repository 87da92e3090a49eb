"""A `torch`-format save that fails on one rank: every rank gets the one error, the
staging folder goes, the previous checkpoint and the tracker stay (two ranks as threads
sharing a barrier, as core's save protocol tests drive them)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import load_checkpoint, save_checkpoint
from mg.core.checkpoint.save_errors import SaveError


class _Unwritable:
    """Fails when pickled, as a write to a full disk fails: after the file was begun."""

    def __reduce__(self):
        raise OSError(28, "No space left on device")


def _save_two_ranks(folder: Path, iteration: int, fail_rank: int | None) -> dict[int, object]:
    barrier = threading.Barrier(2, timeout=60)
    outcomes: dict[int, object] = {}

    def rank(tp: int) -> None:
        value = _Unwritable() if tp == fail_rank else torch.tensor(tp)
        try:
            outcomes[tp] = save_checkpoint(
                folder,
                iteration,
                {"model": {"w": value}},
                tp_rank=tp,
                tp_size=2,
                is_writer_of_latest=tp == 0,
                barrier=barrier.wait,
            )
        except Exception as error:  # noqa: BLE001 -- the outcome under test
            outcomes[tp] = error

    threads = [threading.Thread(target=rank, args=(tp,)) for tp in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a rank hangs in the save"
    return outcomes


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_one_rank_failing_discards_the_save_on_every_rank(tmp_path, fail_rank) -> None:
    assert all(isinstance(p, Path) for p in _save_two_ranks(tmp_path, 3, None).values())

    outcomes = _save_two_ranks(tmp_path, 6, fail_rank)

    assert all(isinstance(o, SaveError) for o in outcomes.values()), outcomes
    failed = str(outcomes[fail_rank])
    assert "no space left on device" in failed and "iteration 6" in failed, failed
    assert "previous checkpoint (iteration 3)" in failed and "as they were" in failed, failed
    assert "another rank could not write" in str(outcomes[1 - fail_rank])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]
    state, iteration = load_checkpoint(tmp_path, tp_rank=1)
    assert iteration == 3 and state["model"]["w"] == 1
