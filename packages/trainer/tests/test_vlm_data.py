"""`mg-train vlm --data-path DIR`: samples read from WebDataset shards in mg-prep vlm's
layout (energon's .nv-meta/split.yaml), rendered and preprocessed exactly, and trained on."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest

from mg.core.fixtures import fixture_path, gpt2_bpe_tokenizer_config
from mg.core.models.vision.image_processing import ImageTransform, load_image
from mg.core.tokenizers import build_tokenizer
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.training import Trainer
from mg.trainer.vlm_data import render

CAPTIONS = {
    "astronaut.png": "An astronaut in a white suit stands before a flag.",
    "rocket.jpg": "A rocket on its launch pad.",
    "chelsea.png": "A tabby cat looks to the side.",
}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """Three photographs with captions, as mg-prep vlm writes them."""
    folder = tmp_path / "vlm"
    (folder / ".nv-meta").mkdir(parents=True)
    with tarfile.open(folder / "data-000000.tar", "w") as tar:
        for i, (name, caption) in enumerate(CAPTIONS.items()):
            ext = "jpg" if name.endswith(".jpg") else "png"
            _add(tar, f"{i:09d}.{ext}", fixture_path("skimage-images", name).read_bytes())
            turns = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": caption}]
            _add(tar, f"{i:09d}.json", json.dumps({"conversations": turns}).encode())
    split = "split_parts:\n  train:\n  - data-000000.tar\n  val: []\n  test: []\n"
    (folder / ".nv-meta" / "split.yaml").write_text(split)
    return folder


def _argv(folder: Path, *extra: str) -> list[str]:
    tok = gpt2_bpe_tokenizer_config()
    return [
        "vlm",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--decoder-seq-length", "40", "--max-position-embeddings", "64",
        "--img-h", "56", "--img-w", "56", "--patch-dim", "14",
        "--vision-num-layers", "1", "--vision-hidden-size", "16",
        "--vision-num-attention-heads", "2", "--vision-ffn-hidden-size", "32",
        "--disable-vision-class-token", "--freeze-LM",
        "--data-path", str(folder), "--split", "100,0,0",
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", tok.vocab_file, "--merge-file", tok.merge_file,
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3",
        "--lr", "1e-3", "--log-interval", "1000", "--eval-iters", "0", "--seed", "7",
        *extra,
    ]  # fmt: skip


def test_samples_are_the_rendered_captions_and_preprocessed_images(shards: Path) -> None:
    trainer = Trainer(parse_args(_argv(shards)))
    dataset = trainer.family.build_datasets(trainer.args, trainer.tokenizer, [6, 0, 0])[0]
    tok = build_tokenizer(gpt2_bpe_tokenizer_config())
    text_length = 40 - 16 + 1  # with the 16 image rows: the language model's 40
    seen = set()
    for index in range(6):
        ref = dataset.sample_ref(index)
        name = list(CAPTIONS)[int(ref.key)]
        seen.add(name)
        item = dataset[index]
        ids = [-200, *tok.tokenize("\n"), *tok.tokenize(CAPTIONS[name]), tok.eod]
        padded = ids + [tok.eod] * (text_length + 1 - len(ids))
        assert item["tokens"].tolist() == padded[:-1]
        assert item["labels"].tolist() == padded[1:]
        # the loss: the caption and its end token (not the newline after the image)
        assert item["loss_mask"].tolist() == [0.0] + [1.0] * (len(ids) - 2) + [0.0] * (
            text_length - len(ids) + 1
        )
        expected = load_image(fixture_path("skimage-images", name), ImageTransform.clip(56))
        assert np.array_equal(item["images"], expected.numpy())
    assert seen == set(CAPTIONS)  # two passes, each over all three samples
    losses = trainer.train().losses
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_chatml_rendering_puts_the_loss_on_the_answer() -> None:
    tok = build_tokenizer(gpt2_bpe_tokenizer_config())
    turns = [
        {"from": "human", "value": "What is this?\n<image>"},
        {"from": "gpt", "value": "A cat."},
    ]
    ids, mask = render(turns, tok, "chatml", -200)
    prompt = tok.tokenize("<|im_start|>user\n") + tok.tokenize("What is this?\n")
    answer = tok.tokenize("A cat.<|im_end|>")
    expected = [*prompt, -200, *tok.tokenize("<|im_end|>"), *tok.tokenize("\n")]
    expected += tok.tokenize("<|im_start|>assistant\n") + answer + tok.tokenize("\n")
    assert ids == expected
    assert [t for t, m in zip(ids, mask, strict=True) if m] == answer


def test_mistral_rendering_is_megatrons_template_with_the_loss_on_the_answer() -> None:
    """`[INST] {text}[/INST] {answer}</s>` (Megatron's mistral_custom_template)."""
    tok = build_tokenizer(gpt2_bpe_tokenizer_config())
    turns = [
        {"from": "human", "value": "<image>\nWhat is this?"},
        {"from": "gpt", "value": "A cat."},
    ]
    ids, mask = render(turns, tok, "mistral", -200)
    answer = [*tok.tokenize(" A cat."), tok.eod]
    expected = [*tok.tokenize("[INST] "), -200, *tok.tokenize("\nWhat is this?[/INST]"), *answer]
    assert ids == expected
    assert [t for t, m in zip(ids, mask, strict=True) if m] == answer


def test_a_folder_without_energon_metadata_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="reads one folder made by mg-prep vlm"):
        parse_args(_argv(tmp_path))
