"""Weight-only int8 and int4 models (mg-quantize's int8_wo and int4 modules) in the fp32
step as one C++ call (`vector_decode`), on AVX-512 and AVX2 (each forced through
`MG_CPU_ISA` where the CPU has it): the kernel reads the quantized weights and makes the
eager modules' dequantized values in registers, so its logits are the op-by-op quantized
model's up to the order of the sums (1e-5, as the fp32 step's), its greedy tokens the
same; a sequence's numbers are bitwise the same whatever else its steps hold; the step is
chosen and logged in one line."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from mg.core.models import GPTModel, presets
from mg.core.models.paged_kv_cache import PagedSegment
from mg.core.quantization import primitives as P
from mg.core.quantization.apply import set_submodule
from mg.core.quantization.linear import (
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
)
from mg.core.testing.paged_steps import (
    PROMPT_LENGTHS,
    TABLES,
    assert_logits_do_not_depend_on_the_batch,
    assert_prompt_chunks_do_not_change_logits,
    prefill_and_decode,
)
from mg.generate_server import cpu_isa
from mg.generate_server.runner import ModelRunner
from mg.generate_server.vector_decode import VectorDecode, vector_decode_unsupported

RECIPES = {
    # recipe: (the layers' kind, int4 group size, asymmetric, the output layer quantized)
    "int8": ("int8", 0, False, False),
    "int8-output": ("int8", 0, False, True),
    "int4-g32": ("int4", 32, False, False),
    "int4-g16-asym-output": ("int4", 16, True, True),
}


def _quantized(linear: nn.Linear, kind: str, group: int, asymmetric: bool) -> nn.Module:
    if kind == "int8":
        return Int8WeightOnlyLinear.from_linear(linear)
    q, scale, zero = P.quantize_int4(linear.weight.detach(), group, symmetric=not asymmetric)
    return Int4WeightOnlyLinear.from_quantized(linear, q, scale, zero)


def _model(recipe: str, **overrides) -> GPTModel:
    """tiny_llama with its linears quantized as mg-quantize's modules hold them."""
    kind, group, asymmetric, output = RECIPES[recipe]
    torch.manual_seed(0)
    config = presets.tiny_llama(hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    model = GPTModel(config).eval()
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and (output or name != "output_layer")
    ]
    for name in names:
        set_submodule(model, name, _quantized(model.get_submodule(name), kind, group, asymmetric))
    return model.eval()


def _runner(model: GPTModel, fused: bool, slots: int = 3, max_length: int = 32) -> ModelRunner:
    runner = ModelRunner(model, num_slots=slots, max_length=max_length, block_size=4)
    runner.choose_decode_attention()
    if fused:
        assert runner.use_fused_decode() is None
        assert isinstance(runner.fused_decode, VectorDecode)
    return runner


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@torch.inference_mode()
def test_quantized_steps_equal_the_op_by_op_runner(isa: str, recipe: str) -> None:
    model = _model(recipe)
    runners = [_runner(model, False), _runner(model, True)]
    kind = RECIPES[recipe][0]
    assert runners[1].fused_decode.description == f"{isa} fp32, {kind} weights"
    assert runners[1].fused_decode._vocab == 128  # the output layer in the step too
    steps = [prefill_and_decode(runner) for runner in runners]
    for out, runner in zip(steps, runners, strict=True):
        # one row alone: the eager int8 / int4 modules take torch's weight-only kernels
        position = PROMPT_LENGTHS[0] + 4
        out.append(runner.forward([PagedSegment(0, 1, position, TABLES[0])], [3], [position], [0]))
    assert runners[1].fused_decode.steps == 6
    for want, got in zip(*steps, strict=True):
        # the eager model's dequantized weights exactly; fp32 sums in another order
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(runners[1].cache.keys, runners[0].cache.keys, atol=1e-5, rtol=0)


@pytest.mark.parametrize("recipe", ["int8", "int4-g16-asym-output"])
@torch.inference_mode()
def test_a_sequences_logits_do_not_depend_on_what_else_is_batched(isa: str, recipe: str) -> None:
    """Sequence 0's prompt and decodes, alone and then among 1-8 others at every place in
    the step (others' prompts included): its logits bitwise equal each time."""
    model = _model(recipe)
    places = ((1, 1), (3, 0), (8, 8))
    assert_logits_do_not_depend_on_the_batch(lambda: _runner(model, True, slots=9), places)


@pytest.mark.parametrize("recipe", ["int8", "int4-g32"])
def test_greedy_tokens_equal_the_op_by_op_engines(isa: str, recipe: str) -> None:
    from mg.generate_server.batch import generate_batch
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.sampling import SamplingParams

    model = _model(recipe)
    torch.manual_seed(3)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (5, 9, 2)]
    params = SamplingParams(max_new_tokens=12, greedy=True)
    tokens = []
    for fused in (False, True):
        runner = _runner(model, fused)
        engine = GenerationEngine(runner, lambda ids: "", 128)
        try:
            tokens.append([r.tokens for r in generate_batch(engine, prompts, params)])
        finally:
            engine.shutdown()
        if fused:
            assert runner.fused_decode.steps == engine.stats.steps
    assert tokens[0] == tokens[1] and all(len(t) == 12 for t in tokens[1])


@pytest.mark.skipif(cpu_isa.available() == "none", reason="this CPU has neither AVX2 nor AVX-512")
def test_mg_serve_logs_the_int8_step_in_one_line(monkeypatch, caplog) -> None:
    from mg.generate_server.cli import _pack_and_fuse

    monkeypatch.setenv(cpu_isa.ENVIRONMENT, "avx2")
    runner = ModelRunner(_model("int8"), num_slots=1, max_length=16, block_size=4)
    with caplog.at_level(logging.INFO, logger="mg.generate_server"):
        _pack_and_fuse(runner)
    assert "decode steps fused: avx2 fp32, int8 weights" in caplog.messages


def test_quantized_models_it_cannot_run_say_why() -> None:
    def why(model: GPTModel) -> str | None:
        return vector_decode_unsupported(model, ModelRunner(model, 1, 16).cache)

    if cpu_isa.available() == "none":
        pytest.skip("this CPU has neither AVX2 nor AVX-512")
    assert why(_model("int8")) is None and why(_model("int4-g32")) is None
    model = _model("int8")
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    model.decoder.layers[0].self_attention.linear_qkv = Int8DynamicLinear.from_linear(
        nn.Linear(qkv.in_features, qkv.out_features, bias=False)
    )
    assert why(model).startswith("its linears are not fp32, int8_wo or int4")
    assert why(_model("int8", add_bias_linear=True)) == "its linears are not bias-free"


@torch.inference_mode()
def test_int4_layers_whose_weights_went_to_torchs_kernel_layout() -> None:
    """An int4 module that ran torch's CPU kernel holds only that kernel's tiles (its
    `qweight` dropped): the step packs the checkpoint's layout again from them."""
    model = _model("int4-g32")
    reference = _runner(model, True)
    want = reference.forward([PagedSegment(0, 5, 0, [0, 1])], [1, 2, 3, 4, 5], range(5), [4])
    for layer in model.decoder.layers:
        for linear in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1):
            linear(torch.randn(1, linear.in_features))  # one row: torch's int4 kernel
            if linear.qweight is not None:
                pytest.skip("this torch's int4 tiles are not read back: qweight kept")
    runner = _runner(model, True)
    got = runner.forward([PagedSegment(0, 5, 0, [0, 1])], [1, 2, 3, 4, 5], range(5), [4])
    assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", ["int8_wo", "int4_wo"])
def test_mg_quantize_checkpoints_served_take_the_step(
    isa: str, recipe: str, tmp_path, caplog
) -> None:
    """An mg-quantize checkpoint loaded as mg-serve loads it: the step chosen and logged in
    one line, greedy tokens those of the op-by-op engine."""
    quantize = pytest.importorskip("mg.quantize_export.cli").main
    from mg.core.testing.serving_checkpoints import save_decisive_model
    from mg.generate_server.batch import generate_batch
    from mg.generate_server.cli import _pack_and_fuse
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.loading import load_for_serving
    from mg.generate_server.sampling import SamplingParams

    source = save_decisive_model(tmp_path, name="float", ffn_hidden_size=128)
    extra = ["--group-size", "32"] if recipe == "int4_wo" else []
    save = tmp_path / recipe
    quantize(["--load", str(source), "--save", str(save), "--recipe", recipe, *extra])
    model = load_for_serving(save).model
    prompts = [[5, 900, 31], [7] * 9, [40000, 2]]
    params = SamplingParams(max_new_tokens=8, greedy=True)
    tokens = []
    for fused in (False, True):
        runner = ModelRunner(model, num_slots=3, max_length=32, block_size=4)
        if fused:
            with caplog.at_level(logging.INFO, logger="mg.generate_server"):
                _pack_and_fuse(runner)
            kind = recipe.removesuffix("_wo")
            assert f"decode steps fused: {isa} fp32, {kind} weights" in caplog.messages
        engine = GenerationEngine(runner, lambda ids: "", 50257)
        try:
            tokens.append([r.tokens for r in generate_batch(engine, prompts, params)])
        finally:
            engine.shutdown()
    assert tokens[0] == tokens[1] and all(len(t) == 8 for t in tokens[1])


@pytest.mark.parametrize("recipe", ["int8", "int4-g16-asym-output"])
@torch.inference_mode()
def test_a_long_prompt_in_one_step_equals_it_in_short_steps(isa: str, recipe: str) -> None:
    """60 rows take the GEMM form (weights made floats once a block), 5 rows the dot-product
    form: the same numbers."""
    model = _model(recipe)
    assert_prompt_chunks_do_not_change_logits(lambda: _runner(model, True, 1, max_length=64))
