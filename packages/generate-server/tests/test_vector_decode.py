"""The fp32 step as one C++ call on AVX-512 and AVX2 (`vector_decode`, each forced through
`MG_CPU_ISA` where the CPU has it): the op-by-op runner's logits and tokens, a sequence's
numbers bitwise the same whatever else its steps hold, `--cpu-isa` refused by name for an
instruction set the CPU lacks, and models it cannot run say why."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.testing.paged_steps import (
    LLAMA_SHAPES,
    assert_logits_do_not_depend_on_the_batch,
    assert_prompt_chunks_do_not_change_logits,
    prefill_and_decode,
)
from mg.generate_server import cpu_isa
from mg.generate_server.runner import ModelRunner
from mg.generate_server.vector_decode import VectorDecode, vector_decode_unsupported


def _model(**overrides) -> GPTModel:
    torch.manual_seed(0)
    config = presets.tiny_llama(hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    return GPTModel(config).eval()


def _runner(model: GPTModel, fused: bool, slots: int = 3, max_length: int = 32) -> ModelRunner:
    runner = ModelRunner(model, num_slots=slots, max_length=max_length, block_size=4)
    runner.choose_decode_attention()
    if fused:
        assert runner.use_fused_decode() is None
        assert isinstance(runner.fused_decode, VectorDecode)
    return runner


@pytest.mark.parametrize("shape", sorted(LLAMA_SHAPES))
@torch.inference_mode()
def test_fused_steps_equal_the_op_by_op_runner(isa: str, shape: str) -> None:
    model = _model(**LLAMA_SHAPES[shape])
    runners = [_runner(model, False), _runner(model, True)]
    assert runners[1].fused_decode.description == f"{isa} fp32"
    steps = [prefill_and_decode(runner) for runner in runners]
    assert runners[1].fused_decode.steps == 5
    for want, got in zip(*steps, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fp32, summed otherwise
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(runners[1].cache.keys, runners[0].cache.keys, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_a_sequences_logits_do_not_depend_on_what_else_is_batched(isa: str) -> None:
    """Sequence 0's prompt and decodes, alone and then among 1-8 others at every place in
    the step (others' prompts included): its logits bitwise equal each time."""
    model = _model()
    assert_logits_do_not_depend_on_the_batch(lambda: _runner(model, True, slots=9))


@pytest.mark.parametrize("shape", ["llama", "sliding-window"])
@torch.inference_mode()
def test_a_long_prompt_in_one_step_equals_it_in_short_steps(isa: str, shape: str) -> None:
    """60 rows take the GEMM form, 5 rows the dot-product form: the same numbers."""
    model = _model(**LLAMA_SHAPES[shape])
    assert_prompt_chunks_do_not_change_logits(lambda: _runner(model, True, 1, max_length=64))


def test_greedy_tokens_equal_the_op_by_op_engines(isa: str) -> None:
    from mg.generate_server.batch import generate_batch
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.sampling import SamplingParams

    model = _model()
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


def test_cpu_isa_refuses_what_the_cpu_lacks_by_name(monkeypatch) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert cpu_isa.available() == "avx2"
    assert cpu_isa.check("auto") == "avx2" and cpu_isa.check("none") == "none"
    monkeypatch.delenv(cpu_isa.ENVIRONMENT, raising=False)
    assert cpu_isa.confining_flags() == ()  # the CPU's best: built as it is
    monkeypatch.setenv(cpu_isa.ENVIRONMENT, "none")  # below it: the attention kernel too
    assert cpu_isa.confining_flags() == ("-mno-avx",)
    with pytest.raises(cpu_isa.CpuIsaError) as err:
        cpu_isa.check("avx512")
    assert str(err.value) == (
        "--cpu-isa avx512: this CPU lacks avx512bw, avx512vl, avx512dq (it has avx2); "
        "choose auto or one of none, avx2"
    )
    monkeypatch.setattr(cpu_isa, "cpu_flags", frozenset)  # ARM, or an unknown CPU
    assert cpu_isa.available() == "none"
    monkeypatch.setenv(cpu_isa.ENVIRONMENT, "none")
    model = _model()
    why = vector_decode_unsupported(model, ModelRunner(model, 1, 16).cache)
    assert why == "the CPU kernels may use neither AVX-512 nor AVX2 (none)"


def test_mg_serve_refuses_an_isa_the_cpu_lacks_in_one_line(monkeypatch, capsys) -> None:
    from mg.generate_server.cli import main

    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with pytest.raises(SystemExit) as code:
        main(["--load", "x", "--cpu-isa", "amx"])
    assert code.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].endswith(
        "--cpu-isa amx: this CPU lacks amx_bf16, amx_tile (it has avx2); "
        "choose auto or one of none, avx2"
    )


def test_models_it_cannot_run_say_why() -> None:
    def why(model: GPTModel) -> str | None:
        return vector_decode_unsupported(model, ModelRunner(model, 1, 16).cache)

    if cpu_isa.available() not in ("avx2", "avx512", "amx"):
        pytest.skip("this CPU has neither AVX2 nor AVX-512")
    assert why(_model()) is None
    assert why(_model().to(torch.float16)) == "the KV cache is not fp32 on the CPU"
    gpt2 = presets.gpt2_124m(num_layers=1, hidden_size=64, num_attention_heads=4,
                             vocab_size=128, max_position_embeddings=16, seq_length=16)  # fmt: skip
    assert why(GPTModel(gpt2)) == "positions are not RoPE"
    moe = _model(num_moe_experts=4, moe_router_topk=2)
    assert "MoE" in why(moe)
    assert why(_model(qk_layernorm=True)) == "it norms queries and keys (--qk-layernorm)"
