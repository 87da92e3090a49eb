"""`python3 mgw demo` (workflows/demo/run_demo.py): its wiring checked without running it
(each command parsed by its own tool's parser, each file read only after a step writes
it), and the whole demo run short (2 finetuning iterations) as a slow test."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "workflows" / "demo"


def _load_demo():
    spec = importlib.util.spec_from_file_location("run_demo", DEMO / "run_demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_demo"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _parse(argv: list[str]):
    """The tool's own argparse parser on the step's arguments (SystemExit on a bad flag)."""
    name, args = Path(argv[0]).name, argv[1:]
    if name == "mg-convert":
        from mg.ckpt_convert.cli import build_parser
    elif name == "mg-prep":
        from mg.corpus_prep.cli import build_parser
    elif name == "mg-eval":
        from mg.evaluate.cli import build_parser
    elif name == "mg-serve":
        from mg.generate_server.cli import build_parser
    elif name == "mg-quantize":
        from mg.quantize_export.cli import build_parser
    elif name == "mg-train":
        from mg.trainer.arguments.parser import build_parser
    else:
        raise AssertionError(f"unknown tool {name}")
    return build_parser().parse_args(args)


# flags naming a file or folder a step reads, and those naming what it writes
READS = ("--load", "--data-path", "--input", "--tokenizer-model")
WRITES = ("--save", "--output", "--output-prefix", "--report")


def _flag_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in flags]


def test_every_command_parses_and_reads_only_what_an_earlier_one_wrote(tmp_path):
    demo = _load_demo()
    gguf = tmp_path / "model.gguf"
    steps = demo.plan(demo.Settings(tmp_path / "out", gguf))
    written = {str(gguf)}
    phases = []
    for step in steps:
        if Path(step.argv[0]).parent == ROOT / "bin":
            assert (ROOT / "bin" / Path(step.argv[0]).name).exists()
            _parse(step.argv)
        else:
            assert Path(step.argv[1]).parent == DEMO and Path(step.argv[1]).exists()
        for path in _flag_values(step.argv, READS):
            assert any(
                path == w or path.startswith(w + "_") or path.startswith(w + "/") for w in written
            ), f"{path} is read before a step writes it"
        written.update(_flag_values(step.argv, WRITES))
        phases.append(step.phase)
    assert steps[2].argv[1:3] == ["import-gguf", str(gguf)]
    # the order the README tells: import, evaluate, serve, finetune, evaluate, quantize, ...
    assert [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]] == [
        "data",
        "import",
        "data",
        "evaluate",
        "serve",
        "finetune",
        "evaluate",
        "quantize",
        "evaluate",
        "serve",
    ]
    loads = [_flag_values(s.argv, ("--load",))[0] for s in steps if s.phase == "serve"]
    assert loads == [str(tmp_path / "out" / "smollm2"), str(tmp_path / "out" / "smollm2-sft-int8")]


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            str(DEMO / "run_demo.py"),
            "--output-dir",
            str(out),
            "--dry-run",
            "--gguf",
            str(tmp_path / "model.gguf"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 12 and not out.exists()
    assert re.search(r"bin/mg-train gpt --sft .* --train-iters 20 ", lines[7])


def test_justfile_demo_runs_the_driver_and_demo_scratch_keeps_the_old_demo():
    justfile = (ROOT / "justfile").read_text()
    demo = justfile.split("\ndemo *args: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "workflows/demo/run_demo.py" in demo
    scratch = justfile.split("\ndemo-scratch: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "mg-train gpt --config workflows/configs/gpt-tiny.yaml" in scratch


@pytest.mark.slow
@pytest.mark.timeout(2400)  # minutes on two quiet cores; a loaded machine is slower
def test_the_demo_run_short_answers_paris(tmp_path):
    """The demo with 2 finetuning iterations and 1 evaluation batch: SmolLM2 answers
    before and after (greedy), and the three perplexities are close to each other."""
    pytest.importorskip("gguf")
    from mg.core.fixtures import FixtureError, fixture_path

    try:
        fixture_path("smollm2-gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    except FixtureError as exc:
        pytest.skip(f"fixture smollm2-gguf cannot be fetched: {exc}")
    out = tmp_path / "out"
    subprocess.run(
        [
            sys.executable,
            str(DEMO / "run_demo.py"),
            "--output-dir",
            str(out),
            "--train-iters",
            "2",
            "--eval-iters",
            "1",
        ],
        check=True,
        timeout=1800,
    )
    ppl = [
        json.loads((out / f"ppl_{n}.jsonl").read_text())["metrics"]["ppl"]
        for n in ("base", "sft", "int8")
    ]
    # the imported model on Botchan's first 4 x 256 tokens; 2 steps at lr 1e-5 and int8
    # weights move it by little
    assert 20 < ppl[0] < 80
    assert abs(ppl[1] / ppl[0] - 1) < 0.05 and abs(ppl[2] / ppl[1] - 1) < 0.05
    for name in ("answers_base.json", "answers_sft_int8.json"):
        answers = json.loads((out / name).read_text())
        assert answers[0]["question"] == "What is the capital of France?"
        assert "Paris" in answers[0]["answer"]
    summary = (out / "summary.md").read_text()
    assert f"imported {ppl[0]:.2f} → finetuned {ppl[1]:.2f} → int8 {ppl[2]:.2f}" in summary
