"""Parity with Hugging Face transformers (LitGPT's `test_against_hf_*`).

A randomly initialised transformers model with tiny shapes is converted with
`mg.core.models.hf_mapping`; the logits of GPTModel must match, and the weight
mapping must round-trip bit for bit. Every HF parameter is perturbed first so
that norms and biases (initialised to 1/0 by HF) are not trivially equal.
"""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from mg.core.models import GPTModel  # noqa: E402
from mg.core.models.hf_mapping import (  # noqa: E402
    config_from_hf,
    config_to_hf,
    hf_to_megatron,
    megatron_to_hf,
)

pytestmark = pytest.mark.compat

SEQ = 32
TINY_DECODER = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=128,
    attn_implementation="eager",
)


def _hf_gpt2():
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=128,
            n_positions=SEQ,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
        )
    )


def _hf_llama_mha():
    return LlamaForCausalLM(LlamaConfig(num_attention_heads=4, **TINY_DECODER))


def _hf_llama3_gqa():
    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,  # small, so all three frequency bands occur
    )
    config = LlamaConfig(
        num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope, **TINY_DECODER
    )
    return LlamaForCausalLM(config)


def _hf_mistral():
    config = MistralConfig(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, **TINY_DECODER
    )
    return MistralForCausalLM(config)


def _hf_qwen2():
    config = Qwen2Config(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **TINY_DECODER
    )
    return Qwen2ForCausalLM(config)


def _hf_qwen3():
    config = Qwen3Config(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden / heads, as in the released Qwen3 models
        tie_word_embeddings=False,
        **TINY_DECODER,
    )
    return Qwen3ForCausalLM(config)


CASES = {
    "gpt2": (_hf_gpt2, "gpt2"),
    "llama2-mha": (_hf_llama_mha, "llama"),
    "llama3-gqa-rope-scaling": (_hf_llama3_gqa, "llama"),
    "mistral-sliding-window": (_hf_mistral, "mistral"),
    "qwen2-qkv-bias-tied": (_hf_qwen2, "qwen2"),
    "qwen3-qk-norm-head-dim": (_hf_qwen3, "qwen3"),
}


def _perturbed(build):
    torch.manual_seed(0)
    hf = build().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def _hf_weights(hf, config):
    """The state dict as save_pretrained writes it: no tied lm_head copy, no buffers."""
    state = hf.state_dict()
    names = {n for n, _ in hf.named_parameters()}
    return {k: v for k, v in state.items() if k in names}


@pytest.mark.parametrize("case", sorted(CASES))
def test_against_hf_logits(case):
    build, arch = CASES[case]
    hf = _perturbed(build)
    config = config_from_hf(hf.config, seq_length=SEQ)
    model = GPTModel(config).eval()
    model.load_state_dict(hf_to_megatron(hf.state_dict(), config, arch), strict=True)

    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = model(ids)
    max_abs_diff = (got - expected).abs().max().item()
    print(f"{case}: max |logits diff| = {max_abs_diff:.3g}")
    assert max_abs_diff <= 1e-4

    if config.position_embedding_type == "rope":
        # Far positions make the low (scaled) RoPE frequencies turn by large angles.
        positions = torch.arange(SEQ).expand(2, SEQ) + 4000
        with torch.no_grad():
            far_diff = (model(ids, positions) - hf(ids, position_ids=positions).logits).abs().max()
        print(f"{case}: max |logits diff| at positions 4000+ = {far_diff.item():.3g}")
        assert far_diff.item() <= 1e-4

    if case.startswith("mistral"):
        # The window must matter at this length, or the test proves nothing about it.
        config.window_size = None
        unwindowed = GPTModel(config).eval()
        unwindowed.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (unwindowed(ids) - expected).abs().max().item() > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_weight_mapping_round_trips_bit_exactly(case):
    build, arch = CASES[case]
    hf = _perturbed(build)
    config = config_from_hf(hf.config, seq_length=SEQ)
    hf_weights = _hf_weights(hf, config)
    megatron = hf_to_megatron(hf_weights, config, arch)
    back = megatron_to_hf(megatron, config, arch)
    assert back.keys() == hf_weights.keys()
    for name, tensor in hf_weights.items():
        assert torch.equal(back[name], tensor), name
    again = hf_to_megatron(back, config, arch)
    assert again.keys() == megatron.keys()
    assert all(torch.equal(again[k], megatron[k]) for k in megatron)


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_to_hf_builds_the_same_architecture(case):
    build, arch = CASES[case]
    hf = build()
    config = config_from_hf(hf.config, seq_length=SEQ)
    cls, config_cls = type(hf), type(hf.config)
    fields = config_to_hf(config, arch)
    fields.pop("architectures"), fields.pop("model_type")
    if arch == "gpt2":  # token ids belong to the tokenizer, not the model config
        fields.update(bos_token_id=0, eos_token_id=0)
    rebuilt = cls(config_cls(**fields, attn_implementation="eager"))
    shapes = {k: v.shape for k, v in rebuilt.state_dict().items()}
    assert shapes == {k: v.shape for k, v in hf.state_dict().items()}
    assert config_from_hf(rebuilt.config, seq_length=SEQ) == config


def test_qkv_interleaving_is_per_query_group():
    """Row blocks of linear_qkv: [q0 q1 k0 v0 | q2 q3 k1 v1] for 4 heads, 2 groups."""
    hf = _hf_llama3_gqa()
    config = config_from_hf(hf.config)
    d = config.kv_channels
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    attn = "model.layers.0.self_attn."
    for name, count in (("q_proj", 4), ("k_proj", 2), ("v_proj", 2)):
        labels = torch.arange(count).repeat_interleave(d)[:, None].float()
        state[attn + name + ".weight"] = (
            labels.expand(-1, 64) + {"q_proj": 0, "k_proj": 10, "v_proj": 20}[name]
        )
    fused = hf_to_megatron(state, config, "llama")[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    blocks = fused[::d, 0].tolist()
    assert blocks == [0, 1, 10, 20, 2, 3, 11, 21]


def test_unknown_tensors_are_an_error():
    hf = _hf_llama_mha()
    config = config_from_hf(hf.config)
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(KeyError, match="q_norm"):
        hf_to_megatron(state, config, "llama")
    del (
        state["model.layers.0.self_attn.q_norm.weight"],
        state["model.layers.1.self_attn.k_proj.weight"],
    )
    with pytest.raises(KeyError, match="k_proj"):
        hf_to_megatron(state, config, "llama")


def test_gpt2_checkpoint_without_base_prefix():
    """The original GPT-2 files were saved from GPT2Model: keys like "h.0.ln_1.weight"."""
    hf = _perturbed(_hf_gpt2)
    config = config_from_hf(hf.config)
    full = _hf_weights(hf, config)
    bare = {k.removeprefix("transformer."): v for k, v in full.items()}
    converted, expected = hf_to_megatron(bare, config, "gpt2"), hf_to_megatron(full, config, "gpt2")
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[k], expected[k]) for k in expected)
