"""mg-serve's start: a Hugging Face folder is named as one (with the command that converts it),
`--ckpt-step` is the iteration flag (`--iteration` its alias), every loading step is logged
as it begins with the seconds since the start, and a log gets no progress-bar clutter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import exit_code

from mg.generate_server.startup_log import QUIET_PROGRESS_BARS

SERVE = [sys.executable, "-c", "from mg.generate_server.cli import main; main()"]


def _serve_in_process(argv: list[str], monkeypatch) -> tuple[int, dict]:
    """`mg-serve argv` in this process up to the HTTP server, which is not started: (exit
    status, what it would have served)."""
    from mg.generate_server import cli

    served: dict = {}

    def capture(args, loaded, runner, *_rest, **_kwargs):
        served.update(args=args, loaded=loaded)
        runner.close()

    monkeypatch.setattr(cli, "_serve_http", capture)
    return exit_code(lambda: cli.main([*argv, "--port", "0", "--num-threads", "1"])), served


@pytest.mark.parametrize("flag", ["--load", "--draft-load"])
def test_a_hugging_face_folder_is_named_with_its_conversion(
    artifacts: Path, flag, capsys, monkeypatch
) -> None:
    hf = artifacts / "hf"
    argv = ["--load", str(hf)] if flag == "--load" else ["--load", str(artifacts / "torch")]
    if flag == "--draft-load":
        argv += ["--draft-load", str(hf)]
    code, served = _serve_in_process(argv, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and not served
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0] == (
        f"mg-serve: error: {flag} {hf} is a Hugging Face folder (config.json + weights), not an "
        f"mg checkpoint; convert it first: mg-convert import-hf {hf} --save <ckpt>, "
        f"then {flag} <ckpt>"
    )


def test_sharded_and_bin_hugging_face_folders_too(artifacts: Path, capsys, monkeypatch) -> None:
    for folder in ("hf-sharded", "hf-bin"):
        code, _ = _serve_in_process(["--load", str(artifacts / folder)], monkeypatch)
        assert code == 2
        assert "is a Hugging Face folder" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--ckpt-step", "--iteration"])
def test_ckpt_step_and_its_alias_load_that_iteration(
    artifacts: Path, flag, capsys, monkeypatch
) -> None:
    code, served = _serve_in_process(["--load", str(artifacts / "torch"), flag, "2"], monkeypatch)
    assert code == 0, capsys.readouterr().err
    assert served["args"].ckpt_step == 2


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ("x", "argument --ckpt-step/--iteration: expected an iteration number or 'release'"),
        ("-1", "argument --ckpt-step/--iteration: expected an iteration number or 'release'"),
    ],
)
def test_a_bad_ckpt_step_is_one_line(artifacts: Path, step, message, capsys, monkeypatch) -> None:
    code, _ = _serve_in_process(
        ["--load", str(artifacts / "torch"), "--ckpt-step", step], monkeypatch
    )
    err = capsys.readouterr().err
    assert code == 2 and f"mg-serve: error: {message}" in err and "Traceback" not in err


def test_help_names_ckpt_step_with_its_alias() -> None:
    from mg.generate_server.cli import build_parser

    text = build_parser().format_help()
    assert "--ckpt-step N, --iteration N" in text
    assert "--iteration is an alias" in " ".join(text.split())


def test_loading_steps_are_logged_as_they_happen(artifacts: Path) -> None:
    """Each step on its own line with its elapsed seconds, in order, before the server
    listens; the output (a pipe, not a terminal) holds no carriage return."""
    proc = subprocess.Popen(
        [*SERVE, "--load", str(artifacts / "torch"), "--port", "0", "--num-threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k not in QUIET_PROGRESS_BARS},
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            raw = proc.stdout.readline()
            assert raw, b"".join(map(str.encode, lines)).decode() + "mg-serve exited early"
            assert b"\r" not in raw, raw
            lines.append(raw.decode())
            if "listening on" in lines[-1]:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = "".join(lines)
    expected = [
        "importing torch and the serving code",
        f"reading checkpoint {artifacts / 'torch'} (latest iteration) and building its model",
        "model built: GPTModel,",
        "setting up the KV cache",
        "choosing decode attention",
        "starting the engine and the HTTP server",
    ]
    found = [next((i for i, line in enumerate(lines) if e in line), -1) for e in expected]
    assert -1 not in found and found == sorted(found), text
    seconds = [float(re.search(r"\[(\d+\.\d) s\]$", lines[i].strip()).group(1)) for i in found]
    assert seconds == sorted(seconds), text
    banner = re.search(r"listening on http://\S+ .* after (\d+\.\d) s of start-up$", lines[-1])
    assert banner and float(banner.group(1)) >= seconds[-1], text


def test_progress_bars_are_off_in_a_log_and_on_a_terminal() -> None:
    """tqdm (what torch's and Hugging Face's bars are) draws nothing into a pipe once
    mg-serve has started; the user's own setting stays."""
    code = (
        "from mg.generate_server.startup_log import quiet_progress_bars_in_logs\n"
        "quiet_progress_bars_in_logs()\n"
        "import sys, tqdm\n"
        "for _ in tqdm.tqdm(range(3), file=sys.stderr): pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in QUIET_PROGRESS_BARS}
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env)
    assert piped.returncode == 0 and piped.stderr == b"", piped.stderr
    kept = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, env={**env, "TQDM_DISABLE": ""}
    )
    assert b"\r" in kept.stderr  # the user asked for bars: drawn
