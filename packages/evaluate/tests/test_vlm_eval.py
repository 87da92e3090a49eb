"""`mg-eval captioning` and `mg-eval vqa` end to end on a tiny random LLaVA checkpoint:
both run and write their files; batching does not change a greedy answer; prompts are
the training data's; forced right answers score 100%; bad records fail in one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import mg_metadata, save_checkpoint
from mg.core.models import TransformerConfig
from mg.core.models.vision import LLaVAConfig, LLaVAModel, VisionConfig
from mg.core.models.vision.image_processing import ImageTransform
from mg.evaluate import vlm_tasks
from mg.evaluate.caption_metrics import cider_d
from mg.evaluate.cli import main
from mg.evaluate.vlm_generation import answer_ids, prompt_ids
from mg.evaluate.vlm_loading import load_vlm_for_eval
from mg.evaluate.vlm_samples import read_records

CAPTIONS = [
    "a red square on a white background",
    "a green circle in the middle of the picture",
    "a blue triangle near the top left corner",
    "a yellow square and a small black dot",
]
COLOURS = [(220, 30, 30), (30, 200, 40), (30, 40, 220), (230, 220, 20)]
VQA = [
    {"question": "What colour is the shape?", "answers": ["red", "red", "Red", "crimson"]},
    {"question": "How many shapes are there?", "answer": "two"},
    {"question": "Which shape is it?", "choices": ["circle", "square", "star"], "answer": "A"},
    {"question": "Is it blue?", "choices": ["yes", "no"], "answer": 0},
]


def _tiny_llava() -> LLaVAModel:
    language = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50304, seq_length=48,
        max_position_embeddings=48, position_embedding_type="rope", normalization="RMSNorm",
        activation="swiglu", add_bias_linear=False,
    )  # fmt: skip
    vision = VisionConfig(
        vision_model_type="clip", num_layers=1, hidden_size=16, num_attention_heads=2,
        ffn_hidden_size=32, img_h=28, img_w=28, patch_dim=14,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LLaVAModel(LLaVAConfig(language, vision))
    model.init_weights()
    return model.eval()


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory, tokenizer_config) -> Path:
    """The state `mg-train vlm` saves: model, mg metadata (LLaVAConfig), the run's args."""
    model = _tiny_llava()
    folder = tmp_path_factory.mktemp("vlm") / "ckpt"
    state = {
        "model": model.state_dict(),
        "iteration": 3,
        "mg": mg_metadata(dict(model.config), tokenizer_config.to_dict()),
        "args": argparse.Namespace(tokenizer_prompt_format="raw"),
    }
    save_checkpoint(folder, 3, state)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("vlmdata")
    (folder / "images").mkdir()
    for i, colour in enumerate(COLOURS):  # not square, not 28 px: resize and crop apply
        Image.new("RGB", (40 + 7 * i, 33), colour).save(folder / "images" / f"{i}.png")
    (folder / "images" / "bad.png").write_bytes(b"not a png")
    with (folder / "captions.jsonl").open("w") as f:
        for i, caption in enumerate(CAPTIONS):
            f.write(json.dumps({"image": f"images/{i}.png", "text": caption}) + "\n")
    with (folder / "vqa.jsonl").open("w") as f:
        for i, record in enumerate(VQA):
            f.write(json.dumps({"image": f"images/{i}.png", **record}) + "\n")
    return folder


def _run(task: str, ckpt: Path, data_file: Path, out: Path, *extra: str) -> int:
    return main([task, "--load", str(ckpt), "--valid-data", str(data_file), "--output-path",
                 str(out), "--out-seq-length", "4", *extra])  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_captioning_and_vqa_write_their_files(vlm_checkpoint, data, tmp_path, capsys) -> None:
    report = tmp_path / "report.jsonl"
    assert _run("captioning", vlm_checkpoint, data / "captions.jsonl", tmp_path / "cap.jsonl",
                "--report", str(report)) == 0  # fmt: skip
    assert "CIDEr" in capsys.readouterr().out
    rows = _lines(tmp_path / "cap.jsonl")
    assert [r["references"] for r in rows] == [[c] for c in CAPTIONS]
    assert all(isinstance(r["caption"], str) and "cider" in r for r in rows)
    assert _run("vqa", vlm_checkpoint, data / "vqa.jsonl", tmp_path / "vqa.jsonl",
                "--report", str(report)) == 0  # fmt: skip
    rows = _lines(tmp_path / "vqa.jsonl")
    assert [r["gt_answer"] for r in rows] == [VQA[0]["answers"], ["two"], ["circle"], ["yes"]]
    assert len(rows[2]["choice_logprobs"]) == 3 and rows[2]["answer"] in VQA[2]["choices"]
    records = _lines(report)
    assert [r["task"] for r in records] == ["captioning", "vqa"]
    m = records[1]["metrics"]
    assert m["short_answer_examples"] == 2 and m["multiple_choice_examples"] == 2
    assert records[0]["metrics"]["num_examples"] == 4 and records[0]["iteration"] == 3


def test_batching_does_not_change_greedy_answers(vlm_checkpoint, data, tmp_path) -> None:
    for batch in ("1", "3"):
        assert _run("captioning", vlm_checkpoint, data / "captions.jsonl",
                    tmp_path / f"cap{batch}.jsonl", "--micro-batch-size", batch) == 0  # fmt: skip
        assert _run("vqa", vlm_checkpoint, data / "vqa.jsonl", tmp_path / f"vqa{batch}.jsonl",
                    "--micro-batch-size", batch) == 0  # fmt: skip
    assert _lines(tmp_path / "cap1.jsonl") == _lines(tmp_path / "cap3.jsonl")
    one, three = _lines(tmp_path / "vqa1.jsonl"), _lines(tmp_path / "vqa3.jsonl")
    assert [r["answer"] for r in one] == [r["answer"] for r in three]
    for a, b in zip(one[2:], three[2:], strict=True):
        assert a["choice_logprobs"] == pytest.approx(b["choice_logprobs"], abs=1e-4)


def test_images_and_prompts_are_the_training_datas(vlm_checkpoint, data, tokenizer) -> None:
    vlm = load_vlm_for_eval(vlm_checkpoint)
    assert vlm.transform == ImageTransform.for_vision_model("clip", 28, 28)
    assert vlm.prompt_format == "raw"
    render = pytest.importorskip("mg.trainer.vlm_data").render
    image_id = vlm.config.image_token_index
    for fmt in ("raw", "chatml", "mistral"):
        for record in read_records(data / "vqa.jsonl", "vqa", None)[:2]:
            answer = record.references[0]
            full, _ = render([*record.turns, {"from": "gpt", "value": answer}], tokenizer, fmt,
                             image_id)  # fmt: skip
            prompt = prompt_ids(record.turns, tokenizer, fmt, image_id)
            assert full[: len(prompt)] == prompt
            cont = answer_ids(answer, tokenizer, fmt)
            assert full[len(prompt) : len(prompt) + len(cont)] == cont


def test_forced_right_answers_score_full_marks(
    vlm_checkpoint, data, tmp_path, tokenizer, monkeypatch
) -> None:
    """Generation returning the reference, and a likelihood preferring the right choice."""

    def generate(vlm, records, batch, max_new_tokens):
        return [r.references[0] for r in records]

    right = {tuple(tokenizer.tokenize(r["choices"][i])) for r, i in ((VQA[2], 0), (VQA[3], 0))}

    def logprobs(model, images, prompts, continuations, pad):
        return [0.0 if tuple(c) in right else -5.0 for c in continuations]

    monkeypatch.setattr(vlm_tasks, "generate_answers", generate)
    monkeypatch.setattr(vlm_tasks, "continuation_logprobs", logprobs)
    report = tmp_path / "r.jsonl"
    cap_file, vqa_file = data / "captions.jsonl", data / "vqa.jsonl"
    assert _run("captioning", vlm_checkpoint, cap_file, tmp_path / "c.jsonl", "--report",
                str(report)) == 0  # fmt: skip
    assert _run("vqa", vlm_checkpoint, vqa_file, tmp_path / "v.jsonl", "--report",
                str(report)) == 0  # fmt: skip
    cap, vqa = (r["metrics"] for r in _lines(report))
    assert cap["bleu4"] == pytest.approx(1.0)
    assert cap["cider"] == pytest.approx(cider_d(CAPTIONS, [[c] for c in CAPTIONS])[0])
    assert vqa["accuracy"] == 1.0
    assert vqa["short_answer_accuracy"] == 1.0 and vqa["multiple_choice_accuracy"] == 1.0


@pytest.mark.parametrize(
    ("task", "record", "says"),
    [
        ("captioning", {"image": "images/9.png", "text": "x"}, "image: no such file"),
        ("captioning", {"text": "a cat"}, 'no "image" field'),
        ("captioning", {"image": "images/bad.png", "text": "x"}, "not an image Pillow can read"),
        ("captioning", {"image": "images/0.png"}, '"text" or "caption" field'),
        ("vqa", {"image": "images/0.png", "answer": "red"}, 'no "question" field'),
        ("vqa", {"image": "images/0.png", "question": "q?"}, '"answers"'),
        (
            "vqa",
            {"image": "images/0.png", "question": "q?", "choices": ["a", "b"], "answer": "E"},
            "answer: 'E' is not one of the choices",
        ),  # fmt: skip
    ],
)
def test_bad_records_are_named_by_line_and_field(
    vlm_checkpoint, data, tmp_path, capsys, task, record, says
) -> None:
    bad = data / f"bad-{tmp_path.name}.jsonl"
    good = {"image": "images/1.png", "text": "a cat", "question": "q?", "answer": "a"}
    bad.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    assert _run(task, vlm_checkpoint, bad, tmp_path / "o.jsonl") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"mg-eval {task}: error: {bad}:2: ") and says in err


def test_a_gpt_checkpoint_is_refused_by_name(data, tmp_path, tokenizer_config, capsys) -> None:
    from eval_data import save_gpt

    from mg.core.models import GPTModel

    gpt = GPTModel(_tiny_llava().config.language)
    save_gpt(tmp_path / "gpt", gpt, tokenizer_config)
    assert _run("vqa", tmp_path / "gpt", data / "vqa.jsonl", tmp_path / "o.jsonl") == 2
    assert "not a vision-language checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_a_trained_torch_dist_checkpoint_loads_with_its_weights_and_prompt_format(
    tmp_path, tokenizer_config, data
) -> None:
    """What `mg-train vlm` saves (torch_dist, Megatron-Core's stacked keys, its args)
    loads as the trained model, and captioning runs on it."""
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    argv = ["vlm", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--seq-length", "5", "--decoder-seq-length", "48",
            "--max-position-embeddings", "64", "--img-h", "28", "--img-w", "28",
            "--patch-dim", "14", "--vision-num-layers", "1", "--vision-hidden-size", "16",
            "--vision-num-attention-heads", "2", "--vision-ffn-hidden-size", "32",
            "--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", tokenizer_config.vocab_file, "--merge-file",
            tokenizer_config.merge_file, "--micro-batch-size", "2", "--global-batch-size", "2",
            "--lr", "1e-2", "--train-iters", "2", "--eval-iters", "0",
            "--tokenizer-prompt-format", "mistral", "--save", str(tmp_path / "ck"),
            "--save-interval", "2", "--data-cache-path", str(tmp_path)]  # fmt: skip
    trainer = Trainer(parse_args(argv))
    trainer.train()
    trained = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    vlm = load_vlm_for_eval(tmp_path / "ck")
    assert vlm.prompt_format == "mistral" and vlm.iteration == 2
    loaded = vlm.model.state_dict()
    assert sorted(loaded) == sorted(k for k in trained if not k.endswith("_extra_state"))
    for name, tensor in loaded.items():
        assert torch.equal(tensor.cpu(), trained[name].float().cpu()), name
    out = tmp_path / "cap.jsonl"
    assert _run("captioning", tmp_path / "ck", data / "captions.jsonl", out) == 0
    assert len(_lines(out)) == len(CAPTIONS)


def test_an_mg_prep_folder_gives_the_same_captions(vlm_checkpoint, data, tmp_path) -> None:
    """`mg-prep vlm` shards of the same records (--eval-split test): the same prompts and
    pixels (PNG kept lossless), hence the same captions and scores."""
    prep = pytest.importorskip("mg.corpus_prep.cli")
    prepared = tmp_path / "prepped"
    argv = ["vlm", "--input", str(data / "captions.jsonl"), "--output", str(prepared)]
    with pytest.raises(SystemExit) as done:  # mg-prep exits with its status
        prep.main([*argv, "--split", "0,0,1"])
    assert done.value.code in (0, None)
    assert _run("captioning", vlm_checkpoint, prepared, tmp_path / "shards.jsonl") == 0
    assert _run("captioning", vlm_checkpoint, data / "captions.jsonl", tmp_path / "j.jsonl") == 0
    shards, lines = _lines(tmp_path / "shards.jsonl"), _lines(tmp_path / "j.jsonl")
    by_ref = {r["references"][0]: r["caption"] for r in lines}
    assert sorted(r["references"][0] for r in shards) == sorted(CAPTIONS)
    assert all(by_ref[r["references"][0]] == r["caption"] for r in shards)
