"""`mg-prep vlm`: LLaVA-style records to energon WebDataset shards, bad input skipped by
name, and energon reading the result back."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_dir
from mg.corpus_prep.cli import main


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    out, err = capsys.readouterr()
    return stop.value.code, out, err


@pytest.fixture
def records(tmp_path: Path) -> Path:
    """Three good records (a PNG caption, a JPEG conversation, a greyscale PNG) and one of
    each bad kind, as a JSONL file beside its images."""
    images = fixture_dir("skimage-images")
    folder = tmp_path / "raw"
    folder.mkdir()
    for name in ("astronaut.png", "rocket.jpg", "camera.png", "logo.png", "chelsea.png"):
        shutil.copy(images / name, folder / name)
    whole = (folder / "chelsea.png").read_bytes()
    (folder / "truncated.png").write_bytes(whole[: len(whole) // 3])
    (folder / "notes.jpg").write_text("not an image\n")
    from PIL import Image

    Image.new("CMYK", (16, 16)).save(folder / "cmyk.jpg")
    Image.new("I;16", (16, 16)).save(folder / "deep.png")
    lines = [
        {"id": "a", "image": "astronaut.png", "text": "an astronaut in a white suit"},
        {
            "id": "r",
            "image": "rocket.jpg",
            "conversations": [
                {"from": "human", "value": "What is shown?\n<image>"},
                {"from": "gpt", "value": "A rocket on its launch pad."},
            ],
        },
        {"image": "camera.png", "caption": "a man with a camera"},
        {"image": "logo.png", "text": "alpha"},
        {"image": "truncated.png", "text": "truncated"},
        {"image": "notes.jpg", "text": "text file"},
        {"image": "cmyk.jpg", "text": "cmyk"},
        {"image": "deep.png", "text": "16-bit"},
        {"image": "missing.png", "text": "missing"},
        {"image": "chelsea.png", "text": "<image> and <image>"},
        {"text": "no image"},
    ]
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{broken\n")
    return path


@pytest.mark.slow  # torch, Pillow and energon imports: ~40 s on a loaded 2-CPU box
def test_vlm_writes_shards_and_names_what_it_skips(records: Path, tmp_path: Path, capsys):
    out = tmp_path / "dataset"
    code, stdout, stderr = _run(
        ["vlm", "--input", str(records), "--output", str(out), "--shard-size", "2"], capsys
    )
    assert code == 0, stderr
    assert "3 samples in 2 shards" in stdout
    assert "skipped 6 bad images and 3 bad records" in stdout
    for name, why in [
        ("logo.png", "alpha channel"),
        ("truncated.png", "cannot be decoded"),
        ("notes.jpg", "not an image"),
        ("cmyk.jpg", "CMYK"),
        ("deep.png", "16/32-bit"),
        ("missing.png", "no such file"),
    ]:
        assert any(name in line and why in line for line in stderr.splitlines()), name
    assert "pairs.jsonl:10: 3 <image> tags" in stderr  # the caption's two and the prompt's
    assert 'pairs.jsonl:11: no "image" field' in stderr
    assert "pairs.jsonl:12: not valid JSON" in stderr

    assert sorted(p.name for p in out.glob("*.tar")) == ["data-000000.tar", "data-000001.tar"]
    meta = out / ".nv-meta"
    assert {"dataset.yaml", "split.yaml", "index.sqlite", ".info.json"} <= {
        p.name for p in meta.iterdir()
    }
    assert "CrudeWebdataset" in (meta / "dataset.yaml").read_text()
    info = json.loads((meta / ".info.json").read_text())
    assert sum(info["shard_counts"].values()) == 3

    with tarfile.open(out / "data-000000.tar") as tar:
        names = tar.getnames()
        assert sorted(names) == [
            "000000000.json",
            "000000000.png",
            "000000001.jpg",
            "000000001.json",
        ]
        jpeg = tar.extractfile("000000001.jpg").read()
        sample = json.loads(tar.extractfile("000000000.json").read())
    assert jpeg == (records.parent / "rocket.jpg").read_bytes()  # a JPEG is kept as it is
    assert sample["conversations"] == [
        {"from": "human", "value": "<image>"},
        {"from": "gpt", "value": "an astronaut in a white suit"},
    ]
    with tarfile.open(out / "data-000001.tar") as tar:
        png = tar.extractfile("000000002.png").read()
        turns = json.loads(tar.extractfile("000000002.json").read())["conversations"]
    from PIL import Image

    grey = Image.open(records.parent / "camera.png").convert("RGB")
    stored = Image.open(io.BytesIO(png))
    assert stored.mode == "RGB" and stored.tobytes() == grey.tobytes()  # lossless
    assert turns[0]["value"] == "<image>" and turns[1]["value"] == "a man with a camera"


@pytest.mark.slow
def test_energon_reads_the_dataset(records: Path, tmp_path: Path, capsys) -> None:
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        WorkerConfig,
        basic_sample_keys,
        get_loader,
        get_train_dataset,
        stateless,
    )

    out = tmp_path / "dataset"
    assert _run(["vlm", "--input", str(records), "--output", str(out)], capsys)[0] == 0

    @stateless
    def cook(sample: dict) -> dict:
        image = sample["jpg"] if "jpg" in sample else sample["png"]
        return {**basic_sample_keys(sample), "image": image, "json": sample["json"]}

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

    dataset = get_train_dataset(
        str(out),
        batch_size=None,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        task_encoder=Encoder(),
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
    )
    seen = {s["__key__"]: s for s in get_loader(dataset)}
    assert sorted(seen) == ["000000000", "000000001", "000000002"]
    assert tuple(seen["000000001"]["image"].shape) == (3, 427, 640)  # rocket.jpg, RGB
    assert seen["000000001"]["json"]["conversations"][0]["value"] == "What is shown?\n<image>"


@pytest.mark.slow
def test_vlm_refuses_a_dataset_with_nothing_usable(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"image": "missing.png", "text": "x"}) + "\n")
    code, _, stderr = _run(["vlm", "--input", str(path), "--output", str(tmp_path / "o")], capsys)
    assert code == 2
    assert "mg-prep vlm: error: no usable samples" in stderr
    assert not (tmp_path / "o").exists()


def test_vlm_help_imports_nothing_heavy() -> None:
    probe = (
        "import sys\nfrom mg.corpus_prep.cli import main\n"
        "try:\n    main(['vlm', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'PIL', 'webdataset', 'megatron.energon') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--max-image-pixels" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"
