"""Decoding with the recurrent state: each step's logits equal a full forward re-run,
greedy tokens equal transformers' `generate()`, and rows of different lengths and
positions share a batch (continuous batching)."""

import pytest
import torch

from mg.core.models.mamba import HybridCache, MambaConfig, MambaModel

ATOL = 1e-4


def _model(pattern: str, **overrides) -> MambaModel:
    fields = dict(
        num_layers=len(pattern),
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=97,
        seq_length=64,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=16,
        mamba_chunk_size=8,
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        position_embedding_type="rope",
        hybrid_override_pattern=pattern,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,  # larger weights: sharper logits, so greedy ties cannot hide bugs
    )
    fields.update(overrides)
    torch.manual_seed(0)
    return MambaModel(MambaConfig(**fields)).eval()


def _greedy_with_state(model, prompt: torch.Tensor, steps: int) -> tuple[list[int], list]:
    cache = HybridCache.for_model(model, num_slots=2, max_length=64)
    cache.bind(torch.tensor([1]), torch.tensor([0]))
    n = prompt.shape[1]
    logits = model(prompt, torch.arange(n)[None], inference_cache=cache)[:, -1]
    tokens, all_logits = [], [logits]
    for i in range(steps):
        token = logits.argmax(-1)
        tokens.append(int(token))
        cache.bind(torch.tensor([1]), torch.tensor([n + i]))
        logits = model(token[:, None], torch.tensor([[n + i]]), inference_cache=cache)[:, -1]
        all_logits.append(logits)
    return tokens, all_logits


@pytest.mark.parametrize("pattern", ["MMM", "M*M-", "*M-M"])
@torch.no_grad()
def test_greedy_with_state_equals_full_rerun(pattern):
    """At every step the cached step's logits equal the last position of a full forward
    over the whole sequence so far (≤ 1e-4), and the greedy tokens are identical."""
    model = _model(pattern)
    prompt = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(2))
    tokens, step_logits = _greedy_with_state(model, prompt, steps=12)
    sequence = prompt
    for i, logits in enumerate(step_logits):
        full = model(sequence)[:, -1]
        torch.testing.assert_close(logits, full, rtol=0, atol=ATOL)
        if i < len(tokens):
            assert int(full.argmax(-1)) == tokens[i]
            sequence = torch.cat([sequence, torch.tensor([[tokens[i]]])], dim=1)


@torch.no_grad()
def test_state_is_constant_size():
    model = _model("M*M-")
    cache = HybridCache.for_model(model, num_slots=3, max_length=64)
    conv, ssm = cache.conv_states.shape, cache.ssm_states.shape
    # two Mamba layers; conv window conv_dim x (d_conv - 1); SSM heads x P x N
    assert conv == (2, 3, 128 + 2 * 2 * 16, 3) and ssm == (2, 3, 8, 16, 16)
    assert cache.kv.keys.shape[0] == 1  # a KV cache for the one attention layer only


@torch.no_grad()
def test_chunked_prefill_continues_the_state():
    """A prompt fed as 5 + 9 + 1 tokens gives the logits of one full forward."""
    model = _model("M*M-")
    ids = torch.randint(0, 97, (1, 15), generator=torch.Generator().manual_seed(3))
    full = model(ids)
    cache = HybridCache.for_model(model, num_slots=1, max_length=64)
    pieces = []
    for start, end in ((0, 5), (5, 14), (14, 15)):
        cache.bind(torch.tensor([0]), torch.tensor([start]))
        pieces.append(
            model(ids[:, start:end], torch.arange(start, end)[None], inference_cache=cache)
        )
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=ATOL)


@torch.no_grad()
def test_continuous_batching_rows_of_different_lengths():
    """Two prompts (9 and 4 tokens) prefilled together right-padded, with `lengths`;
    then decoded together at different positions; a slot rebound at start 0 forgets
    its previous sequence. Each row equals its own full forward."""
    model = _model("M*M-")
    g = torch.Generator().manual_seed(4)
    a = torch.randint(0, 97, (1, 9), generator=g)
    b = torch.randint(0, 97, (1, 4), generator=g)
    cache = HybridCache.for_model(model, num_slots=4, max_length=64)
    # slot 2 holds an unrelated earlier sequence, which the new row must not see
    cache.bind(torch.tensor([2]), torch.tensor([0]))
    model(torch.randint(0, 97, (1, 6), generator=g), inference_cache=cache)

    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0], batch[1, :4] = a[0], b[0]
    cache.bind(torch.tensor([0, 2]), torch.tensor([0, 0]), lengths=torch.tensor([9, 4]))
    logits = model(batch, torch.arange(9).expand(2, 9), inference_cache=cache)
    torch.testing.assert_close(logits[0], model(a)[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits[1, :4], model(b)[0], rtol=0, atol=ATOL)

    next_a, next_b = logits[0, 8].argmax(), logits[1, 3].argmax()
    cache.bind(torch.tensor([0, 2]), torch.tensor([9, 4]))
    step = model(
        torch.stack([next_a, next_b])[:, None], torch.tensor([[9], [4]]), inference_cache=cache
    )
    a2 = torch.cat([a, next_a.view(1, 1)], dim=1)
    b2 = torch.cat([b, next_b.view(1, 1)], dim=1)
    torch.testing.assert_close(step[0, 0], model(a2)[0, -1], rtol=0, atol=ATOL)
    torch.testing.assert_close(step[1, 0], model(b2)[0, -1], rtol=0, atol=ATOL)


def test_unbound_cache_is_refused():
    model = _model("MM")
    cache = HybridCache.for_model(model, num_slots=1, max_length=8)
    with pytest.raises(RuntimeError, match="bind"):
        model(torch.zeros(1, 2, dtype=torch.long), inference_cache=cache)


@torch.no_grad()
def test_greedy_equals_transformers_generate():
    """Same weights in Mamba2ForCausalLM: `generate(do_sample=False)` (its own recurrent
    cache) gives the tokens our stateful greedy loop gives."""
    transformers = pytest.importorskip("transformers")
    from mg.core.models.hf_mapping import hf_to_megatron
    from mg.core.models.mamba.hf import MAMBA2

    torch.manual_seed(0)
    hf_config = transformers.Mamba2Config(
        num_heads=8,
        head_dim=16,
        vocab_size=97,
        hidden_size=64,
        state_size=16,
        num_hidden_layers=2,
        n_groups=2,
        chunk_size=8,
        tie_word_embeddings=False,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    hf = transformers.Mamba2ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("in_proj.weight") or name.endswith("out_proj.weight"):
                p.normal_(0, 0.2)
    ours = _model(
        "MM",
        mamba_num_heads=8,
        position_embedding_type="none",
        untie_embeddings_and_output_weights=True,
    )
    ours.load_state_dict(hf_to_megatron(hf.state_dict(), ours.config, MAMBA2), strict=True)
    prompt = torch.randint(1, 97, (1, 11), generator=torch.Generator().manual_seed(5))
    expected = hf.generate(
        prompt, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt)
    )[0, 11:].tolist()
    tokens, _ = _greedy_with_state(ours, prompt, steps=16)
    assert tokens == expected
