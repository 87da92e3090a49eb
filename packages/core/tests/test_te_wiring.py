"""apply_transformer_engine and FP8 wired to Transformer Engine's API, checked on CPU against a
stand-in `transformer_engine` package (plain PyTorch modules with TE's constructor arguments,
parameter names and `_extra_state`): after the swap the state-dict names are exactly Megatron's
TE-spec names, the weights and outputs are kept, and the FP8 recipe and contexts are built as
megatron.core.fp8_utils builds them. The GPU tests in test_te_spec.py run the real package."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from pathlib import Path

import pytest
import torch

from mg.core.models import GPTModel
from mg.core.models.te_spec import FP8Options, apply_transformer_engine, fp8_autocast, fp8_recipe
from mg.core.testing import te_standin
from mg.core.testing.megatron_reference import TINY_SHAPES, tiny_config


@pytest.fixture
def fake_te(monkeypatch):
    return te_standin.install(monkeypatch)


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_wiring_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _te_config(shape: str):
    return dataclasses.replace(tiny_config(shape), transformer_impl="transformer_engine")


# the TE-spec layer names read from megatron-core's spec (test_te_spec.py's walk), before
# the stand-in package is installed (megatron.core asks the real one its version)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
    pytest.importorskip("megatron.core")
_walk = _sibling("test_te_spec.py")._megatron_te_layer_names
MEGATRON_TE_NAMES = {shape: _walk(_te_config(shape)) for shape in TINY_SHAPES}


@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
def test_swap_gives_megatron_te_names_and_keeps_outputs(fake_te, shape) -> None:
    config = _te_config(shape)
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    ids = torch.randint(0, 128, (2, 16))
    before = model(ids)
    names_before = set(model.state_dict())
    config.attention_backend = "fused"  # TE's kernel choice, through its NVTE_* switches
    apply_transformer_engine(model)
    after = model.state_dict()
    theirs = MEGATRON_TE_NAMES[shape]
    for i in range(config.num_layers):
        layer = {k.split(".", 3)[3] for k in after if k.startswith(f"decoder.layers.{i}.")}
        assert layer == theirs  # every TE-spec name, _extra_state included, nothing else
    assert {k for k in after if not k.endswith("_extra_state")} == names_before
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    attention = model.decoder.layers[0].self_attention.core_attention
    assert attention.kwargs["qkv_format"] == "bshd" and attention.kwargs["layer_number"] == 1
    assert attention.kwargs["softmax_scale"] == 1 / math.sqrt(config.kv_channels)
    import os

    assert (os.environ["NVTE_FLASH_ATTN"], os.environ["NVTE_FUSED_ATTN"]) == ("0", "1")


def test_fp8_recipes_as_megatron_builds_them(fake_te) -> None:
    delayed = fp8_recipe(
        FP8Options(
            format="hybrid", margin=1, amax_history_len=1024, amax_compute_algo="max", wgrad=False
        )
    )
    assert delayed.kind == "DelayedScaling"
    assert delayed.kwargs == dict(
        margin=1,
        fp8_format="HYBRID",
        amax_history_len=1024,
        amax_compute_algo="max",
        override_linear_precision=(False, False, True),
    )
    for recipe, kind in (
        ("tensorwise", "Float8CurrentScaling"),
        ("blockwise", "Float8BlockScaling"),
        ("mxfp8", "MXFP8BlockScaling"),
    ):
        built = fp8_recipe(FP8Options(format="e4m3", recipe=recipe))
        assert (built.kind, built.kwargs) == (kind, {"fp8_format": "E4M3"})


def test_fp8_forward_bf16_layers_and_fp8_weights(fake_te) -> None:
    config = dataclasses.replace(tiny_config("llama", 4), transformer_impl="transformer_engine")
    model = GPTModel(config).eval()
    options = FP8Options(param=True, bf16_layers=(0, 3))
    apply_transformer_engine(model, options)
    assert fake_te.built and all(fp8_weights for _, fp8_weights in fake_te.built)
    with fp8_autocast(options):
        model(torch.randint(0, 128, (1, 8)))
    enabled = [on for on, _ in fake_te.autocasts]
    assert enabled == [True, False, False]  # the whole forward, then layers 1 and 4 without
    assert fake_te.autocasts[0][1].kind == "DelayedScaling"
