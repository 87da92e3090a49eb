"""Synthetic pictures of one coloured shape each, captioned with its colour and shape.

    python workflows/vlm_shapes/make_shapes.py --output-dir shapes --split train \
        --count 2000 --seed 1

writes OUTPUT_DIR/SPLIT/images/00000.png, ... and OUTPUT_DIR/SPLIT/data.jsonl, one
LLaVA-style record a line, the image path relative to the JSONL's folder (what
`mg-prep vlm` reads by default):

    {"image": "images/00000.png", "color": "red", "shape": "circle",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is in the image?"},
                       {"from": "gpt", "value": "A red circle."}]}

and OUTPUT_DIR/SPLIT/text.jsonl, the same conversations without their images as
loose JSON documents (`{"text": "What is in the image?\\nA red circle."}`): what a
tokenizer and a text-only model are trained on.

Each picture is a light background (a random near-white tint) with one shape in one
of COLORS (each channel jittered a little) at a random size and place, drawn with
Pillow. The (colour, shape) pairs cycle through every combination in a shuffled
order, so a split of k x len(COLORS) x len(SHAPES) pictures holds each pair exactly
k times: a model that gives one answer for every picture scores exactly chance
(1 / pairs). The same seed gives the same bytes; different seeds give different
pictures, which is how the train and held-out splits differ.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 0),
    "purple": (140, 40, 180),
}
SHAPES = ("circle", "square", "triangle", "cross")
QUESTION = "What is in the image?"
IMAGE_TAG = "<image>"


def caption(color: str, shape: str) -> str:
    return f"A {color} {shape}."


def shape_points(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """The outline of a polygonal shape of half-width `r` centred at (cx, cy)."""
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":  # pointing up, filling its box
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "cross":  # a plus sign, arms a third of its width
        a = r / 3
        return [
            (cx - a, cy - r), (cx + a, cy - r), (cx + a, cy - a), (cx + r, cy - a),
            (cx + r, cy + a), (cx + a, cy + a), (cx + a, cy + r), (cx - a, cy + r),
            (cx - a, cy + a), (cx - r, cy + a), (cx - r, cy - a), (cx - a, cy - a),
        ]  # fmt: skip
    raise ValueError(f"unknown shape {shape!r}")


def draw(color: str, shape: str, size: int, rng: random.Random):
    """One picture: `size` x `size` pixels, RGB."""
    from PIL import Image, ImageDraw  # lazy: --help without Pillow

    tint = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), tint)
    fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLORS[color])
    r = rng.uniform(0.22, 0.4) * size  # half-width: the shape spans 44-80% of the picture
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        pen.polygon(shape_points(shape, cx, cy, r), fill=fill)
    return image


def pairs_in_order(count: int, rng: random.Random) -> list[tuple[str, str]]:
    """`count` (colour, shape) pairs: every pair once per round, each round shuffled."""
    every = [(c, s) for c in COLORS for s in SHAPES]
    out: list[tuple[str, str]] = []
    while len(out) < count:
        round_ = list(every)
        rng.shuffle(round_)
        out += round_
    return out[:count]


def record(image: str, color: str, shape: str) -> dict:
    return {
        "image": image,
        "color": color,
        "shape": shape,
        "conversations": [
            {"from": "human", "value": f"{IMAGE_TAG}\n{QUESTION}"},
            {"from": "gpt", "value": caption(color, shape)},
        ],
    }


def text_only(color: str, shape: str) -> dict:
    """The conversation as one document, no image: the text-only model's sample."""
    return {"text": f"{QUESTION}\n{caption(color, shape)}"}


def make_split(folder: Path, count: int, seed: int, size: int) -> Path:
    """`count` pictures, their data.jsonl and text.jsonl in `folder`; returns data.jsonl."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    records, texts = [], []
    for i, (color, shape) in enumerate(pairs_in_order(count, rng)):
        name = f"images/{i:05d}.png"
        draw(color, shape, size, rng).save(folder / name, format="PNG")
        records.append(json.dumps(record(name, color, shape)))
        texts.append(json.dumps(text_only(color, shape)))
    (folder / "text.jsonl").write_text("\n".join(texts) + "\n")
    path = folder / "data.jsonl"
    path.write_text("\n".join(records) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--split", required=True, help="the folder's name: train, heldout, ...")
    parser.add_argument("--count", type=int, required=True, help="pictures to draw")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--size", type=int, default=32, help="picture side in pixels")
    args = parser.parse_args()
    if args.count < 1 or args.size < 8:
        parser.exit(2, "make_shapes.py: --count must be at least 1 and --size at least 8\n")
    path = make_split(args.output_dir / args.split, args.count, args.seed, args.size)
    print(f"wrote {args.count} pictures of {args.size}x{args.size} pixels and {path}")


if __name__ == "__main__":
    main()
