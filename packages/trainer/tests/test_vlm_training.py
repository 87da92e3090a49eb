"""`mg-train vlm`: a tiny LLaVA trains on mock image-text data; frozen towers stay
byte-identical with no gradients and no optimizer state; the first loss is the
model's own text-only loss on the first batch; flags that cannot apply are refused
by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.families import collate, get_family
from mg.trainer.training import Trainer

VLM = [
    "vlm",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--seq-length",
    "5",
    "--decoder-seq-length",
    "16",
    "--max-position-embeddings",
    "64",
    "--img-h",
    "28",
    "--img-w",
    "28",
    "--patch-dim",
    "14",
    "--vision-num-layers",
    "2",
    "--vision-hidden-size",
    "16",
    "--vision-num-attention-heads",
    "2",
    "--vision-ffn-hidden-size",
    "32",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-2",
    "--log-interval",
    "1000",
    "--eval-iters",
    "0",
    "--seed",
    "1234",
]


def _trainer(tmp_path: Path, *extra: str, iters: int = 4) -> Trainer:
    argv = [*VLM, "--train-iters", str(iters), "--data-cache-path", str(tmp_path), *extra]
    return Trainer(parse_args(argv))


def _snapshot(module: torch.nn.Module) -> dict[str, bytes]:
    return {n: p.detach().numpy().tobytes() for n, p in module.named_parameters()}


def test_frozen_towers_are_byte_identical_and_have_no_optimizer_state(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "--freeze-LM", "--freeze-ViT")
    model = trainer.model
    before = {
        tower: _snapshot(getattr(model, tower))
        for tower in ("language_model", "vision_model", "vision_projection")
    }
    result = trainer.train()
    assert len(result.losses) == 4
    for tower in ("language_model", "vision_model"):
        assert _snapshot(getattr(model, tower)) == before[tower], tower
        assert all(p.grad is None for p in getattr(model, tower).parameters()), tower
    after = _snapshot(model.vision_projection)
    assert all(after[n] != before["vision_projection"][n] for n in after if "weight" in n)
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    projector = {id(p) for p in model.vision_projection.parameters()}
    assert trained == projector
    assert {id(p) for p in trainer.optimizer.state} <= projector
    assert len(trainer.optimizer.state) == 4  # two linears' weights and biases


def test_first_loss_is_the_models_text_loss_on_the_first_batch(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, iters=1)
    args = trainer.args
    dataset = get_family("vlm").build_datasets(args, trainer.tokenizer, [4, 0, 0])[0]
    batch = collate([dataset[i] for i in range(2)], torch.device("cpu"))
    batch2 = collate([dataset[i] for i in range(2, 4)], torch.device("cpu"))
    with torch.no_grad():
        terms = [get_family("vlm").loss_terms(trainer.model, b) for b in (batch, batch2)]
    expected = sum(t[0] for t in terms) / sum(t[1] for t in terms)
    # text rows only: 12 text tokens per sample, the one before the image rows has no loss
    assert terms[0][1].item() == 2 * (16 - 5)
    result = trainer.train()
    assert result.losses[0] == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--tokenizer-prompt-format", "llama3"], "--tokenizer-prompt-format llama3: Megatron"),
        (["--vision-model-type", "siglip", "--disable-vision-class-token"], "SigLIP"),
        (["--projector-type", "affine"], "--projector-type affine"),
        (["--allow-missing-vision-projection-checkpoint"], "only with --pretrained-checkpoint"),
        (["--context-parallel-size", "2"], "context parallelism"),
        (
            ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--freeze-LM"],
            "--use-distributed-optimizer with --pipeline-model-parallel-size",
        ),
    ],
)
def test_vlm_flags_refused_by_name(extra: list[str], says: str) -> None:
    with pytest.raises(ArgumentError, match=says):
        parse_args([*VLM, "--train-iters", "1", *extra], world_size=2)


def test_vlm_needs_its_lengths() -> None:
    argv = [*VLM, "--train-iters", "1"]
    wrong = list(argv)
    wrong[wrong.index("--seq-length") + 1] = "4"
    with pytest.raises(ArgumentError, match="--seq-length 4: .* gives 5 tokens"):
        parse_args(wrong)
    no_decoder = [
        a
        for i, a in enumerate(argv)
        if a != "--decoder-seq-length" and argv[i - 1] != "--decoder-seq-length"
    ]
    with pytest.raises(ArgumentError, match="needs --decoder-seq-length"):
        parse_args(no_decoder)


def test_vision_flags_refused_for_other_families() -> None:
    gpt = ["gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    gpt += ["--seq-length", "16", "--mock-data", "--train-iters", "1", "--lr", "1e-3"]
    gpt += ["--micro-batch-size", "1", "--global-batch-size", "1", "--vocab-size", "100"]
    with pytest.raises(ArgumentError, match="--freeze-LM is a vision-language flag"):
        parse_args([*gpt, "--freeze-LM"])


def test_resume_from_a_torch_checkpoint_continues_bitwise(tmp_path: Path) -> None:
    """2 iterations, saved (`--ckpt-format torch`), then 2 more from the checkpoint: the
    same losses as 4 in one run, with the vision tower frozen throughout."""
    save = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck")]
    save += ["--save-interval", "2", "--ckpt-format", "torch", "--freeze-ViT"]
    straight = _trainer(tmp_path / "a", "--freeze-ViT").train().losses
    first = _trainer(tmp_path / "b", *save, "--exit-interval", "2").train().losses
    second = _trainer(tmp_path / "b", *save).train().losses
    assert first + second == straight
