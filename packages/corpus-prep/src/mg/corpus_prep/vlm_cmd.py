"""`mg-prep vlm`'s work: records → checked images → tar shards → energon's `.nv-meta/`.

The dataset is built in a folder beside `--output` and renamed into place at the
end, so an interrupted run leaves no half-written dataset behind.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mg.core.models.vision.image_processing import BadImageError, open_rgb
from mg.corpus_prep.commands import UserError

IMAGE_TAG = "<image>"
SUBFLAVOR = "llava_conversation"
SHARD_PATTERN = "data-{:06d}.tar"
DATASET_YAML = (
    "__module__: megatron.energon\n"
    "__class__: CrudeWebdataset\n"
    "subflavors:\n"
    f"  format: {SUBFLAVOR}\n"
)


@dataclass
class Record:
    """One usable sample: where it came from, its image file and its conversation."""

    where: str
    image: Path
    conversations: list[dict[str, str]]


def read_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(`file:line` or `file[i]`, record) of a JSON array or a JSONL file."""
    with path.open(encoding="utf-8") as stream:
        head = stream.read(1024).lstrip()
        stream.seek(0)
        if head.startswith("["):
            try:
                records = json.load(stream)
            except json.JSONDecodeError as err:
                raise UserError(f"--input {path}: not valid JSON ({err})") from None
            for i, record in enumerate(records):
                yield f"{path}[{i}]", record
            return
        for number, line in enumerate(stream, start=1):
            if line.strip():
                try:
                    yield f"{path}:{number}", json.loads(line)
                except json.JSONDecodeError as err:
                    yield f"{path}:{number}", err


def conversation_of(record: Any) -> list[dict[str, str]]:
    """The record's turns, LLaVA's `{"from", "value"}`; a caption becomes `<image>` →
    caption. Raises ValueError naming the field that is wrong."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("conversations: not a non-empty list")
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise ValueError('conversations: each turn needs {"from", "value"}')
            if turn.get("from") not in ("human", "gpt", "system"):
                raise ValueError(f"conversations: unknown speaker {turn.get('from')!r}")
        turns = [{"from": t["from"], "value": t["value"]} for t in turns]
    else:
        text = record.get("text", record.get("caption"))
        if not isinstance(text, str) or not text.strip():
            raise ValueError('no "conversations", "text" or "caption" field')
        turns = [{"from": "human", "value": IMAGE_TAG}, {"from": "gpt", "value": text}]
    tags = sum(t["value"].count(IMAGE_TAG) for t in turns)
    if tags > 1:
        raise ValueError(f"{tags} {IMAGE_TAG} tags for one image")
    if tags == 0:  # LLaVA puts the image before the first question
        first = next(i for i, t in enumerate(turns) if t["from"] != "system")
        turns[first] = {**turns[first], "value": f"{IMAGE_TAG}\n{turns[first]['value']}"}
    return turns


def image_bytes(path: Path, max_pixels: int) -> tuple[str, bytes]:
    """(extension, bytes) to store: a JPEG file as it is, anything else as PNG (lossless).
    Raises BadImageError naming the file."""
    image = open_rgb(path, max_pixels=max_pixels)
    if image.format == "JPEG" or path.suffix.lower() in (".jpg", ".jpeg"):
        with path.open("rb") as stream:
            return "jpg", stream.read()
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "png", buffer.getvalue()


def split_weights(text: str) -> list[tuple[str, float]]:
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
        raise UserError(f"--split {text}: give three non-negative weights, train,val,test")
    return list(zip(("train", "val", "test"), weights, strict=True))


def run(args: argparse.Namespace) -> int:
    import webdataset  # lazy: only this subcommand writes tar shards
    from megatron.energon.flavors.webdataset.prepare import (  # lazy: heavy, energon only here
        WebdatasetPreparator,
    )

    inputs = [Path(p) for p in args.input]
    for path in inputs:
        if not path.is_file():
            raise UserError(f"--input {path}: file not found")
    if args.shard_size < 1:
        raise UserError(f"--shard-size {args.shard_size}: must be at least 1")
    split = split_weights(args.split)
    output = Path(args.output)
    if output.exists() and any(output.iterdir()):
        raise UserError(f"--output {output}: exists and is not empty; give a new folder")
    output.parent.mkdir(parents=True, exist_ok=True)
    image_root = Path(args.image_folder) if args.image_folder else None

    skipped: Counter[str] = Counter()
    kept = 0
    shards: list[str] = []
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}-") as tmp:
        work = Path(tmp)
        writer = None
        for path in inputs:
            root = image_root or path.parent
            for where, record in read_records(path):
                try:
                    if isinstance(record, Exception):
                        raise ValueError(f"not valid JSON ({record})")
                    if not isinstance(record, dict) or not record.get("image"):
                        raise ValueError('no "image" field')
                    turns = conversation_of(record)
                except ValueError as err:
                    print(f"mg-prep vlm: skipped {where}: {err}", file=sys.stderr)
                    skipped["bad record"] += 1
                    continue
                image_path = root / str(record["image"])
                try:
                    ext, data = image_bytes(image_path, args.max_image_pixels)
                except BadImageError as err:
                    print(f"mg-prep vlm: skipped {where}: {err}", file=sys.stderr)
                    skipped["bad image"] += 1
                    continue
                if writer is None or kept % args.shard_size == 0:
                    if writer is not None:
                        writer.close()
                    shards.append(SHARD_PATTERN.format(len(shards)))
                    writer = webdataset.TarWriter(str(work / shards[-1]))
                sample = {"conversations": turns, "image": str(record["image"])}
                writer.write({"__key__": f"{kept:09d}", ext: data, "json": sample})
                kept += 1
        if writer is not None:
            writer.close()
        if not kept:
            raise UserError(
                f"no usable samples in {', '.join(map(str, inputs))} "
                f"({sum(skipped.values())} skipped; see the lines above)"
            )
        with contextlib.redirect_stdout(io.StringIO()):  # energon prints its temp paths
            WebdatasetPreparator.prepare_dataset(
                work, shards, split_parts_ratio=split, workers=1, shuffle_seed=None
            )
        (work / ".nv-meta" / "dataset.yaml").write_text(DATASET_YAML)
        if output.exists():
            output.rmdir()  # empty: checked above
        shutil.move(str(work), str(output))
        Path(tmp).mkdir()  # for TemporaryDirectory's cleanup
    print(
        f"mg-prep vlm: {kept} samples in {len(shards)} shards in {output}; skipped "
        f"{skipped['bad image']} bad images and {skipped['bad record']} bad records"
    )
    return 0
