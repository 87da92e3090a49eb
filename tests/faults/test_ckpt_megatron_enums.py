"""Megatron-LM's pickled enums in a checkpoint: every tool reads them, nothing runs.

A real Megatron-LM run pickles ``megatron.core.transformer.enums.AttnBackend`` and
``signal.Signals`` into the ``args`` of its ``common.pt`` / ``model_optim_rng.pt``.
The pickles here name those classes exactly as Megatron-LM's do, written by a
pickler that writes any module and class name, so megatron-core is not needed;
when it is installed, one case pickles its real enums too.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from fault_helpers import exit_code

DIST = "iter_0000002"
ATTN_BACKEND = ("megatron.core.transformer.enums", "AttnBackend")
FOREIGN = [f"{ATTN_BACKEND[0]}.{ATTN_BACKEND[1]}", "signal.Signals"]


class _Named:
    """A class that pickles under another module and name (Megatron's, here)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args):  # never called: only pickled
        raise AssertionError("a stand-in for pickling only")


class _EnumValue:
    """Pickles as Megatron's enums do: "call the class with the member's value"."""

    def __init__(self, cls: _Named, value: int) -> None:
        self.cls, self.value = cls, value

    def __reduce__(self):
        return (self.cls, (self.value,))


class _Pickler(pickle._Pickler):  # the pure-Python pickler lets save_global be overridden
    def save_global(self, obj, name=None):
        if isinstance(obj, _Named):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, _Named):
            return self.save_global(obj)
        return super().save(obj, save_persistent_id)


_PICKLE_MODULE = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def megatron_like_args(args: dict | argparse.Namespace) -> argparse.Namespace:
    """``args`` as Megatron-LM pickles them: a Namespace with an AttnBackend and a signal."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    values["attention_backend"] = _EnumValue(_Named(*ATTN_BACKEND), 5)  # AttnBackend.auto
    values["exit_signal"] = signal.SIGTERM
    values["save"] = pathlib.PosixPath("/checkpoints/gpt")
    values["rerun"] = types.SimpleNamespace(mode="disabled")
    return argparse.Namespace(**values)


def resave_with_enums(path: Path) -> None:
    """Rewrite a checkpoint file with Megatron-LM's enums in its args."""
    state = torch.load(path, weights_only=False)
    state["args"] = megatron_like_args(state.get("args") or {})
    buffer = io.BytesIO()
    torch.save(state, buffer, pickle_module=_PICKLE_MODULE)
    path.write_bytes(buffer.getvalue())


def unsafe_names(path: Path) -> list[str]:
    return torch.serialization.get_unsafe_globals_in_checkpoint(path)


@pytest.fixture(autouse=True)
def no_registered_megatron_globals():
    """As in a tool's process: megatron-core, once imported by another test, registers its
    enums with torch's weights-only loader for the whole process."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(registered)


def test_common_pt_with_megatron_enums_reads_as_names(artifacts, tmp_path) -> None:
    from mg.core.checkpoint.dist_format import load_common

    load = tmp_path / "dist"
    shutil.copytree(artifacts / "dist", load)
    resave_with_enums(load / DIST / "common.pt")
    assert set(FOREIGN) <= set(unsafe_names(load / DIST / "common.pt"))

    args = load_common(load / DIST)["args"]

    assert args.attention_backend == "auto"
    assert args.exit_signal == "SIGTERM"
    assert type(args.attention_backend) is str and type(args.exit_signal) is str
    assert args.save == "/checkpoints/gpt" and args.rerun.mode == "disabled"


@pytest.mark.parametrize("tool", ["mg-eval", "mg-convert inspect", "mg-convert export-hf"])
def test_every_tool_loads_a_checkpoint_with_megatron_enums(
    tool, artifacts, tmp_path, capsys
) -> None:
    load = tmp_path / "dist"
    shutil.copytree(artifacts / "dist", load)
    resave_with_enums(load / DIST / "common.pt")
    out = tmp_path / "out"
    capsys.readouterr()
    if tool == "mg-eval":
        from mg.evaluate.cli import main

        argv = ["ppl", "--load", str(load), "--data-path", str(artifacts / "data_text_document")]
        argv += ["--split", "50,50,0", "--eval-iters", "1"]
        argv += ["--data-cache-path", str(tmp_path / "cache")]
    else:
        from mg.ckpt_convert.cli import main

        argv = (
            ["inspect", str(load)]
            if tool.endswith("inspect")
            else ["export-hf", "--load", str(load), "--save", str(out)]
        )

    code = exit_code(lambda: main(argv))

    err = capsys.readouterr().err
    assert code == 0, err
    assert "allow_pickle" not in err and "Traceback" not in err


def test_other_pickled_classes_are_still_refused_by_name(tmp_path) -> None:
    from mg.core.checkpoint import CheckpointError
    from mg.core.checkpoint.serialization import load_file

    path = tmp_path / "model_optim_rng.pt"
    value = _EnumValue(_Named("os", "system"), 0)  # would run a shell command if called
    buffer = io.BytesIO()
    torch.save({"args": megatron_like_args({"x": value})}, buffer, pickle_module=_PICKLE_MODULE)
    path.write_bytes(buffer.getvalue())

    with pytest.raises(CheckpointError, match=r"outside the safe allowlist: os\.system") as info:
        load_file(path)
    assert "megatron" not in str(info.value)


def test_import_megatron_writes_no_enums(artifacts, tmp_path, capsys) -> None:
    """import-megatron's output is plain data: its args hold the names, not the enums."""
    from mg.ckpt_convert.cli import main

    megatron = tmp_path / "megatron"
    export = ["export-megatron", "--load", str(artifacts / "torch"), "--save", str(megatron)]
    assert exit_code(lambda: main(export)) == 0
    rank_file = next(megatron.glob("iter_*/mp_rank_00/model_optim_rng.pt"))
    resave_with_enums(rank_file)

    imported = ["import-megatron", "--load", str(megatron), "--save", str(tmp_path / "mg")]
    assert exit_code(lambda: main(imported)) == 0

    written = next((tmp_path / "mg").glob("iter_*/mp_rank_00/model_optim_rng.pt"))
    assert unsafe_names(written) == []
    args = torch.load(written, weights_only=True)["args"]
    assert args["attention_backend"] == "auto" and args["exit_signal"] == "SIGTERM"
    assert type(args["exit_signal"]) is str


_REAL_ENUMS = """
import argparse, signal, sys, torch
from megatron.core.transformer.enums import AttnBackend
state = torch.load(sys.argv[1], weights_only=False)
args = state["args"]
args = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
args.update(attention_backend=AttnBackend.flash, exit_signal=signal.SIGINT)
state["args"] = argparse.Namespace(**args)
torch.save(state, sys.argv[1])
"""


@pytest.mark.slow
def test_real_megatron_core_enums(artifacts, tmp_path) -> None:
    """The same with megatron-core's own enums, pickled by megatron-core (if installed)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    load = tmp_path / "dist"
    shutil.copytree(artifacts / "dist", load)
    common = load / DIST / "common.pt"
    subprocess.run([sys.executable, "-c", _REAL_ENUMS, str(common)], check=True)
    reader = (
        "import sys; from mg.core.checkpoint.dist_format import load_common; "
        "a = load_common(sys.argv[1])['args']; print(a.attention_backend, a.exit_signal, "
        "'megatron' in sys.modules)"
    )

    out = subprocess.run(
        [sys.executable, "-c", reader, str(load / DIST)], check=True, capture_output=True, text=True
    ).stdout.split()

    assert out == ["flash", "SIGINT", "False"]  # names, megatron-core never imported
