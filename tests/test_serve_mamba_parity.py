"""mg-serve's engine serves Mamba-2 and hybrid models: greedy tokens equal transformers'
`Mamba2ForCausalLM.generate()` (a tiny random model imported with mg-convert import-hf)
for prompts of mixed lengths decoded in one continuous batch, with chunked prefill
carrying the recurrent state across chunks and with preemption recomputing it; a
hybrid (Mamba + attention over the paged KV cache, no transformers equivalent) equals
mg's own one-sequence decoding. Prefix caching is off for these models and refused
by name when asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mg.core.checkpoint.model_io import load_model
from mg.core.models.mamba import HybridCache, MambaConfig, MambaModel, tiny_hybrid
from mg.generate_server.batch import generate_batch
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
import_hf = pytest.importorskip("mg.ckpt_convert.import_hf").import_hf

VOCAB = 100
NEW_TOKENS = 10
LENGTHS = (1, 5, 23, 12, 40)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]


def _generate(engine: GenerationEngine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts submitted at once (one batch); each one's greedy tokens."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    results = generate_batch(engine, prompts, params)
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return [r.tokens for r in results]


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory) -> tuple[MambaModel, list[list[int]]]:
    """A tiny Mamba2ForCausalLM imported with import-hf, and transformers' greedy tokens."""
    folder: Path = tmp_path_factory.mktemp("mamba2")
    torch.manual_seed(0)
    config = transformers.Mamba2Config(
        num_heads=8,
        head_dim=16,
        hidden_size=64,
        state_size=16,
        n_groups=2,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        chunk_size=16,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf = transformers.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # decisive logits: no near-ties for argmax to flip on
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(folder / "hf")
    hf.generation_config.eos_token_id = None
    expected = []
    for ids in _prompts():
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        expected.append(out[0, len(ids) :].tolist())
    import_hf(str(folder / "hf"), folder / "ckpt", progress=False)
    model = load_model(folder / "ckpt")[0].eval()
    assert isinstance(model, MambaModel)
    return model, expected


SCHEDULES = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 7},  # the 40-token prompt in 6+ chunks
    "preemption": {"num_blocks": 14, "block_size": 4},
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_mamba2_greedy_equals_transformers_generate(mamba2, schedule: str) -> None:
    model, expected = mamba2
    options = dict(SCHEDULES[schedule])
    runner = ModelRunner(
        model,
        num_slots=4,
        max_length=64,
        num_blocks=options.pop("num_blocks", None),
        block_size=options.pop("block_size", 16),
    )
    engine = GenerationEngine(runner, lambda ids: "", VOCAB, **options)
    try:
        assert not engine.blocks.prefix_caching
        assert _generate(engine, _prompts()) == expected
        if schedule == "preemption":
            assert engine.stats.preemptions > 0 and engine.stats.recomputed_tokens > 0
        if schedule == "chunked-prefill":
            assert engine.stats.steps >= NEW_TOKENS + max(LENGTHS) // 7
        assert engine.blocks.num_used == 0 and sorted(engine._free_slots) == [0, 1, 2, 3]
    finally:
        engine.shutdown()


def test_prefix_caching_is_refused_by_name(mamba2) -> None:
    runner = ModelRunner(mamba2[0], num_slots=2, max_length=64)
    with pytest.raises(ValueError, match="prefix caching.*recurrent state"):
        GenerationEngine(runner, lambda ids: "", VOCAB, prefix_caching=True)


@torch.no_grad()
def _alone(model: MambaModel, prompt: list[int], vocab: int = VOCAB) -> list[int]:
    """mg's own decoding of one sequence (HybridCache, one slot): the reference."""
    cache = HybridCache.for_model(model, num_slots=1, max_length=64)
    n = len(prompt)
    cache.bind(torch.tensor([0]), torch.tensor([0]))
    logits = model(torch.tensor([prompt]), torch.arange(n)[None], inference_cache=cache)
    tokens = []
    for i in range(NEW_TOKENS):
        tokens.append(int(logits[0, -1, :vocab].argmax()))
        cache.bind(torch.tensor([0]), torch.tensor([n + i]))
        logits = model(torch.tensor([[tokens[-1]]]), torch.tensor([[n + i]]), inference_cache=cache)
    return tokens


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_hybrid_greedy_equals_unbatched_decoding(schedule: str) -> None:
    """Mamba, attention (paged KV cache) and MLP layers in one stack, batched and chunked,
    give each sequence the tokens it gets decoded alone."""
    torch.manual_seed(0)
    config = MambaConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=128,
        seq_length=64,
        max_position_embeddings=64,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=16,
        mamba_chunk_size=8,
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        position_embedding_type="rope",
        hybrid_override_pattern="M*M-",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
    )
    model = MambaModel(config).eval()
    prompts = _prompts()
    expected = [_alone(model, p) for p in prompts]
    options = dict(SCHEDULES[schedule])
    runner = ModelRunner(
        model,
        num_slots=4,
        max_length=64,
        num_blocks=options.pop("num_blocks", None),
        block_size=options.pop("block_size", 16),
    )
    engine = GenerationEngine(runner, lambda ids: "", VOCAB, **options)
    try:
        assert _generate(engine, prompts) == expected
        if schedule == "preemption":
            assert engine.stats.preemptions > 0
    finally:
        engine.shutdown()


def _hybrid_checkpoint(folder: Path) -> Path:
    """A hybrid model (Mamba, attention, MLP) with a GPT-2 tokenizer, saved for mg-serve."""
    from mg.core.checkpoint import save_model
    from mg.core.fixtures import gpt2_bpe_tokenizer_config

    torch.manual_seed(0)
    config = tiny_hybrid()
    tokenizer = gpt2_bpe_tokenizer_config()
    save_model(folder / "ckpt", MambaModel(config).eval(), config, tokenizer)
    return folder / "ckpt"


@pytest.mark.slow  # two mg-serve processes
def test_mg_serve_command_serves_a_hybrid(tmp_path: Path) -> None:
    """`mg-serve --load` on a hybrid checkpoint: PUT /api with top_k=1 gives mg's own greedy
    decoding; --enable-prefix-caching is refused in one line naming it (exit 2)."""
    import re
    import subprocess
    import sys

    import httpx

    from mg.generate_server.loading import load_for_serving

    ckpt = _hybrid_checkpoint(tmp_path)
    serve = [sys.executable, "-c", "from mg.generate_server.cli import main; main()"]
    refused = subprocess.run(
        [*serve, "--load", str(ckpt), "--enable-prefix-caching"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--enable-prefix-caching: this model's Mamba layers" in refused.stderr
    loaded = load_for_serving(ckpt)
    prompts = ["The school master", "It was a fine day and the boys were out"]
    proc = subprocess.Popen(
        [*serve, "--load", str(ckpt), "--port", "0", "--num-threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = next((x for x in proc.stdout if "listening on" in x), "")  # after progress
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + (proc.stdout.read() if proc.poll() is not None else "")
        assert "Mamba state per sequence, no prefix caching" in line
        body = {"prompts": prompts, "tokens_to_generate": NEW_TOKENS, "top_k": 1}
        texts = httpx.put(match.group(1) + "/api", json=body, timeout=120).json()["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    tok = loaded.tokenizer
    for prompt, text in zip(prompts, texts, strict=True):
        ids = tok.tokenize(prompt)
        assert text == tok.detokenize(ids + _alone(loaded.model, ids, vocab=tok.vocab_size))
