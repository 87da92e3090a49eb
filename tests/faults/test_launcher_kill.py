"""Killing a tool kills the tool: `bin/mg-*` exec the tool itself, so a `kill -9` of the
PID a user, Slurm or cron started leaves no process of it behind, and a dataset being
written is never published afterwards. Under `just`, a recipe's last line execs the
launcher, and the tool dies with just too (Linux's parent-death signal)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fault_helpers import TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]
TOOLS_PATH = os.pathsep.join(
    [str(ROOT / ".tools" / "venv" / "bin"), str(ROOT / ".tools" / "target" / "bin"),
     os.environ.get("PATH", "")]
)  # fmt: skip

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.skipif(shutil.which("uv", path=TOOLS_PATH) is None, reason="bin/ needs uv"),
]


def _processes_naming(marker: str) -> list[int]:
    """PIDs of every live process whose command line holds `marker` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def _wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _kill_and_check_gone(process: subprocess.Popen, marker: str) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    # the tool's own workers die with it (PR_SET_PDEATHSIG): give the kernel a moment
    deadline = time.monotonic() + 5
    while _processes_naming(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _processes_naming(marker)
    for pid in left:  # never leave a stray behind for the next test
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes of the killed tool still running: {left}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 60 MB of loose JSON: well over ten seconds of tokenizing on one worker."""
    path = tmp_path_factory.mktemp("launcher-kill") / "corpus.jsonl"
    line = json.dumps({"text": " ".join(str(i % 120 + 1) for i in range(500))}) + "\n"
    path.write_text(line * 40_000)
    return path


def _tokenize_argv(corpus: Path, prefix: Path) -> list[str]:
    return [
        "tokenize", "--input", str(corpus), "--output-prefix", str(prefix),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--workers", "2",
    ]  # fmt: skip


def _started_writing(folder: Path) -> Callable[[], bool]:
    return lambda: any(p.name.endswith(".tmp") for p in folder.iterdir())


def _published(prefix: Path) -> list[str]:
    return [
        str(p) for p in prefix.parent.glob(f"{prefix.name}_text_document.*") if p.suffix != ".tmp"
    ]


def test_kill_9_of_bin_mg_prep_stops_the_tokenizer_and_publishes_nothing(corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    prefix = out / "corpus"
    process = subprocess.Popen(
        [str(ROOT / "bin" / "mg-prep"), *_tokenize_argv(corpus, prefix)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(_started_writing(out), 120, "mg-prep to start writing")
        # the tool and its tokenizer workers (forked as the first chunks are handed out,
        # which can be just after the output file is opened)
        _wait_for(lambda: len(_processes_naming(str(prefix))) >= 2, 60, "its workers")
    finally:
        _kill_and_check_gone(process, str(prefix))
    time.sleep(2)  # a surviving tool would rename its finished files into place now
    assert _published(prefix) == []


def test_kill_9_of_bin_mg_train_stops_training(tmp_path):
    save = tmp_path / "ckpt"
    log = tmp_path / "train.log"
    argv = [
        "gpt", *TINY_MODEL, "--lr", "1e-3", "--mock-data", "--vocab-size", "127",
        "--data-cache-path", str(tmp_path / "cache"), "--micro-batch-size", "2",
        "--train-iters", "1000000", "--eval-iters", "0", "--log-interval", "1",
        "--save", str(save), "--save-interval", "1000000",
    ]  # fmt: skip
    with log.open("w") as sink:
        process = subprocess.Popen(
            [str(ROOT / "bin" / "mg-train"), *argv], stdout=sink, stderr=subprocess.STDOUT
        )
        try:
            _wait_for(lambda: "iteration" in log.read_text(), 180, "mg-train's first iteration")
        finally:
            _kill_and_check_gone(process, str(save))


def test_kill_9_of_just_stops_the_recipe_tool(corpus, tmp_path):
    just = shutil.which("just", path=TOOLS_PATH)
    if just is None or shutil.which("setpriv") is None:
        pytest.skip("needs just and util-linux's setpriv")
    out = tmp_path / "out"
    out.mkdir()
    prefix = out / "corpus"
    justfile = tmp_path / "justfile"
    justfile.write_text(f"prep *args:\n    exec {ROOT / 'bin' / 'mg-prep'} {{{{args}}}}\n")
    process = subprocess.Popen(
        [just, "--justfile", str(justfile), "prep", *_tokenize_argv(corpus, prefix)],
        env=dict(os.environ, PATH=TOOLS_PATH),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(_started_writing(out), 120, "mg-prep under just to start writing")
    finally:
        _kill_and_check_gone(process, str(prefix))
    time.sleep(2)
    assert _published(prefix) == []


def test_mgw_becomes_just(tmp_path):
    """`python3 mgw ...` execs just: the PID started is just's, which passes SIGTERM on to
    the recipe's tool (and a recipe's tool dies with just, above)."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "mgw"), "--command", "sleep", "30"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    comm = Path(f"/proc/{process.pid}/comm")
    try:
        _wait_for(lambda: comm.read_text().strip() == "just", 60, "mgw to exec just")
    finally:
        process.terminate()  # just forwards SIGTERM to sleep and exits with it
        process.wait(timeout=30)


def test_launcher_without_uv_says_how_to_get_it(tmp_path):
    system_path = "/usr/bin:/bin"
    if shutil.which("uv", path=system_path):
        pytest.skip("uv is installed system-wide")
    (tmp_path / "bin").mkdir()
    for name in ("_launch", "mg-prep"):
        shutil.copy2(ROOT / "bin" / name, tmp_path / "bin" / name)
    result = subprocess.run(
        [str(tmp_path / "bin" / "mg-prep"), "--help"],
        env={"PATH": system_path, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 127
    assert result.stderr == f"uv not found: run 'python3 mgw setup' in {tmp_path} first\n"


def test_launcher_syncs_only_when_the_lock_changed_and_execs_the_tool(tmp_path):
    """In a workspace made of stand-ins (a uv that logs its calls, a tool that prints its
    PID): the first start syncs, later ones do not until uv.lock is newer, and the tool
    runs as the PID that was started."""
    root = tmp_path / "ws"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(ROOT / "bin" / "_launch", root / "bin" / "_launch")
    launcher = '#!/bin/sh\nexec "$(dirname "$0")/_launch" mg-demo "$@"\n'
    (root / "bin" / "mg-demo").write_text(launcher)
    (root / "pyproject.toml").write_text("[project]\nname = 'ws'\n")
    (root / "uv.lock").write_text("version = 1\n")
    earlier = time.time() - 60  # the stamp compares by mtime, to the second with some shells
    for name in ("pyproject.toml", "uv.lock"):
        os.utime(root / name, (earlier, earlier))
    uv = root / ".tools" / "venv" / "bin" / "uv"
    tool = root / ".venv" / "bin" / "mg-demo"
    for path, text in (
        (uv, f'#!/bin/sh\necho "$@" >> {tmp_path / "uv.log"}\n'),
        (tool, "#!/bin/sh\nprintf 'pid %s' $$; printf ' [%s]' \"$@\"; echo\n"),
    ):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    for path in (root / "bin" / "mg-demo", uv, tool):
        path.chmod(0o755)

    def start() -> tuple[int, str]:
        process = subprocess.Popen(
            [str(root / "bin" / "mg-demo"), "a b", "c"], stdout=subprocess.PIPE, text=True
        )
        out, _ = process.communicate(timeout=30)
        return process.pid, out

    def syncs() -> int:
        log = tmp_path / "uv.log"
        return len(log.read_text().splitlines()) if log.exists() else 0

    pid, out = start()
    assert out == f"pid {pid} [a b] [c]\n"  # the tool itself, with the arguments as given
    assert syncs() == 1
    start()
    assert syncs() == 1
    later = time.time() + 5
    os.utime(root / "uv.lock", (later, later))
    start()
    assert syncs() == 2


def test_kill_9_of_just_stops_a_multi_step_recipe_and_its_tool(corpus, tmp_path):
    """A recipe of several steps (the demo's form): its shell re-execs itself to die with
    just, and each step's tool (bin/, MG_DIE_WITH_PARENT) dies with the shell."""
    just = shutil.which("just", path=TOOLS_PATH)
    if just is None or shutil.which("setpriv") is None:
        pytest.skip("needs just and util-linux's setpriv")
    out = tmp_path / "out"
    out.mkdir()
    prefix = out / "corpus"
    marker = tmp_path / "after"
    recipe = "\n".join(
        [
            "steps *args:",
            "    #!/usr/bin/env bash",
            "    set -euo pipefail",
            '    if [ -z "${MG_DIE_WITH_PARENT:-}" ]; then',
            "        export MG_DIE_WITH_PARENT=1",
            '        exec setpriv --pdeathsig KILL -- bash "$0" "$@"',
            "    fi",
            f"    {ROOT / 'bin' / 'mg-prep'} {{{{args}}}}",
            f"    touch {marker}",
            "",
        ]
    )
    justfile = tmp_path / "justfile"
    justfile.write_text(recipe)
    process = subprocess.Popen(
        [just, "--justfile", str(justfile), "steps", *_tokenize_argv(corpus, prefix)],
        env=dict(os.environ, PATH=TOOLS_PATH),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(_started_writing(out), 120, "the recipe's mg-prep to start writing")
    finally:
        _kill_and_check_gone(process, str(prefix))
    time.sleep(2)  # a surviving shell would go on to the next step
    assert _published(prefix) == [] and not marker.exists()
