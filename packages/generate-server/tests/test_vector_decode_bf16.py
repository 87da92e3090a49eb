"""A bf16 model (bf16 weights, activations and KV cache) in the step as one C++ call
(`vector_decode`), on AVX-512 and AVX2 (each forced through `MG_CPU_ISA` where the CPU has
it): the op-by-op bf16 runner's logits up to a few bf16 steps and its greedy tokens,
int8/int4 linears in such a model too; a sequence's numbers bitwise the same whatever
else its steps hold; the runner chooses it for a bf16 cache where AMX does not run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mg.core.models import GPTModel, presets
from mg.core.quantization import primitives as P
from mg.core.quantization.apply import set_submodule
from mg.core.quantization.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from mg.core.testing.paged_steps import (
    LLAMA_SHAPES,
    assert_logits_do_not_depend_on_the_batch,
    assert_prompt_chunks_do_not_change_logits,
    bf16_rounding_model,
    prefill_and_decode,
)
from mg.generate_server.amx_matmul import amx_matmul
from mg.generate_server.fused_decode import FusedDecode
from mg.generate_server.packed_linears import pack_linears, packing_available
from mg.generate_server.runner import ModelRunner
from mg.generate_server.vector_decode import VectorDecode, vector_decode_unsupported

BF16_TOLERANCE = {"atol": 2**-6, "rtol": 2**-6}
"""Both runners round every op's output to bf16 (steps of 2^-8 to 2^-7 of the value), but
sum in other orders (the step's matmuls and attention, oneDNN's and SDPA's): a value can
round to the neighbouring bf16 number, and later ops carry that. The logits here (|x| < 1)
differ by one or two bf16 steps (~2e-3); 2^-6 leaves room, and is far below what a
missed rounding or an fp32 step would differ by over two layers."""


def _model(quantized: str | None = None, **overrides) -> GPTModel:
    """tiny_llama in bf16; `quantized` ("int8", "int4"): its linears (the output layer
    too) mg-quantize's modules first, as a quantized checkpoint loaded in bf16 holds them."""
    torch.manual_seed(0)
    config = presets.tiny_llama(hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    model = GPTModel(config).eval()
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or quantized is None:
            continue
        if quantized == "int8":
            layer = Int8WeightOnlyLinear.from_linear(module)
        else:
            q, scale, zero = P.quantize_int4(module.weight.detach(), 16, symmetric=False)
            layer = Int4WeightOnlyLinear.from_quantized(module, q, scale, zero)
        set_submodule(model, name, layer)
    return model.to(torch.bfloat16)


def _runner(model: GPTModel, fused: bool, slots: int = 3, max_length: int = 32) -> ModelRunner:
    runner = ModelRunner(model, num_slots=slots, max_length=max_length, block_size=4)
    runner.choose_decode_attention()
    if fused:
        assert runner.use_fused_decode() is None
        assert isinstance(runner.fused_decode, VectorDecode)
    return runner


def _close_to_the_op_by_op_runner(model: GPTModel) -> VectorDecode:
    runners = [_runner(model, False), _runner(model, True)]
    assert runners[0].cache.keys.dtype == torch.bfloat16
    steps = [prefill_and_decode(runner) for runner in runners]
    assert runners[1].fused_decode.steps == 5
    for want, got in zip(*steps, strict=True):
        torch.testing.assert_close(got, want, **BF16_TOLERANCE)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    for pool in ("keys", "values"):  # bf16 in the cache, as the eager model stores them
        got, want = (getattr(r.cache, pool).float() for r in runners[::-1])
        torch.testing.assert_close(got, want, atol=2**-6, rtol=0)
    return runners[1].fused_decode


@pytest.mark.parametrize("shape", sorted(LLAMA_SHAPES))
@torch.inference_mode()
def test_bf16_steps_equal_the_op_by_op_bf16_runner(isa: str, shape: str) -> None:
    step = _close_to_the_op_by_op_runner(_model(**LLAMA_SHAPES[shape]))
    assert step.description == f"{isa} bf16"
    assert step._vocab == 128  # the bf16 output layer in the step too


@torch.inference_mode()
def test_each_op_rounds_where_the_eager_bf16_model_rounds(isa: str) -> None:
    """One layer with larger weights and norm weights other than 1 (where a rounding missed
    or doubled shows): the decode steps' logits are the eager model's bitwise, nearly all
    (here all; one op's rounding left out, or the norm's rounded twice, leaves a fifth to a
    third). The prompt step differs (the eager prompt attention is SDPA's), and so would
    a second layer's inputs."""
    model = bf16_rounding_model()
    steps = [prefill_and_decode(_runner(model, fused)) for fused in (False, True)]
    want, got = (torch.cat(logits[1:]) for logits in steps)
    assert (got == want).float().mean() >= 0.5


@pytest.mark.parametrize("kind", ["int8", "int4"])
@torch.inference_mode()
def test_quantized_linears_in_a_bf16_model(isa: str, kind: str) -> None:
    """The kernel makes the eager modules' dequantized values (bf16 scales widened) and
    rounds each output to bf16, as the eager modules' bf16 outputs are."""
    step = _close_to_the_op_by_op_runner(_model(kind))
    assert step.description == f"{isa} bf16, {kind} weights"
    assert step._vocab == 128


@pytest.mark.parametrize("quantized", [None, "int4"])
@torch.inference_mode()
def test_a_sequences_logits_do_not_depend_on_what_else_is_batched(
    isa: str, quantized: str | None
) -> None:
    """Sequence 0's prompt and decodes, alone and then among 1-8 others at every place in
    the step (others' prompts included): its logits bitwise equal each time."""
    model = _model(quantized)
    assert_logits_do_not_depend_on_the_batch(lambda: _runner(model, True, slots=9))


def test_the_runner_chooses_it_for_a_bf16_cache_without_amx(isa: str) -> None:
    """With AMX ruled out (`--cpu-isa`, or a CPU without it) a bf16 model's steps are this
    step's; a model whose linears `pack_linears` packed for oneDNN keeps the per-op step,
    and says why."""
    runner = _runner(_model(), True)
    assert runner.fused_decode.description == f"{isa} bf16"
    if not packing_available():
        return
    packed = _model()
    pack_linears(packed, amx=False)  # (oneDNN's layout: the plain weights are gone)
    runner = ModelRunner(packed, num_slots=1, max_length=16)
    why = "its linears are packed for another kernel (pack_linears)"
    assert vector_decode_unsupported(packed, runner.cache) == why
    assert runner.use_fused_decode() == why and runner.fused_decode is None


@pytest.mark.skipif(amx_matmul()[0] is None, reason=amx_matmul()[1])
def test_amx_keeps_the_bf16_models_it_packed() -> None:
    model = _model()
    pack_linears(model)
    runner = ModelRunner(model, num_slots=1, max_length=16)
    assert runner.use_fused_decode() is None and isinstance(runner.fused_decode, FusedDecode)
    assert runner.fused_decode.description == "amx bf16"


@pytest.mark.parametrize("quantized", [None, "int8", "int4"])
@torch.inference_mode()
def test_a_long_prompt_in_one_step_equals_it_in_short_steps(
    isa: str, quantized: str | None
) -> None:
    """60 rows take the GEMM form (weights made floats once a block), 5 rows the dot-product
    form: the same numbers."""
    model = _model(quantized)
    assert_prompt_chunks_do_not_change_logits(lambda: _runner(model, True, 1, max_length=64))
