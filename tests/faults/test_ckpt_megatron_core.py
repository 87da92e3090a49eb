"""Checkpoints megatron-core 0.16.1 itself wrote, at TP=2 on 2 gloo CPU ranks.

- a bare ``dist_checkpointing.save`` (megatron-core's run_simple_mcore_train_loop.py:
  no args, no iteration in common.pt) resumes in mg-train with --no-load-optim
  --no-load-rng at the iteration its folder names (was a ``KeyError: 'iteration'``
  traceback), and ``mg-convert inspect`` reports the TP=2 it was saved at, read from
  the sharded metadata (was TP=1);
- mg-eval evaluates a Megatron-LM save as it is: the model its args describe (it
  refused one: no model config recorded, and the enums in its args);
- a Megatron-LM save without optimizer state, resumed without --no-load-optim, is
  refused for what it is: it holds no optimizer state (it was refused as holding
  Megatron's optimizer state).

One 2-rank launch of megatron_bare_save_worker.py writes both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_helpers import exit_code, train_argv

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.slow, pytest.mark.compat]
WORKER = Path(__file__).with_name("megatron_bare_save_worker.py")


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mg.core.checkpoint.dist_format import load_common
    from mg.core.testing.launch import launch_workers
    from mg.trainer.cli import main

    work = tmp_path_factory.mktemp("megatron_core_saves")
    # the model config mg-train builds from the fault suite's tiny-model flags
    assert main(train_argv(work / "cache", "--save", str(work / "mg"), iters=1)) == 0
    (folder,) = (work / "mg").glob("iter_*")
    config = load_common(folder)["mg"]["model_config"]
    (work / "config.json").write_text(json.dumps(config))
    launch_workers(str(WORKER), 2, [str(work)], timeout=900)
    return work


def test_bare_dist_checkpointing_save_resumes_at_its_folder_iteration(saves, tmp_path, capsys):
    from mg.trainer.cli import main

    argv = train_argv(saves / "cache", "--load", str(saves / "bare"), iters=7)
    argv += ["--no-load-optim", "--no-load-rng", "--save", str(tmp_path / "next")]
    capsys.readouterr()

    code = exit_code(lambda: main(argv))

    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "KeyError" not in err, err
    notes = [line for line in out.splitlines() if "records no iteration" in line]
    assert len(notes) == 1 and "iter_0000005" in notes[0] and "5" in notes[0], out
    assert (tmp_path / "next" / "latest_checkpointed_iteration.txt").read_text() == "7"


def test_inspect_reports_the_tensor_parallel_size_it_was_saved_at(saves, capsys) -> None:
    from mg.ckpt_convert.cli import main

    capsys.readouterr()
    assert exit_code(lambda: main(["inspect", str(saves / "bare")])) == 0
    out = capsys.readouterr().out
    assert "saved from TP=2, PP=1" in out, out


def test_megatron_lm_save_without_optimizer_state_is_named_so(saves, tmp_path, capsys) -> None:
    from mg.trainer.cli import main

    argv = train_argv(saves / "cache", "--load", str(saves / "lm"), iters=12)
    argv += ["--save", str(tmp_path / "next")]
    capsys.readouterr()

    assert exit_code(lambda: main(argv)) == 2

    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith("mg-train: error:") and "holds no optimizer state" in line, line
    assert "--no-load-optim" in line and "whose optimizer state" not in line, line


def test_mg_eval_reads_a_megatron_lm_save(saves, artifacts, tmp_path, capsys) -> None:
    from mg.evaluate.cli import main

    argv = [
        "ppl",
        "--load",
        str(saves / "lm"),
        "--data-path",
        str(artifacts / "data_text_document"),
    ]
    argv += ["--split", "50,50,0", "--eval-iters", "1", "--data-cache-path", str(tmp_path)]
    capsys.readouterr()

    code = exit_code(lambda: main(argv))

    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "ppl" in out.lower(), out


_EVAL = "import sys\nfrom mg.evaluate.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def test_mg_eval_reads_a_megatron_lm_save_at_tp2(saves, artifacts, tmp_path) -> None:
    """The same, each of two ranks reading its tensor-parallel part (load_model_part)."""
    from mg.core.testing.launch import run_ranks

    script = tmp_path / "mg_eval.py"
    script.write_text(_EVAL)
    argv = [
        "ppl",
        "--load",
        str(saves / "lm"),
        "--data-path",
        str(artifacts / "data_text_document"),
    ]
    argv += ["--split", "50,50,0", "--eval-iters", "1", "--data-cache-path", str(tmp_path)]
    argv += ["--tensor-model-parallel-size", "2"]

    outcomes = run_ranks(str(script), 2, argv)

    assert [o.returncode for o in outcomes] == [0, 0], [o.log[-2000:] for o in outcomes]
    assert not any("Traceback" in o.log for o in outcomes)
