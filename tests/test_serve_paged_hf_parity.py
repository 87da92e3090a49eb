"""mg-serve's paged engine gives transformers' greedy `generate()` tokens, token for token,
for prompts of mixed lengths decoded in one continuous batch, whatever the scheduler
does: prefix caching on or off (and hit), chunked prefill under a small token
budget, and preemption by recompute when the KV-cache pool runs out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.testing.serving_checkpoints import save_decisive_model
from mg.generate_server.amx_matmul import amx_matmul
from mg.generate_server.batch import generate_batch
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.loading import LoadedModel, load_for_serving
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
export_hf = pytest.importorskip("mg.ckpt_convert.export_hf").export_hf

NEW_TOKENS = 20
SYSTEM = (
    "You are a schoolmaster in a small town in the country, and the boys of your "
    "school are very naughty; answer every question about them truthfully."
)
PROMPTS = [
    "The school master",
    "I",
    "It was a fine day and the boys were out in the field behind the school when",
    SYSTEM + " Who broke the window?",
    SYSTEM + " Why",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A Llama-shaped model (RoPE, GQA, SwiGLU) as an mg checkpoint (ckpt) and in HF format."""
    folder = tmp_path_factory.mktemp("paged")
    save_decisive_model(folder, positions=128)
    export_hf(folder / "ckpt", folder / "hf", progress=False)
    return folder


@pytest.fixture(scope="module")
def served(folder) -> tuple[LoadedModel, list[list[int]], list[list[int]]]:
    """The checkpoint loaded for serving, the prompts' ids and transformers' greedy
    continuations of each prompt alone."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    loaded = load_for_serving(folder / "ckpt")
    prompts = [loaded.tokenizer.tokenize(p) for p in PROMPTS]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    return loaded, prompts, expected


def _generate(engine: GenerationEngine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts submitted at once (one batch); each one's greedy tokens."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    results = generate_batch(engine, prompts, params)
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return [r.tokens for r in results]


SCHEDULES = {
    "default": {},
    "no-prefix-caching": {"prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "preemption": {"num_blocks": 14, "block_size": 4},
    "sdpa-decode": {"attention_backend": "unfused"},  # SDPA over gathered blocks
}


def _runner(model: GPTModel, options: dict) -> ModelRunner:
    """A runner of 4 slots over 128 positions, with the schedule's pool settings (popped
    from `options`; what is left goes to the engine)."""
    num_blocks, block_size = options.pop("num_blocks", None), options.pop("block_size", 16)
    return ModelRunner(model, 4, 128, num_blocks=num_blocks, block_size=block_size)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_greedy_equals_transformers_generate(served, schedule: str) -> None:
    loaded, prompts, expected = served
    options = dict(SCHEDULES[schedule])
    runner = _runner(loaded.model, options)
    runner.attention_backend = options.pop("attention_backend", "auto")
    decode_attention = runner.choose_decode_attention()
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, 50257, **options)
    try:
        assert _generate(engine, prompts) == expected
        if schedule == "sdpa-decode":
            assert runner.cache.decode_kernel is None, decode_attention
        if schedule == "preemption":
            assert engine.stats.preemptions > 0
            assert engine.stats.recomputed_tokens > 0
        if schedule == "chunked-prefill":
            longest = max(len(p) for p in prompts)
            assert engine.stats.steps >= NEW_TOKENS + longest // 7
        # every block is back in the pool (named ones kept for later prompts)
        assert engine.blocks.num_used == 0
    finally:
        engine.shutdown()


@pytest.mark.skipif(amx_matmul()[0] is None, reason=amx_matmul()[1])
def test_fused_bf16_steps_are_schedule_invariant_and_follow_fp32(folder, served) -> None:
    """The eager CPU server's bf16 path on a CPU with AMX: weights packed for the AMX kernel,
    every step one C++ call (`fused_decode`). Each row is computed alone, in the same
    order whatever else the step holds, so greedy tokens are bitwise the same under every
    schedule (prefix caching, chunked prefill, preemption by recompute). Against the fp32
    model fed the same tokens, they are its argmax wherever its top two logits are 0.5
    apart. (Token-for-token equality with another bf16 implementation is not a property
    of bf16: transformers' own bf16 tokens leave its fp32 ones on this model within 20
    tokens, as ours do, at near-ties.)"""
    from mg.core.models.paged_kv_cache import PagedSegment
    from mg.generate_server.packed_linears import pack_linears

    reference, prompts, _ = served
    loaded = load_for_serving(folder / "ckpt", dtype="bfloat16")
    assert pack_linears(loaded.model) == 4 * loaded.config.num_layers + 1
    tokens = {}
    for schedule in ("default", "no-prefix-caching", "chunked-prefill", "preemption"):
        options = dict(SCHEDULES[schedule])
        runner = _runner(loaded.model, options)
        runner.choose_decode_attention()
        assert runner.use_fused_decode() is None
        engine = GenerationEngine(runner, loaded.tokenizer.detokenize, 50257, **options)
        try:
            tokens[schedule] = _generate(engine, prompts)
            assert runner.fused_decode.steps == engine.stats.steps
            if schedule == "preemption":
                assert engine.stats.preemptions > 0
        finally:
            engine.shutdown()
    assert all(t == tokens["default"] for t in tokens.values()), tokens
    fp32 = ModelRunner(reference.model, num_slots=1, max_length=128)
    decisive = agreeing = 0
    for prompt, generated in zip(prompts, tokens["default"], strict=True):
        ids = prompt + generated[:-1]
        rows = list(range(len(prompt) - 1, len(ids)))
        with torch.inference_mode():
            logits = fp32.forward([PagedSegment(0, len(ids), 0, list(range(8)))], ids,
                                  list(range(len(ids))), rows)  # fmt: skip
        top = logits.topk(2, dim=-1)
        sure = (top.values[:, 0] - top.values[:, 1]) > 0.5
        decisive += int(sure.sum())
        agreeing += int((top.indices[:, 0] == torch.tensor(generated))[sure].sum())
    assert agreeing == decisive >= len(prompts) * NEW_TOKENS // 3  # 42 of 100 here


def test_prefix_cache_hit_gives_the_same_tokens(served) -> None:
    """The shared system prompt is computed once: a second wave of the same prompts takes its
    full blocks from the cache, and the tokens do not change."""
    loaded, prompts, expected = served
    runner = ModelRunner(loaded.model, num_slots=4, max_length=128, block_size=8)
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, 50257)
    try:
        assert _generate(engine, prompts[3:4]) == expected[3:4]
        computed = engine.stats.prompt_tokens
        assert engine.stats.cached_prompt_tokens == 0
        assert _generate(engine, prompts) == expected
        shared = len(loaded.tokenizer.tokenize(SYSTEM)) // 8 * 8
        assert engine.stats.cached_prompt_tokens >= 2 * shared
        total = sum(len(p) for p in prompts)
        assert engine.stats.prompt_tokens - computed == total - engine.stats.cached_prompt_tokens
    finally:
        engine.shutdown()


def _draft_model(target: GPTModel, kind: str) -> GPTModel:
    """The target itself (every guess right), the target with noisy weights (some right),
    or an unrelated one-layer model (almost none right)."""
    import copy

    torch.manual_seed(1)
    if kind == "unrelated":
        config = presets.tiny_llama(
            num_layers=1, vocab_size=50304, max_position_embeddings=128, seq_length=128
        )
        return GPTModel(config).eval()
    draft = copy.deepcopy(target)
    if kind == "noisy":
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn_like(p) * 0.1 * p.std())
    return draft.eval()


DRAFT_SCHEDULES = {
    "self": {},
    "noisy": {},
    "noisy-chunked-prefill": {"max_num_batched_tokens": 7},
    "noisy-preemption": {"num_blocks": 14, "block_size": 4},
    "unrelated": {"prefix_caching": False},
}


@pytest.mark.parametrize("schedule", sorted(DRAFT_SCHEDULES))
def test_speculative_decoding_gives_the_target_tokens(served, schedule: str) -> None:
    """With a draft model proposing 3 tokens a step, every greedy sequence's tokens are still
    transformers' (speculative decoding changes the speed, never the output), and a seeded
    sampled request in the same batch draws what it draws without a draft."""
    from mg.generate_server.speculative import Drafter

    loaded, prompts, expected = served
    options = dict(DRAFT_SCHEDULES[schedule])
    pool = {
        "num_blocks": options.pop("num_blocks", None),
        "block_size": options.pop("block_size", 16),
    }
    runner = ModelRunner(loaded.model, num_slots=4, max_length=128, **pool)
    draft = ModelRunner(_draft_model(loaded.model, schedule.split("-")[0]), 4, 128, **pool)
    drafter = Drafter(draft, num_tokens=3, vocab_size=50257, catch_up_tokens=64)
    engine = GenerationEngine(
        runner, loaded.tokenizer.detokenize, 50257, drafter=drafter, **options
    )
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=5, seed=7)
    try:
        results: list = [None]
        thread = __import__("threading").Thread(
            target=lambda: results.__setitem__(0, generate_batch(engine, prompts[:1], sampled))
        )
        thread.start()
        assert _generate(engine, prompts) == expected
        thread.join(timeout=120)
        stats = engine.stats
        if schedule == "self":
            assert stats.accepted_draft_tokens == stats.draft_tokens > 0
            # 3 guesses + the target's token per step: far fewer steps than tokens
            assert stats.steps < stats.generated_tokens // 2
        elif schedule == "unrelated":
            assert stats.accepted_draft_tokens < stats.draft_tokens / 4
        else:
            assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
        if schedule.endswith("preemption"):
            assert stats.preemptions > 0
        assert engine.blocks.num_used == 0
    finally:
        engine.shutdown()
    plain = GenerationEngine(
        ModelRunner(loaded.model, num_slots=4, max_length=128), loaded.tokenizer.detokenize, 50257
    )
    try:
        assert [r.tokens for r in results[0]] == [
            r.tokens for r in generate_batch(plain, prompts[:1], sampled)
        ]
    finally:
        plain.shutdown()


def test_static_decode_steps_for_cuda_graphs_give_the_same_tokens(served) -> None:
    """The CUDA-graph runner's static path (decode steps padded to batch buckets, inputs
    copied into fixed tensors, padding rows in a scratch block), run without recording a
    graph on the CPU: transformers' tokens, with the engine's pool one block short of
    the runner's (the scratch block)."""
    from mg.generate_server.cuda_graphs import CudaGraphRunner, batch_buckets

    assert batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(6) == [1, 2, 4, 6]
    loaded, prompts, expected = served
    runner = CudaGraphRunner(loaded.model, 4, 128, block_size=8, capture=False)
    runner.choose_decode_attention()  # the padded rows' lengths reach the CPU kernel
    assert runner.num_blocks == 4 * 16 and runner.cache.num_blocks == 4 * 16 + 1
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, 50257)
    try:
        # three prompts: decode steps of 3 sequences run padded to the bucket of 4
        assert _generate(engine, prompts[:3]) == expected[:3]
        assert _generate(engine, prompts) == expected
        assert runner.graph_steps >= NEW_TOKENS and set(runner._steps) <= {1, 2, 4}
    finally:
        engine.shutdown()


def _compiled_runner(served, backend: str):
    """`--enable-torch-compile`'s runner over 4 slots (buckets 1, 2, 4), compiled with
    `backend` ("eager": dynamo's trace without inductor, the fast check of the wiring)."""
    from mg.generate_server.compiled_decode import CompiledDecodeRunner

    loaded = served[0]
    runner = CompiledDecodeRunner(loaded.model, 4, 128, block_size=8)
    runner.choose_decode_attention()  # as mg-serve does: the opaque op runs the CPU kernel
    assert runner.compile_buckets(backend=backend)
    assert set(runner._steps) == {1, 2, 4} and runner.status.startswith("decode compiled for")
    return runner


def _compiled_equals_eager_and_transformers(served, runner) -> None:
    """Three prompts (decode steps of 3 sequences padded to the bucket of 4), then five
    prompts of mixed lengths on 4 slots (steps of 4, then 1 as they finish): transformers'
    tokens and the eager runner's, with every decode-only step through the graphs."""
    loaded, prompts, expected = served
    engine = GenerationEngine(runner, loaded.tokenizer.detokenize, 50257)
    eager = GenerationEngine(ModelRunner(loaded.model, 4, 128), loaded.tokenizer.detokenize, 50257)
    try:
        assert _generate(engine, prompts[:3]) == expected[:3]
        assert _generate(engine, prompts) == expected == _generate(eager, prompts)
        assert runner.graph_steps >= 2 * NEW_TOKENS and not runner._eager_only
    finally:
        engine.shutdown()
        eager.shutdown()


def test_compiled_decode_steps_traced_without_inductor(served) -> None:
    """The compiled runner's graph (one per bucket, the paged attention an opaque op,
    attention over the blocks in use only) traced by dynamo in one piece and run eagerly."""
    _compiled_equals_eager_and_transformers(served, _compiled_runner(served, "eager"))


@pytest.mark.slow
def test_compiled_decode_steps_give_the_same_tokens(served) -> None:
    """Inductor's graphs (weights frozen) for buckets 1, 2, 4: token-identical greedy
    output; the logits of one padded step within 1e-4 of the eager runner's (fp32)."""
    from mg.core.models.paged_kv_cache import PagedSegment

    runner = _compiled_runner(served, "inductor")
    _compiled_equals_eager_and_transformers(served, runner)
    loaded = served[0]
    eager = ModelRunner(loaded.model, 4, 128, block_size=8)
    segments = [PagedSegment(0, 1, 9, [0, 1]), PagedSegment(1, 1, 3, [2])]
    args = (segments, [11, 12], [9, 3], [0, 1])
    for pool in ("keys", "values"):  # random keys/values of the positions before
        getattr(eager.cache, pool).normal_()
        getattr(runner.cache, pool)[:, :64].copy_(getattr(eager.cache, pool))
    steps = runner.graph_steps
    torch.testing.assert_close(runner.forward(*args), eager.forward(*args), rtol=0, atol=1e-4)
    assert runner.graph_steps == steps + 1


def test_compiled_decode_falls_back_to_eager(served, monkeypatch, caplog) -> None:
    """No C++ compiler, or a compile that raises: one warning, and every step eager with
    transformers' tokens."""
    from mg.generate_server import compiled_decode
    from mg.generate_server.compiled_decode import CompiledDecodeRunner

    loaded, prompts, expected = served
    monkeypatch.setattr(compiled_decode, "cpp_compiler_missing", lambda: "no C++ compiler (x)")
    runner = CompiledDecodeRunner(loaded.model, 4, 128, block_size=8)
    with caplog.at_level("WARNING", logger="mg.generate_server"):
        assert not runner.compile_buckets()
    assert [r.getMessage() for r in caplog.records] == [
        "no C++ compiler (x); decode steps run eagerly"
    ]
    assert runner.status == "decode eager: no C++ compiler"
    monkeypatch.undo()

    def broken(*args, **kwargs):
        def step(*args):
            raise RuntimeError("inductor says no")

        return step

    monkeypatch.setattr(torch, "compile", broken)
    failing = CompiledDecodeRunner(loaded.model, 4, 128, block_size=8)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mg.generate_server"):
        assert not failing.compile_buckets()
    assert [r.getMessage() for r in caplog.records] == [
        "torch.compile failed: RuntimeError: inductor says no; decode steps run eagerly"
    ]
    for r in (runner, failing):
        engine = GenerationEngine(r, loaded.tokenizer.detokenize, 50257)
        try:
            assert _generate(engine, prompts) == expected
            assert r.graph_steps == 0
        finally:
            engine.shutdown()
