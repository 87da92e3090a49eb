"""bf16 linears packed once (the eager CPU server), for this package's AMX kernel or for
oneDNN, compute what the plain layers compute, free the plain weights (a tied output
layer's stays: the embedding reads it), and leave alone what reads weights directly (MoE
experts) and every other dtype; the freed heap goes back to the system before serving."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.models.paged_kv_cache import PagedSegment
from mg.generate_server.amx_matmul import AMXLinear, amx_matmul
from mg.generate_server.packed_linears import (
    OneDNNLinear,
    pack_linears,
    packing_available,
    weight_packing,
)
from mg.generate_server.resources import release_freed_heap
from mg.generate_server.runner import ModelRunner

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch without oneDNN")
AMX = pytest.param(
    True, marks=pytest.mark.skipif(amx_matmul()[0] is None, reason=amx_matmul()[1]), id="AMX"
)
PACKINGS = pytest.mark.parametrize("amx", [pytest.param(False, id="oneDNN"), AMX])


def _model(**overrides) -> GPTModel:
    torch.manual_seed(0)
    config = presets.tiny_llama(hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    return GPTModel(config).eval()


@PACKINGS
@torch.inference_mode()
def test_packed_layers_equal_plain_ones_and_free_the_weights(amx: bool) -> None:
    plain = _model(untie_embeddings_and_output_weights=True).to(torch.bfloat16)
    packed = _model(untie_embeddings_and_output_weights=True).to(torch.bfloat16)
    layers = plain.config.num_layers
    assert pack_linears(packed, amx) == 4 * layers + 1  # qkv, proj, fc1, fc2; the output
    kind = AMXLinear if amx else OneDNNLinear
    assert type(packed.decoder.layers[1].self_attention.linear_qkv.matmul) is kind
    assert packed.decoder.layers[0].mlp.linear_fc1.weight.numel() == 0
    assert packed.output_layer.weight.numel() == 0
    ids = torch.randint(0, plain.config.vocab_size, (1, 9))
    steps = []
    for model in (plain, packed):
        runner = ModelRunner(model, num_slots=1, max_length=16, block_size=4)
        prompt = runner.forward([PagedSegment(0, 8, 0, [0, 1, 2])], ids[0, :8].tolist(),
                                list(range(8)), [7])  # fmt: skip
        decode = runner.forward([PagedSegment(0, 1, 8, [0, 1, 2])], [ids[0, 8].item()], [8], [0])
        steps.append(torch.cat([prompt, decode]))
    # the same products, summed in another order: equal to bf16 rounding
    torch.testing.assert_close(steps[1], steps[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(steps[1].argmax(-1), steps[0].argmax(-1))


@PACKINGS
@torch.inference_mode()
def test_a_tied_output_layer_keeps_the_embedding(amx: bool) -> None:
    """Tied: the packed output layer makes the logits, and the embedding still finds every
    token's row (AMX: gathered from the packed copy, the plain matrix freed; oneDNN: the
    plain matrix kept beside its packed copy)."""
    plain = _model(untie_embeddings_and_output_weights=False).to(torch.bfloat16)
    packed = _model(untie_embeddings_and_output_weights=False).to(torch.bfloat16)
    assert packed.output_layer is None  # tied: the embedding's matrix makes the logits
    assert pack_linears(packed, amx) == 4 * packed.config.num_layers + 1
    kept = packed.embedding.word_embeddings.weight.numel()
    assert kept == (0 if amx else plain.output_weight().numel())
    ids = torch.tensor([[0, 31, 32, 127], [5, 16, 17, 100]])
    assert torch.equal(packed.embedding.word_embeddings(ids), plain.output_weight()[ids])
    hidden = torch.randn(1, 5, plain.config.hidden_size, dtype=torch.bfloat16)
    want = plain.output_and_loss(hidden, None)
    got = packed.output_and_loss(hidden, None)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_weights_the_kernel_cannot_take_go_to_onednn() -> None:
    """A side that is not a multiple of 32 (here the output layer's 100-token vocabulary)
    keeps oneDNN's packing; the others take the AMX kernel's where it runs."""
    model = _model(vocab_size=100, untie_embeddings_and_output_weights=True).to(torch.bfloat16)
    hidden = torch.randn(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model.output_and_loss(hidden, None)
        assert pack_linears(model) == 4 * model.config.num_layers + 1
        torch.testing.assert_close(model.output_and_loss(hidden, None), want)
    assert weight_packing(amx=False) == "oneDNN"
    if amx_matmul()[0] is None:
        assert weight_packing() == "oneDNN"
        with pytest.raises(RuntimeError, match="AMX matmuls asked for"):
            weight_packing(amx=True)
    else:
        assert weight_packing() == "AMX"


def test_other_dtypes_and_moe_experts_stay_plain() -> None:
    assert pack_linears(_model()) == 0  # float32
    moe = _model(num_moe_experts=4, moe_router_topk=2).to(torch.bfloat16)
    layers = moe.config.num_layers
    assert pack_linears(moe) == 2 * layers + 1  # attention, output: the experts read .weight


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_goes_back_to_the_system() -> None:
    """What start-up freed (plain weights that packing replaced) leaves the process's
    resident memory before serving, though other chunks above it stay in use."""

    def resident_mb() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

    chunks = [torch.ones(8192) for _ in range(4000)]  # 32 KB each: heap, not mmap
    del chunks[::2]  # 62.5 MB freed in holes between live chunks
    before = resident_mb()
    assert release_freed_heap()
    assert before - resident_mb() > 30


@pytest.mark.skipif(amx_matmul()[0] is None, reason=amx_matmul()[1])
def test_compiled_decode_steps_call_the_amx_kernel() -> None:
    """`--enable-torch-compile` with AMX: the graphs call the kernel as an operator (the
    plain weights are gone, so nothing else could compute them; fullgraph tracing would
    fail on a direct call), and greedy tokens equal the eager packed runner's."""
    from mg.generate_server.batch import generate_batch
    from mg.generate_server.compiled_decode import CompiledDecodeRunner
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.sampling import SamplingParams

    model = _model().to(torch.bfloat16)
    assert pack_linears(model, amx=True) == 4 * model.config.num_layers + 1
    compiled = CompiledDecodeRunner(model, 2, 32, block_size=8)
    compiled.choose_decode_attention()
    assert compiled.compile_buckets(backend="eager")
    prompts = [[5, 9, 13, 2, 7], [100, 3]]
    params = SamplingParams(max_new_tokens=12, greedy=True)
    tokens = []
    for runner in (compiled, ModelRunner(model, 2, 32, block_size=8)):
        engine = GenerationEngine(runner, lambda ids: "", 128)
        try:
            tokens.append([r.tokens for r in generate_batch(engine, prompts, params)])
        finally:
            engine.shutdown()
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 12
    assert compiled.graph_steps >= 11 and not compiled._eager_only
