"""mg-eval's messages: hints name its --ckpt-step flag, progress bars stay out of logs, and
`mg-eval ppl` and mg-train's validation line say which samples they scored (the same
samples give the same loss)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fault_helpers import TINY_MODEL, exit_code

from mg.evaluate.cli import main as evaluate

VALID_LINE = re.compile(
    r"validation loss at iteration 2 on validation set \| lm loss value: (\S+) \| .*"
    r"\| samples: (\d+)-(\d+) of the (\d+) built from the validation split \|"
)
PPL_LINE = re.compile(
    r"validation results on ppl \| lm loss: (\S+) \| .*"
    r"\| samples: 0-(\d+) of the (\d+) in one pass over the valid split \((.*?);"
)


def _ppl_argv(load: Path, data: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "ppl",
        "--load",
        str(load),
        "--data-path",
        str(data),
        "--split",
        "50,50,0",
        "--data-cache-path",
        str(cache),
        *extra,
    ]


def test_missing_iteration_names_ckpt_step(artifacts, tmp_path, capsys) -> None:
    data = artifacts / "data_text_document"
    argv = _ppl_argv(artifacts / "torch", data, tmp_path / "cache", "--ckpt-step", "7")
    capsys.readouterr()
    assert exit_code(lambda: evaluate(argv)) == 2
    err = capsys.readouterr().err
    assert "iteration=N" not in err, err
    assert "found iter_0000002" in err and "--ckpt-step N" in err, err


class _LogStream:
    """A log that cannot say whether it is a terminal (a capturing wrapper, a pipe object)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_no_progress_bar_in_a_log(artifacts, tmp_path, capsys, monkeypatch) -> None:
    log = _LogStream()
    monkeypatch.setattr("sys.stderr", log)
    argv = _ppl_argv(artifacts / "dist", artifacts / "data_text_document", tmp_path / "cache")
    assert exit_code(lambda: evaluate([*argv, "--eval-iters", "3", "--micro-batch-size", "2"])) == 0
    assert "\r" not in log.text, repr(log.text)
    assert "ppl (valid)" not in log.text


def test_ppl_and_validation_name_their_samples_and_agree_on_the_same(
    artifacts, tmp_path, capsys
) -> None:
    """mg-train validates on samples 0-11 (one validation, after training); mg-eval ppl on
    the same 12 samples gives the same loss; on the whole split another one, and both
    lines say which samples they scored."""
    from mg.trainer.cli import main as train

    data = artifacts / "data_text_document"
    cache = tmp_path / "cache"
    ckpt = tmp_path / "ckpt"
    argv = [
        "gpt",
        *TINY_MODEL,
        "--lr",
        "1e-3",
        "--data-path",
        str(data),
        "--split",
        "50,50,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "127",
        "--data-cache-path",
        str(cache),
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "2",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "3",
        "--log-interval",
        "1000",
        "--save",
        str(ckpt),
    ]
    capsys.readouterr()
    assert train(argv) == 0
    out = capsys.readouterr().out
    match = VALID_LINE.search(out)
    assert match, out
    valid_loss = float(match.group(1))
    assert (int(match.group(2)), int(match.group(3))) == (0, 11)  # --eval-iters 3 x GBS 4
    per_pass = int(match.group(4))

    report = tmp_path / "report.jsonl"
    same = _ppl_argv(ckpt, data, cache, "--eval-iters", "6", "--micro-batch-size", "2")
    assert exit_code(lambda: evaluate([*same, "--report", str(report)])) == 0
    out = capsys.readouterr().out
    match = PPL_LINE.search(out)
    assert match, out
    assert (int(match.group(2)), int(match.group(3))) == (11, per_pass)
    assert match.group(4) == "the first 12"
    metrics = json.loads(report.read_text())["metrics"]
    assert abs(metrics["loss"] - valid_loss) <= 1e-6 * valid_loss  # the printed 7 digits
    assert metrics["num_samples"] == 12 and metrics["split_samples"] == per_pass

    assert exit_code(lambda: evaluate(_ppl_argv(ckpt, data, cache))) == 0
    match = PPL_LINE.search(capsys.readouterr().out)
    assert match and match.group(4) == "all of them"
    assert int(match.group(2)) == per_pass - 1
    assert float(match.group(1)) != valid_loss  # other samples, another loss


def test_bad_ckpt_step_is_one_line_naming_the_flag(artifacts, tmp_path, capsys) -> None:
    for value in ("0", "-3", "abc"):
        argv = _ppl_argv(artifacts / "torch", artifacts / "data_text_document", tmp_path / "c")
        capsys.readouterr()
        assert exit_code(lambda a=argv, v=value: evaluate([*a, "--ckpt-step", v])) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert f"argument --ckpt-step: {value!r} is not a saved iteration" in err, err


def test_damaged_tracker_names_ckpt_step(artifacts, tmp_path, capsys) -> None:
    import shutil

    load = tmp_path / "torch"
    shutil.copytree(artifacts / "torch", load)
    (load / "latest_checkpointed_iteration.txt").write_text("garbage\n")
    argv = _ppl_argv(load, artifacts / "data_text_document", tmp_path / "c")
    capsys.readouterr()
    assert exit_code(lambda: evaluate(argv)) == 2
    err = capsys.readouterr().err
    assert "or pass --ckpt-step N." in err and "explicit iteration" not in err, err


def test_library_bars_stay_out_of_a_log(monkeypatch) -> None:
    """lm-eval draws plain tqdm bars (disable=False): quieted around the harness's call."""
    from tqdm import tqdm

    from mg.evaluate.progress import library_bars_on_terminal_only

    log = _LogStream()
    monkeypatch.setattr("sys.stderr", log)
    with library_bars_on_terminal_only():
        for _ in tqdm(range(3), desc="Building contexts", disable=False):
            pass
    assert log.text == "", repr(log.text)
    for _ in tqdm(range(3), desc="outside", file=log):  # restored after the block
        pass
    assert "\r" in log.text
