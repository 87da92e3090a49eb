"""`just vlm-shapes` (workflows/vlm_shapes): the pictures are the same for the same seed
and have the record layout `mg-prep vlm` reads, answers are scored by name, every
command parses with its own tool's parser and reads only what an earlier one wrote,
and the whole workflow runs at smoke-test size (`--quick`, slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "workflows" / "vlm_shapes"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_same_seed_same_bytes_and_the_records_mg_prep_reads(tmp_path: Path) -> None:
    shapes = _load("make_shapes")
    pairs = len(shapes.COLORS) * len(shapes.SHAPES)
    a = shapes.make_split(tmp_path / "a", 2 * pairs, seed=7, size=32)
    shapes.make_split(tmp_path / "b", 2 * pairs, seed=7, size=32)
    shapes.make_split(tmp_path / "c", 2 * pairs, seed=8, size=32)
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    assert _tree(tmp_path / "a")["images/00000.png"] != _tree(tmp_path / "c")["images/00000.png"]

    records = [json.loads(line) for line in a.read_text().splitlines()]
    assert Counter((r["color"], r["shape"]) for r in records) == {
        (c, s): 2 for c in shapes.COLORS for s in shapes.SHAPES
    }  # every pair equally often: one answer for all scores exactly chance
    lines = (a.parent / "text.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    for record, text in zip(records, texts, strict=True):
        human, answer = record["conversations"]
        assert human == {"from": "human", "value": "<image>\nWhat is in the image?"}
        assert answer == {"from": "gpt", "value": f"A {record['color']} {record['shape']}."}
        assert text == "What is in the image?\n" + answer["value"]
        image = a.parent / record["image"]
        assert image.is_file() and image.parent.name == "images"

    from PIL import Image

    with Image.open(a.parent / records[0]["image"]) as image:
        assert (image.format, image.mode, image.size) == ("PNG", "RGB", (32, 32))


def test_an_answer_is_right_when_it_names_both_and_nothing_else() -> None:
    run = _load("run_vlm_shapes")
    assert run.is_right("A red circle.", "red", "circle")
    assert run.is_right("a Red CIRCLE", "red", "circle")
    assert not run.is_right("A red square.", "red", "circle")
    assert not run.is_right("A blue circle.", "red", "circle")
    assert not run.is_right("A red circle or a red square.", "red", "circle")
    assert not run.is_right("A red blue circle.", "red", "circle")
    assert not run.is_right("", "red", "circle")


def _parse(argv: list[str]) -> None:
    """The tool's own argparse parser on the step's arguments (SystemExit on a bad flag)."""
    name, args = Path(argv[0]).name, argv[1:]
    if name == "mg-prep":
        from mg.corpus_prep.cli import build_parser
    elif name == "mg-serve":
        from mg.generate_server.cli import build_parser
    elif name == "mg-train":
        from mg.trainer.arguments.parser import build_parser
    else:
        raise AssertionError(f"unknown tool {name}")
    build_parser().parse_args(args)


READS = ("--load", "--data-path", "--input", "--vocab-file", "--merge-file")
WRITES = ("--save", "--output", "--output-prefix", "--output-dir")


def test_every_command_parses_and_reads_only_what_an_earlier_one_wrote(tmp_path: Path) -> None:
    run = _load("run_vlm_shapes")
    for settings in (run.Settings(tmp_path), run.Settings.quick(tmp_path)):
        written: set[str] = set()
        for step in run.plan(settings):
            if Path(step.argv[0]).parent == ROOT / "bin":
                assert (ROOT / "bin" / Path(step.argv[0]).name).exists()
                _parse(step.argv)
            else:
                assert Path(step.argv[1]).is_file()
            values = dict(zip(step.argv[:-1], step.argv[1:], strict=True))
            for flag in READS:
                path = values.get(flag)
                if path is not None:
                    assert any(path.startswith(w) for w in written), f"{path} read before written"
            written.update(values[f] for f in WRITES if f in values)
        assert [s.ask for s in run.plan(settings) if s.ask] == ["vlm", "text"]
    image_tokens = (32 // 4) ** 2 + 1
    assert run.Settings(tmp_path).image_tokens == image_tokens


@pytest.mark.slow  # six tools' start-ups and two servers: minutes on a loaded 2-CPU box
def test_the_quick_workflow_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(HERE / "run_vlm_shapes.py"), "--output-dir", str(out), "--quick"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for which in ("vlm", "text"):
        answers = [json.loads(line) for line in (out / f"answers_{which}.jsonl").open()]
        assert len(answers) == 20
        assert all(isinstance(a["answer"], str) and isinstance(a["right"], bool) for a in answers)
    summary = (out / "summary.md").read_text()
    assert "| chance (1 / 20 pairs) | 5.0% |" in summary
    assert "VLM (`mg-train vlm`, the picture given)" in summary
    assert "== 9. [serve]" in done.stdout and "-- 9. [serve]" in done.stdout
