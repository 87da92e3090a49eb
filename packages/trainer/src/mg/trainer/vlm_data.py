"""`mg-train vlm --data-path DIR`: the WebDataset shards `mg-prep vlm` writes, as
training samples.

    DIR/.nv-meta/split.yaml   energon's split: the shards of train / val / test
    DIR/data-000000.tar       KEY.jpg|KEY.png (the image) + KEY.json ({"conversations"})

A split's samples are indexed once (each tar's members: offsets and sizes), then read
by index as Megatron's GPT dataset is: sample i of a run is sample i mod n of a
permutation drawn from --seed for each pass over the data. An image is decoded and
preprocessed as its tower expects (`ImageTransform.for_vision_model`); the
conversation is rendered by `--tokenizer-prompt-format`:

    raw     each human turn's text and a newline, then each answer followed by the
            end-of-document token; the image token where the text says `<image>`
    chatml  <|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n{answer}<|im_end|>\\n
    mistral [INST] {text}[/INST] {answer}</s> (Megatron's template; the tokenizer's own
            beginning-of-text token, where it adds one)

The loss is on the answers only (their closing token included). Samples are cut or
padded (no loss) to the text length that, with the image rows, fills
--decoder-seq-length.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mg.core import energon_split
from mg.core.models.vision import LLaVAConfig
from mg.core.models.vision.image_processing import ImageTransform, open_rgb, preprocess

IMAGE_TAG = "<image>"
SPLITS = {"train": 0, "val": 1, "test": 2}


class VLMDataError(ValueError):
    """A dataset folder or sample that cannot be used; the message names it."""


@dataclass(frozen=True)
class SampleRef:
    """Where one sample's parts lie in its tar: (offset, size) of the image and the JSON."""

    shard: Path
    key: str
    image: tuple[int, int]
    text: tuple[int, int]


def split_shards(folder: Path, split: str) -> list[Path]:
    """The shards energon's split.yaml gives `split`."""
    shards = energon_split.split_shards(folder, split)
    if shards is None:
        raise VLMDataError(
            f"--data-path {folder}: no .nv-meta/split.yaml; make the dataset with mg-prep vlm"
        )
    return shards


def index_shard(shard: Path) -> list[SampleRef]:
    """The samples of one tar, in order: each key's image and JSON member."""
    members: dict[str, dict[str, tuple[int, int]]] = {}
    with tarfile.open(shard) as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            members.setdefault(key, {})[ext] = (member.offset_data, member.size)
    refs = []
    for key, parts in members.items():
        image = parts.get("jpg") or parts.get("png")
        if image is None or "json" not in parts:
            raise VLMDataError(f"{shard}: sample {key} has no image or no .json part")
        refs.append(SampleRef(shard, key, image, parts["json"]))
    return refs


def read_part(shard: Path, where: tuple[int, int]) -> bytes:
    with shard.open("rb") as stream:
        stream.seek(where[0])
        return stream.read(where[1])


def render(turns: list[dict[str, str]], tokenizer: Any, prompt_format: str, image_id: int):
    """(ids, loss mask) of a conversation: the image token at `<image>`, loss on answers."""
    ids: list[int] = []
    mask: list[int] = []

    def add(text: str, loss: bool) -> None:
        for i, piece in enumerate(text.split(IMAGE_TAG)):
            if i:
                ids.append(image_id)
                mask.append(0)
            if piece:
                tokens = tokenizer.tokenize(piece)
                ids.extend(tokens)
                mask.extend([int(loss)] * len(tokens))

    for turn in turns:
        answer = turn["from"] == "gpt"
        if prompt_format == "chatml":
            role = {"human": "user", "gpt": "assistant"}.get(turn["from"], turn["from"])
            add(f"<|im_start|>{role}\n", False)
            add(turn["value"] + "<|im_end|>", answer)
            add("\n", False)
        elif prompt_format == "mistral":  # Megatron's mistral_custom_template, as text
            if answer:
                add(" " + turn["value"], True)
                ids.append(tokenizer.eod)
                mask.append(1)
            else:
                add(f"[INST] {turn['value']}[/INST]", False)
        elif answer:
            add(turn["value"], True)
            ids.append(tokenizer.eod)
            mask.append(1)
        else:  # the newline gives the answer's first token a position to be learnt from:
            add(turn["value"] + "\n", False)  # image rows carry no loss (Megatron's)
    return ids, mask


class VLMShardDataset:
    """One split of an `mg-prep vlm` dataset, `size` samples long (passes repeat, each
    in its own order)."""

    def __init__(
        self,
        folder: str | Path,
        split: str,
        size: int,
        config: LLaVAConfig,
        tokenizer: Any,
        prompt_format: str,
        seed: int,
    ) -> None:
        self.folder = Path(folder)
        self.refs = [
            ref for shard in split_shards(self.folder, split) for ref in index_shard(shard)
        ]
        self.size = size if self.refs else 0
        self.config, self.tokenizer, self.prompt_format = config, tokenizer, prompt_format
        self.seed = seed + SPLITS[split]
        v = config.vision
        self.transform = ImageTransform.for_vision_model(v.vision_model_type, v.img_h, v.img_w)
        self.text_length = config.language.seq_length - config.image_tokens + 1
        pad = getattr(tokenizer, "pad", None)
        self.pad = tokenizer.eod if pad is None or pad < 0 else pad

    def __len__(self) -> int:
        return self.size

    def sample_ref(self, index: int) -> SampleRef:
        n = len(self.refs)
        order = np.random.default_rng([self.seed, index // n]).permutation(n)
        return self.refs[int(order[index % n])]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        ref = self.sample_ref(index)
        where = f"{ref.shard}:{ref.key}"
        image = open_rgb(io.BytesIO(read_part(ref.shard, ref.image)), name=where)
        turns = json.loads(read_part(ref.shard, ref.text))["conversations"]
        image_id = self.config.image_token_index
        ids, mask = render(turns, self.tokenizer, self.prompt_format, image_id)
        length = self.text_length + 1  # inputs and their next tokens
        ids, mask = ids[:length], mask[:length]
        if ids.count(image_id) != 1 or ids[-1] == image_id:
            raise VLMDataError(
                f"{where}: the image token does not fit in --decoder-seq-length "
                f"({self.config.language.seq_length}) before the text that follows it"
            )
        short = length - len(ids)
        ids = np.array(ids + [self.pad] * short, dtype=np.int64)
        mask = np.array(mask + [0] * short, dtype=np.float32)
        return {
            "images": preprocess(image, self.transform).numpy(),
            "tokens": ids[:-1],
            "labels": ids[1:],
            "loss_mask": mask[1:],
            "position_ids": np.arange(self.config.language.seq_length),  # text and image rows
        }
