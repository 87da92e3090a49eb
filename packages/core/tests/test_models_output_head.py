"""A model's output head: chosen by a step, run by `output_and_loss`, held by no state.

Every language model holds an `OutputHead` (mg.core.models.output_head); the steps
that need another output (the fused loss, a quantized output layer, tensor
parallelism) choose one instead of patching `output_and_loss` on the instance, and
a pipeline stage takes the whole model's head.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from mg.core.models import BertModel, GPTModel, TransformerConfig, presets
from mg.core.models.fused_cross_entropy import FusedCrossEntropyHead, apply_cross_entropy_fusion
from mg.core.models.mamba import MambaModel, tiny_hybrid
from mg.core.models.output_head import OutputHead, OutputModuleHead
from mg.core.models.vocab_mask import set_real_vocab_size
from mg.core.parallel.pipeline import split_model

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
LABELS = IDS.roll(-1, 1)


def _gpt(**overrides) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(presets.tiny_llama(vocab_size=128, **overrides))


@pytest.mark.parametrize("build", [_gpt, lambda: MambaModel(tiny_hybrid())], ids=["gpt", "mamba"])
def test_a_chosen_head_adds_no_state_and_patches_nothing(build) -> None:
    model = build()
    names, modules = list(model.state_dict()), [n for n, _ in model.named_modules()]
    assert type(model.output_head) is OutputHead
    apply_cross_entropy_fusion(model)
    assert isinstance(model.output_head, FusedCrossEntropyHead)
    assert list(model.state_dict()) == names
    assert [n for n, _ in model.named_modules()] == modules
    assert "output_and_loss" not in vars(model)


def test_the_fused_head_is_refused_over_another_head_and_for_bert() -> None:
    model = _gpt(untie_embeddings_and_output_weights=True)
    model.output_head = OutputModuleHead()
    with pytest.raises(ValueError, match="already OutputModuleHead"):
        apply_cross_entropy_fusion(model)
    bert = BertModel(
        TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
            seq_length=16, max_position_embeddings=16,
            position_embedding_type="learned_absolute",
        )
    )  # fmt: skip
    with pytest.raises(TypeError, match="not BertModel"):
        apply_cross_entropy_fusion(bert)


@pytest.mark.parametrize("tied", [True, False])
def test_the_last_pipeline_stage_runs_the_whole_models_head(tied: bool) -> None:
    """A chunk cut after the fused loss was chosen gives the whole model's loss (the
    tied last stage on its own copy of the embedding)."""
    model = apply_cross_entropy_fusion(_gpt(untie_embeddings_and_output_weights=not tied))
    set_real_vocab_size(model, 100)
    first, last = (split_model(model, stage, 2)[0] for stage in range(2))
    assert last.output_head is model.output_head
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        want = model(IDS, labels=LABELS)
        got = last(first(IDS, positions), positions, labels=LABELS)
        logits = last(first(IDS, positions), positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isinf(logits[..., 100:]).all() and torch.isfinite(logits[..., :100]).all()


def test_a_head_of_another_matmul_keeps_the_padding_mask_and_the_loss() -> None:
    """What a serving engine's packed output layer does: its own `logits_from`, the
    padding rows masked and the loss computed as the plain head does."""

    class SameMatmulElsewhere(OutputHead):
        def __init__(self, weight: Tensor) -> None:
            self.weight = weight

        def logits_from(self, model, hidden: Tensor) -> Tensor:
            return hidden @ self.weight.t()

    model = _gpt()
    set_real_vocab_size(model, 100)
    hidden = torch.randn(2, 16, model.config.hidden_size)
    with torch.no_grad():
        want = [model.output_and_loss(hidden, labels) for labels in (None, LABELS)]
        model.output_head = SameMatmulElsewhere(model.output_weight().detach().clone())
        got = [model.output_and_loss(hidden, labels) for labels in (None, LABELS)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
