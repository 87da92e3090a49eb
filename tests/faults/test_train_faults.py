"""mg-train under mistakes that used to lose work or print tracebacks.

The checkpoint-protection rule: a run that would start below the iterations
`--save` already holds (a typo'd `--load`, no `--load`, `--finetune` into the
same folder) is refused before anything is built, naming both folders and the
flags to choose, and leaves every file byte-identical.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import exit_code, train_argv, tree_digest

from mg.trainer.cli import main


def run(tmp_path: Path, *extra: str, iters: int = 2) -> int:
    return exit_code(lambda: main(train_argv(tmp_path / "cache", *extra, iters=iters)))


@pytest.fixture
def saved(artifacts, tmp_path) -> Path:
    """A copy of a checkpoint folder at iteration 2."""
    folder = tmp_path / "ckpt"
    shutil.copytree(artifacts / "dist", folder)
    return folder


@pytest.mark.parametrize(
    ("load", "extra", "reason"),
    [
        ("ckpt-typo", (), "does not exist"),
        (None, (), "no --load was given"),
        ("empty", (), "holds no checkpoint"),
        ("ckpt", ("--finetune",), "--finetune restarts at iteration 0"),
    ],
    ids=["typo-load", "no-load", "empty-load", "finetune-into-save"],
)
def test_save_with_checkpoints_is_protected(saved, tmp_path, capsys, load, extra, reason) -> None:
    (tmp_path / "empty").mkdir()
    before = tree_digest(saved)
    flags = ["--save", str(saved), *extra]
    if load is not None:
        flags += ["--load", str(tmp_path / load)]
    assert run(tmp_path, *flags, iters=4) == 2
    err = capsys.readouterr().err
    assert f"--save {saved} already holds checkpoints up to iteration 2" in err, err
    assert reason in err and "--overwrite-checkpoints" in err, err
    if load != "ckpt":
        assert f"--load {saved}" in err  # the way to resume from it
    assert "Traceback" not in err
    assert tree_digest(saved) == before
    assert not (tmp_path / "ckpt-typo").exists()


def test_override_and_resume(saved, tmp_path, capsys) -> None:
    """--load of the same folder resumes; --overwrite-checkpoints overwrites on purpose."""
    assert run(tmp_path, "--load", str(saved), "--save", str(saved), iters=3) == 0
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert run(tmp_path, "--save", str(saved), "--overwrite-checkpoints", iters=1) == 0
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_save_path_through_a_file_is_refused_before_training(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("not a folder")
    assert run(tmp_path, "--save", str(tmp_path / "file" / "ckpt")) == 2
    err = capsys.readouterr().err
    assert "a part of the path is a file" in err and str(tmp_path / "file") in err
    assert "iteration" not in capsys.readouterr().out
    assert (tmp_path / "file").read_text() == "not a folder"


def test_save_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """A read-only --save (patched open: the suite may run as root, which ignores modes)."""
    import builtins

    real_open = builtins.open

    def read_only(file, mode="r", *args, **kwargs):
        if "w" in mode and ".mg-write-probe" in str(file):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    assert run(tmp_path, "--save", str(tmp_path / "ckpt")) == 2
    err = capsys.readouterr().err
    assert f"--save {tmp_path / 'ckpt'}: cannot write into it (Permission denied)" in err
    assert list((tmp_path / "ckpt").iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--save-interval", "0", "--save", "S"), "--save-interval 0: must be at least 1"),
        (("--save-interval", "-5", "--save", "S"), "--save-interval -5: must be at least 1"),
    ],
)
def test_flag_values_refused(tmp_path, capsys, flags, message) -> None:
    flags = tuple(str(tmp_path / "s") if f == "S" else f for f in flags)
    assert run(tmp_path, *flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_train_iters_zero_says_what_is_wrong(tmp_path, capsys) -> None:
    assert run(tmp_path, iters=0) == 2
    err = capsys.readouterr().err
    assert "--train-iters 0: nothing to train" in err, err


def _dataset_argv(tmp_path: Path, prefix: Path) -> list[str]:
    argv = train_argv(tmp_path / "cache")
    argv = [a for a in argv if a != "--mock-data"]
    return [*argv, "--data-path", str(prefix), "--tokenizer-type", "NullTokenizer"]


def test_corrupt_dataset_is_one_line(artifacts, tmp_path, capsys) -> None:
    """An .idx cut short: IndexedDatasetError, exit 2, no traceback (was uncaught)."""
    prefix = tmp_path / "data_text_document"
    for ext in (".bin", ".idx"):
        shutil.copy(artifacts / f"data_text_document{ext}", f"{prefix}{ext}")
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes()[:40])
    assert exit_code(lambda: main(_dataset_argv(tmp_path, prefix))) == 2
    err = capsys.readouterr().err
    assert err.startswith("mg-train: error: ") and str(idx) in err and "truncated" in err, err
    assert len(err.strip().splitlines()) == 1


def test_zero_document_dataset_is_a_clean_error(tmp_path, capsys) -> None:
    from mg.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "empty_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    builder.finalize(f"{prefix}.idx")
    assert exit_code(lambda: main(_dataset_argv(tmp_path, prefix))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mg-train: error: --data-path {prefix}: the dataset has 0 documents")
    assert "Traceback" not in err


def _disk_with(monkeypatch, free: int) -> None:
    """--save's disk as shutil.disk_usage reports it (a full disk cannot be made here)."""
    import shutil as real
    from collections import namedtuple

    from mg.trainer import save_guard

    usage = namedtuple("usage", "total used free")
    fake = type("shutil", (), {"disk_usage": staticmethod(lambda path: usage(free, 0, free))})
    monkeypatch.setattr(save_guard, "shutil", fake)
    assert real.disk_usage  # the module itself is untouched


def test_save_on_a_full_disk_is_refused_before_training(tmp_path, monkeypatch, capsys) -> None:
    """One checkpoint of the tiny model is ~12 bytes x ~17k parameters: 100 KB free is short."""
    from mg.trainer.save_guard import checkpoint_bytes

    _disk_with(monkeypatch, 100_000)
    save = tmp_path / "ckpt"
    assert run(tmp_path, "--save", str(save)) == 2
    captured = capsys.readouterr()
    assert f"--save {save}: its disk has 100.0 KB free, one checkpoint needs about" in captured.err
    assert "iteration" not in captured.out
    assert not list(save.iterdir())  # nothing written
    assert checkpoint_bytes(1000) == 12_000 and checkpoint_bytes(1000, save_optim=False) == 4000


def test_save_without_room_for_every_checkpoint_warns(tmp_path, monkeypatch, capsys) -> None:
    from mg.trainer.save_guard import planned_saves

    save = tmp_path / "ckpt"
    from mg.trainer.arguments import parse_args

    args = parse_args(train_argv(tmp_path / "cache", "--save", str(save), "--save-interval", "1"))
    size, saves = planned_saves(args)
    assert saves == 3 and size > 0
    _disk_with(monkeypatch, int(size * 1.5))
    assert run(tmp_path, "--save", str(save), "--save-interval", "1") == 0
    err = capsys.readouterr().err
    assert f"WARNING: --save {save}: its disk has" in err and "room for 1 of the 3" in err, err


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_ckpt_step_loads_an_older_iteration(tmp_path, capsys, fmt) -> None:
    """--ckpt-step N (Megatron's flag) resumes from iter_000000N, not the tracker's: the
    losses after it are the original run's; into the same --save it is a roll-back, refused
    without --overwrite-checkpoints; a missing N is one line naming the flag."""
    import re

    loss = re.compile(r"iteration +(\d+)/ *\d+ \|.* lm loss: ([\d.E+-]+) \|")
    ckpt, fork = tmp_path / "ckpt", tmp_path / "fork"
    flags = ("--ckpt-format", fmt, "--log-interval", "1", "--lr-decay-iters", "8")
    assert run(tmp_path, "--save", str(ckpt), "--save-interval", "2", *flags, iters=4) == 0
    original = dict(loss.findall(capsys.readouterr().out))
    assert sorted(original) == ["1", "2", "3", "4"]
    before = tree_digest(ckpt)

    step = ("--load", str(ckpt), "--ckpt-step", "2")
    assert run(tmp_path, *step, "--save", str(fork), *flags, iters=4) == 0
    out = capsys.readouterr().out
    assert f"loaded checkpoint from {ckpt} at iteration 2" in out
    assert dict(loss.findall(out)) == {"3": original["3"], "4": original["4"]}

    assert run(tmp_path, *step, "--save", str(ckpt), *flags, iters=4) == 2
    err = capsys.readouterr().err
    assert "--ckpt-step 2 loads iteration 2" in err and "--overwrite-checkpoints" in err, err

    assert run(tmp_path, "--load", str(ckpt), "--ckpt-step", "3", *flags, iters=4) == 2
    err = capsys.readouterr().err
    assert "iter_0000003" in err and "--ckpt-step N" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert run(tmp_path, "--ckpt-step", "2", iters=4) == 2
    assert "--ckpt-step needs --load" in capsys.readouterr().err
    assert tree_digest(ckpt) == before
