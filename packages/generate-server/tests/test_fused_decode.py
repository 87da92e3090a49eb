"""A step as one C++ call (`fused_decode`, CPUs with AMX): the logits of the op-by-op runner
over the same packed weights and cache, for GQA, partial RoPE, a sliding window and Llama 3
frequency scaling, through prompts (in chunks, with prompt log-probabilities), mixed steps
and decodes; prompts over long contexts keep SDPA; models it cannot run say why."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.models.config import RopeScaling
from mg.core.models.paged_kv_cache import PagedSegment
from mg.core.testing.paged_steps import bf16_rounding_model, prefill_and_decode
from mg.generate_server.amx_matmul import amx_matmul
from mg.generate_server.fused_decode import fused_decode_unsupported
from mg.generate_server.packed_linears import pack_linears
from mg.generate_server.runner import ModelRunner

needs_amx = pytest.mark.skipif(amx_matmul()[0] is None, reason=amx_matmul()[1])


def _packed_model(**overrides) -> GPTModel:
    torch.manual_seed(0)
    config = presets.tiny_llama(hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    model = GPTModel(config).eval().to(torch.bfloat16)
    pack_linears(model)
    return model


SHAPES = {
    "llama": {},
    "mha-partial-rope": {"num_query_groups": 4, "rotary_percent": 0.5},
    "sliding-window": {"window_size": (5, 0)},
    "llama3-scaling": {"rope_scaling": RopeScaling(8.0, 1.0, 4.0, 16)},
    "three-groups": {"num_attention_heads": 6, "num_query_groups": 3, "hidden_size": 96},
}


@needs_amx
@torch.inference_mode()
def test_each_op_rounds_where_the_eager_bf16_model_rounds() -> None:
    """The AMX step's decode logits are the eager bf16 model's bitwise on a model where a
    rounding missed or doubled shows (its RMSNorm rounded twice left 17% equal)."""
    model = bf16_rounding_model()
    logits = []
    for fused in (False, True):
        if fused:
            pack_linears(model)
        runner = ModelRunner(model, num_slots=3, max_length=32, block_size=4)
        runner.choose_decode_attention()  # the decode rows' kernel: the same sums
        if fused:
            assert runner.use_fused_decode() is None
            assert runner.fused_decode.description == "amx bf16"
        logits.append(torch.cat(prefill_and_decode(runner)[1:]))
    want, got = logits
    assert (got == want).float().mean() >= 0.5


@needs_amx
@pytest.mark.parametrize("shape", sorted(SHAPES))
@torch.inference_mode()
def test_fused_steps_equal_the_op_by_op_runner(shape: str) -> None:
    model = _packed_model(**SHAPES[shape])
    runners = [ModelRunner(model, num_slots=3, max_length=32, block_size=4) for _ in range(2)]
    for runner in runners:
        runner.choose_decode_attention()
    assert runners[1].use_fused_decode() is None and runners[1].fused_decode is not None

    torch.manual_seed(1)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (7, 2, 11, 5)]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9], [10, 11]]
    ids, positions, rows = sum(prompts[:3], []), [], 0
    prefill = []
    for i, prompt in enumerate(prompts[:3]):
        prefill.append(PagedSegment(rows, len(prompt), 0, tables[i]))
        positions += range(len(prompt))
        rows += len(prompt)
    lengths = [len(p) for p in prompts]
    steps: list[list[torch.Tensor]] = [[], []]
    for out, runner in zip(steps, runners, strict=True):
        # prompts, with every row of the first one's logits (prompt log-probabilities)
        out.append(runner.forward(prefill, ids, positions, [0, 1, 2, 3, 4, 5, 6, 8, 19]))
        for step in range(4):  # decodes; the fourth prompt arrives in two chunks
            segments = [PagedSegment(i, 1, lengths[i] + step, tables[i]) for i in range(3)]
            new = [(11 * step + 5 * i) % 128 for i in range(3)]
            where = [lengths[i] + step for i in range(3)]
            sampled = [0, 1, 2]
            if step < 2:
                start, count = (0, 3) if step == 0 else (3, 2)
                segments.append(PagedSegment(3, count, start, tables[3]))
                new += prompts[3][start : start + count]
                where += range(start, start + count)
                sampled += [2 + count] if step == 1 else []  # the prompt's last row
            else:
                segments.append(PagedSegment(3, 1, lengths[3] + step - 2, tables[3]))
                new.append(step)
                where.append(lengths[3] + step - 2)
                sampled.append(3)
            out.append(runner.forward(segments, new, where, sampled))
    assert runners[1].fused_decode.steps == 5  # every step: short prompts and decodes
    for want, got in zip(*steps, strict=True):
        # the same bf16 products and roundings, summed in another order
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # what the fused steps wrote into the pool is what the op-by-op runner wrote
    torch.testing.assert_close(runners[1].cache.keys, runners[0].cache.keys, atol=2e-2, rtol=0)
    torch.testing.assert_close(runners[1].cache.values, runners[0].cache.values, atol=2e-2, rtol=0)


@needs_amx
@torch.inference_mode()
def test_prompts_attending_over_long_contexts_run_op_by_op(monkeypatch) -> None:
    """A prompt chunk whose context passes `MAX_PROMPT_CONTEXT` keeps SDPA (each fused prompt
    row would read the whole context); the decode steps after it are fused."""
    from mg.generate_server import fused_decode

    monkeypatch.setattr(fused_decode, "MAX_PROMPT_CONTEXT", 4)
    model = _packed_model()
    runner = ModelRunner(model, num_slots=2, max_length=32, block_size=4)
    runner.choose_decode_attention()
    assert runner.use_fused_decode() is None
    runner.forward([PagedSegment(0, 4, 0, [0])], [1, 2, 3, 4], [0, 1, 2, 3], [3])
    assert runner.fused_decode.steps == 1
    runner.forward([PagedSegment(0, 3, 0, [1])], [1, 2, 3], [0, 1, 2], [2])
    mixed = [PagedSegment(0, 1, 4, [0, 2]), PagedSegment(1, 2, 3, [1, 3])]  # context 5
    runner.forward(mixed, [5, 6, 7], [4, 3, 4], [0, 2])
    assert runner.fused_decode.steps == 2
    decodes = [PagedSegment(0, 1, 5, [0, 2]), PagedSegment(1, 1, 5, [1, 3])]
    assert runner.forward(decodes, [7, 8], [5, 5], [1]).shape[0] == 1  # one row samples
    assert runner.fused_decode.steps == 3


def test_models_it_cannot_run_say_why() -> None:
    def why(**overrides) -> str | None:
        model = GPTModel(presets.tiny_llama(**overrides)).eval()
        return fused_decode_unsupported(model, ModelRunner(model, 1, 16).cache)

    assert why() == "the KV cache is not bf16 on the CPU"  # float32
    plain = GPTModel(presets.tiny_llama()).eval().to(torch.bfloat16)  # not packed
    assert fused_decode_unsupported(plain, ModelRunner(plain, 1, 16).cache) == (
        "its linears are not AMX-packed and bias-free"
    )
    gpt2 = presets.gpt2_124m(num_layers=1, hidden_size=64, num_attention_heads=4,
                             vocab_size=128, max_position_embeddings=16, seq_length=16)  # fmt: skip
    model = GPTModel(gpt2).to(torch.bfloat16)
    assert fused_decode_unsupported(model, ModelRunner(model, 1, 16).cache) == (
        "positions are not RoPE"
    )
    moe = _packed_model(num_moe_experts=4, moe_router_topk=2)
    assert "MoE" in fused_decode_unsupported(moe, ModelRunner(moe, 1, 16).cache)
    qk = _packed_model(qk_layernorm=True)
    assert fused_decode_unsupported(qk, ModelRunner(qk, 1, 16).cache) == (
        "it norms queries and keys (--qk-layernorm)"
    )


@needs_amx
def test_speculative_decoding_over_fused_steps_gives_the_targets_tokens() -> None:
    """A fused target verifying a fused draft's guesses (k + 1 rows a sequence, fused like a
    short prompt chunk): the target's tokens alone, with a draft that guesses right (itself)
    and one that mostly guesses wrong (rolled back)."""
    from mg.generate_server.batch import generate_batch
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.sampling import SamplingParams
    from mg.generate_server.speculative import Drafter

    target = _packed_model()
    torch.manual_seed(3)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (5, 9, 2)]
    params = SamplingParams(max_new_tokens=12, greedy=True)

    def fused_runner(model: GPTModel) -> ModelRunner:
        runner = ModelRunner(model, num_slots=3, max_length=32, block_size=4)
        runner.choose_decode_attention()
        assert runner.use_fused_decode() is None
        return runner

    def generate(draft: GPTModel | None) -> tuple[list[list[int]], object]:
        drafter = None
        if draft is not None:
            drafter = Drafter(fused_runner(draft), num_tokens=3, vocab_size=128, catch_up_tokens=64)
        runner = fused_runner(target)
        engine = GenerationEngine(runner, lambda ids: "", 128, drafter=drafter)
        try:
            tokens = [r.tokens for r in generate_batch(engine, prompts, params)]
            assert runner.fused_decode.steps == engine.stats.steps  # verifications included
            return tokens, engine.stats
        finally:
            engine.shutdown()

    alone, _ = generate(None)
    torch.manual_seed(0)
    for draft in (target, _packed_model(num_layers=1, init_method_std=0.5)):
        tokens, stats = generate(draft)
        assert tokens == alone and stats.draft_tokens > 0
    assert stats.accepted_draft_tokens < stats.draft_tokens  # the other model's guesses


@needs_amx
def test_a_library_that_fails_to_build_leaves_the_op_by_op_step(monkeypatch) -> None:
    from mg.generate_server import fused_decode

    def broken(*args):
        raise RuntimeError("the compiler says no")

    monkeypatch.setattr(fused_decode, "_build", broken)
    runner = ModelRunner(_packed_model(), num_slots=1, max_length=16)
    why = runner.use_fused_decode()
    assert why == "the fused step could not be built (RuntimeError: the compiler says no)"
    assert runner.fused_decode is None
