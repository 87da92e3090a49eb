"""Gemma 3 (text) against Hugging Face transformers' `Gemma3ForCausalLM`.

A randomly initialised model with tiny shapes, every parameter perturbed (HF starts
Gemma's zero-centred norms at 0), a sequence longer than the sliding window and both
layer types: the logits of GPTModel match in fp32, the weights round-trip bit for bit,
and the config round-trips through config.json.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from mg.core.models import GPTModel, TransformerConfig  # noqa: E402
from mg.core.models.config import ConfigError  # noqa: E402
from mg.core.models.gemma3_hf import skip_freq_of  # noqa: E402
from mg.core.models.hf_mapping import (  # noqa: E402
    config_from_hf,
    config_to_hf,
    hf_to_megatron,
    megatron_to_hf,
)
from mg.core.models.kv_cache import KVCache  # noqa: E402
from mg.core.models.paged_kv_cache import PagedKVCache  # noqa: E402

WINDOW = 5
SEQ = 24  # > WINDOW: the sliding layers see only their last WINDOW keys


def _hf_config(**overrides) -> Gemma3TextConfig:
    fields = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=WINDOW,
        sliding_window_pattern=2,  # sliding, full, sliding, full
        query_pre_attn_scalar=24,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    return Gemma3TextConfig(**{**fields, **overrides})


def _hf_model(config: Gemma3TextConfig) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    model = Gemma3ForCausalLM._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3 if "norm" in name else 0.1)
    return model


def _convert(hf: Gemma3ForCausalLM) -> tuple[GPTModel, TransformerConfig]:
    config = config_from_hf(json.loads(hf.config.to_json_string()))
    model = GPTModel(config).eval()
    model.load_state_dict(hf_to_megatron(hf.state_dict(), config, "gemma3_text"))
    return model, config


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_gemma3_config_maps_every_piece():
    config = config_from_hf(json.loads(_hf_config().to_json_string()))
    assert config.window_size == (WINDOW - 1, 0)
    assert config.window_attn_skip_freq == 2
    assert [config.is_window_layer(i) for i in range(1, 5)] == [True, False, True, False]
    assert config.rotary_base == 1_000_000.0 and config.rotary_base_local == 10_000.0
    assert config.rotary_seq_len_interpolation_factor == 4.0
    assert config.softmax_scale == 24**-0.5
    assert config.sandwich_norms and config.qk_layernorm and config.layernorm_zero_centered_gamma
    assert config.scale_embeddings_by_sqrt_hidden and config.activation == "geglu_tanh"


@pytest.mark.parametrize("pattern", [2, 3])
def test_gemma3_logits_match_transformers(pattern):
    hf = _hf_model(_hf_config(sliding_window_pattern=pattern))
    model, config = _convert(hf)
    ids = _ids()
    with torch.no_grad():
        ref, out = hf(ids).logits, model(ids)
    assert (out - ref).abs().max().item() < 1e-4
    # the window matters here: without it the sliding layers' logits differ
    config.window_size, config.window_attn_skip_freq = None, None
    config.rotary_base_local = None
    unwindowed = GPTModel(config).eval()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (unwindowed(ids) - ref).abs().max().item() > 1e-2


def test_gemma3_weights_and_config_round_trip_bit_exact():
    hf = _hf_model(_hf_config())
    model, config = _convert(hf)
    back = megatron_to_hf(model.state_dict(), config, "gemma3_text")
    hf_state = hf.state_dict()
    assert set(back) == set(hf_state) - {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in back.items():
        assert torch.equal(tensor, hf_state[name]), name
    exported = config_to_hf(config, "gemma3_text")
    assert exported["query_pre_attn_scalar"] == 24
    assert exported["layer_types"] == hf.config.layer_types
    assert exported["rope_parameters"]["full_attention"]["factor"] == 4.0
    again = config_from_hf(exported)
    assert again.to_dict() == {**config.to_dict(), "extra": again.extra}
    hf_config = Gemma3TextConfig(**exported, attn_implementation="eager")
    rebuilt = Gemma3ForCausalLM._from_config(hf_config, dtype=torch.float32)
    rebuilt.load_state_dict(back, strict=False)
    rebuilt.tie_weights()
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(_ids()).logits, hf(_ids()).logits)


def test_gemma3_layer_types_any_pattern_and_old_rope_spelling():
    assert skip_freq_of(["sliding_attention"] * 3) is None
    assert skip_freq_of(["full_attention", "sliding_attention", "sliding_attention"]) == [0, 1, 1]
    old = json.loads(_hf_config().to_json_string())
    del old["rope_parameters"], old["layer_types"]
    old.update(rope_theta=5e5, rope_local_base_freq=2e4, rope_scaling=None)
    config = config_from_hf(old)
    assert (config.rotary_base, config.rotary_base_local) == (5e5, 2e4)
    assert config.window_attn_skip_freq == 2


def test_gemma3_final_softcapping_refused_by_name():
    c = json.loads(_hf_config().to_json_string())
    c["final_logit_softcapping"] = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        config_from_hf(c)


def test_gemma3_attn_softcapping_is_ignored_as_transformers_ignores_it():
    """transformers' Gemma3Attention does not pass attn_logit_softcapping to its attention:
    the import leaves it off, and the logits still match."""
    hf = _hf_model(_hf_config(attn_logit_softcapping=1.5))
    model, config = _convert(hf)
    assert config.attn_logit_softcapping is None
    with torch.no_grad():
        assert (model(_ids()) - hf(_ids()).logits).abs().max().item() < 1e-4
    capped = TransformerConfig.from_dict(config.to_dict() | {"attn_logit_softcapping": 1.5})
    with pytest.raises(ValueError, match="soft-capping"):
        config_to_hf(capped, "gemma3_text")


def test_attention_logit_softcapping_equals_transformers_eager_attention():
    """Gemma 2's capped attention (HF's eager_attention_forward with softcap, GQA, a
    sliding window) equals ours, in the layer and in the slot KV cache; the fused kernels
    and the paged KV cache refuse it by name."""
    from types import SimpleNamespace

    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    from mg.core.models.attention_backend import BackendUnavailableError
    from mg.core.models.core_attention import SDPAttention, build_core_attention, causal_mask
    from mg.core.models.presets import tiny_gemma3

    config = tiny_gemma3(attn_logit_softcapping=1.5)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, SEQ, 4, 16, generator=g) * 2
    k, v = (torch.randn(2, SEQ, 2, 16, generator=g) * 2 for _ in range(2))
    ours = SDPAttention(config, layer_number=1)(q, k, v)  # a sliding layer
    allowed = causal_mask(SEQ, config.window_size, "cpu")
    additive = torch.zeros(SEQ, SEQ).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=2, training=False)
    ref, _ = eager_attention_forward(
        module, *(t.transpose(1, 2) for t in (q, k, v)), additive, scaling=16**-0.5, softcap=1.5
    )
    assert (ours - ref.reshape(2, SEQ, -1)).abs().max().item() < 1e-5
    uncapped = SDPAttention(tiny_gemma3(), layer_number=1)(q, k, v)
    assert (uncapped - ours).abs().max().item() > 1e-2

    model = GPTModel(config).eval()
    ids = _ids()[:1]
    with torch.no_grad():
        cache = KVCache.for_model(model, num_slots=1, max_length=SEQ)
        cache.bind(torch.tensor([0]), torch.tensor([0]))
        prefill = model(ids[:, :10], torch.arange(10)[None], inference_cache=cache)
        cache.bind(torch.tensor([0]), torch.tensor([10]))
        step = model(ids[:, 10:11], torch.tensor([[10]]), inference_cache=cache)
        full = model(ids[:, :11])
    assert (torch.cat([prefill, step], dim=1) - full).abs().max().item() < 1e-5
    config.attention_backend = "fused"
    with pytest.raises(BackendUnavailableError, match="attn_logit_softcapping"):
        build_core_attention(config, 1)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        PagedKVCache.for_model(model, num_blocks=8, block_size=4)


def test_gemma3_config_not_exported_as_llama():
    config = config_from_hf(json.loads(_hf_config().to_json_string()))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        config_to_hf(config, "llama")


def test_window_pattern_needs_a_window():
    with pytest.raises(ConfigError, match="window_attn_skip_freq"):
        TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
            window_attn_skip_freq=2,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="window_attn_skip_freq"):
        TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
            window_size=(3, 0), window_attn_skip_freq=[1, 0, 1],
        )  # fmt: skip


def test_gemma3_slot_cache_decodes_as_the_full_forward():
    """The slot KVCache keeps each layer's own window and the softmax scale."""
    hf = _hf_model(_hf_config())
    model, _ = _convert(hf)
    ids = _ids()[:1]
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, num_slots=1, max_length=SEQ)
        cache.bind(torch.tensor([0]), torch.tensor([0]))
        steps = [model(ids[:, :8], torch.arange(8)[None], inference_cache=cache)]
        for t in range(8, SEQ):
            cache.bind(torch.tensor([0]), torch.tensor([t]))
            steps.append(model(ids[:, t : t + 1], torch.tensor([[t]]), inference_cache=cache))
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5


def test_gemma3_paged_cache_decodes_as_the_full_forward():
    """The paged cache keeps each layer's window (prefill chunks and decode rows alike)
    and the softmax scale."""
    from mg.core.models.paged_kv_cache import PagedSegment

    hf = _hf_model(_hf_config())
    model, _ = _convert(hf)
    ids = _ids()[:1]
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    assert cache.layer_windows == [(WINDOW - 1, 0), None, (WINDOW - 1, 0), None]
    blocks = list(range(SEQ // 4))
    with torch.no_grad():
        full = model(ids)
        steps = []
        for start, length in ((0, 7), (7, 6)):  # two prefill chunks, the second cached
            cache.bind([PagedSegment(0, length, start, blocks)])
            positions = torch.arange(start, start + length)[None]
            steps.append(model(ids[:, start : start + length], positions, inference_cache=cache))
        for t in range(13, SEQ):
            cache.bind([PagedSegment(0, 1, t, blocks)])
            steps.append(model(ids[:, t : t + 1], torch.tensor([[t]]), inference_cache=cache))
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5


def test_gemma3_parameter_count_and_flops_know_the_pieces():
    from mg.core.models.flops import num_floating_point_operations, num_parameters
    from mg.core.models.memory import stage_parameters

    _, config = _convert(_hf_model(_hf_config()))
    model = GPTModel(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())
    assert stage_parameters(config)[0] == num_parameters(config)
    # the sliding layers (2 of 4, window 5 of 24 keys) count fewer attention FLOPs
    full = TransformerConfig.from_dict(
        {**config.to_dict(), "window_size": None, "window_attn_skip_freq": None}
        | {"rotary_base_local": None}
    )
    windowed = num_floating_point_operations(config, 1, SEQ)
    unwindowed = num_floating_point_operations(full, 1, SEQ)
    h, q = config.hidden_size, config.query_projection_size / config.hidden_size
    keys_saved = 2 * (SEQ / 2 - (WINDOW - WINDOW**2 / (2 * SEQ)))  # two sliding layers
    assert unwindowed - windowed == pytest.approx(12 * SEQ * h**2 * q * keys_saved / h)


def test_gemma3_1b_preset_has_the_published_size():
    from mg.core.models.flops import num_parameters
    from mg.core.models.presets import gemma3_1b, tiny_gemma3

    config = gemma3_1b()
    assert num_parameters(config) == 999_885_952  # Gemma-3-1B: "1B", tied embeddings
    assert [config.is_window_layer(i) for i in range(1, 7)] == [True] * 5 + [False]
    tiny = GPTModel(tiny_gemma3())
    assert tiny(torch.zeros(1, 32, dtype=torch.long)).shape == (1, 32, 128)


def test_gemma3_bf16_is_as_close_to_fp32_as_transformers_bf16():
    """In bf16 (norms in fp32, the √hidden scale rounded to bf16 as HF rounds it) our error
    against the fp32 logits is no larger than transformers' own bf16 error."""
    hf = _hf_model(_hf_config())
    model, _ = _convert(hf)
    ids = _ids()
    with torch.no_grad():
        reference = hf(ids).logits
        hf_bf16 = hf.to(torch.bfloat16)(ids).logits.float()
        ours_bf16 = model.to(torch.bfloat16)(ids).float()
    hf_error = (hf_bf16 - reference).abs().max().item()
    assert (ours_bf16 - reference).abs().max().item() <= 1.25 * hf_error
    assert (ours_bf16 - hf_bf16).abs().max().item() <= 2 * hf_error
