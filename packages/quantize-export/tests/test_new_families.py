"""mg-quantize on the newer decoder families: DeepSeek-V3 (multi-latent attention with a
query latent, sigmoid-routed experts with expert bias, a shared expert, the first layer
dense, one MTP layer), gpt-oss (learnable sinks, alternating sliding/full layers, clamped
GLU experts with biases, YaRN) and Gemma 3 (sandwich norms, q/k norms, local/global
layers). int8 weight-only end to end (quantize → perplexity within 1% of the float model
→ core's loader → mg-serve's engine generating what the reloaded model's own forward
picks); the three exports refuse each family in one line, status 2.

Every linear of the attention, the dense MLPs, the routed and shared experts and the MTP
layer is quantized; the routers and the output layer stay in float (as for Llama).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import load_model, save_model
from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.gpt_oss_hf import MEGATRON_GPT_OSS_YARN
from mg.core.models.presets import tiny_gemma3
from mg.core.quantization import Int8WeightOnlyLinear
from mg.core.testing.botchan_training import train_on_botchan
from mg.quantize_export import cli

SEQ = 32
FAMILIES = ("deepseek_v3", "gpt_oss", "gemma3")


def _config(family: str, vocab_size: int) -> TransformerConfig:
    common = dict(
        vocab_size=vocab_size,
        seq_length=SEQ,
        max_position_embeddings=64,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    if family == "gemma3":
        return tiny_gemma3(**common)
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm")
    shape |= dict(untie_embeddings_and_output_weights=True, num_moe_experts=4, **common)
    if family == "deepseek_v3":
        return TransformerConfig(
            **shape,
            position_embedding_type="rope",
            activation="swiglu",
            ffn_hidden_size=96,
            add_bias_linear=False,
            multi_latent_attention=True,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_head_dim=16,
            qk_pos_emb_head_dim=16,
            v_head_dim=16,
            qk_layernorm=True,
            rope_type="yarn",
            rotary_scaling_factor=4.0,
            original_max_position_embeddings=16,
            mscale=1.0,
            mscale_all_dim=1.0,
            moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=32,
            moe_layer_freq=[0, 1],
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=2.5,
            mtp_num_layers=1,
        )
    yarn = {**MEGATRON_GPT_OSS_YARN, "original_max_position_embeddings": 16}
    return TransformerConfig(
        **shape,
        **yarn,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=64,
        add_bias_linear=True,
        softmax_type="learnable",
        window_size=(7, 0),
        window_attn_skip_freq=2,
        activation="quick_geglu",
        glu_linear_offset=1.0,
        activation_func_clamp_value=7.0,
        moe_ffn_hidden_size=64,
        moe_router_topk=2,
    )


def quantize(capsys, *argv: str) -> tuple[int, str]:
    try:
        cli.main(["--no-progress", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module", params=FAMILIES)
def untrained(request, tokenizer_config, tmp_path_factory) -> tuple[str, Path]:
    """A small-vocabulary checkpoint of the family (the exports refuse before any data)."""
    torch.manual_seed(0)
    config = _config(request.param, 128)
    folder = tmp_path_factory.mktemp(request.param)
    save_model(folder, GPTModel(config), config, tokenizer_config)
    return request.param, folder


FAMILY_NAMES = {"deepseek_v3": "DeepSeek-V3", "gpt_oss": "gpt-oss", "gemma3": "Gemma 3"}


@pytest.mark.parametrize("fmt", ["hf", "gguf", "trtllm"])
def test_exports_refuse_each_family_by_name(untrained, fmt, tmp_path, capsys) -> None:
    family, ckpt = untrained
    save = tmp_path / "q"
    code, err = quantize(
        capsys, "--load", str(ckpt), "--save", str(save), "--recipe", "int8_wo",
        "--export-format", fmt,
    )  # fmt: skip
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--export-format {fmt}: a {FAMILY_NAMES[family]} model" in err, err
    assert not save.exists()


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, tokenizer, tokenizer_config, tmp_path_factory) -> tuple[str, Path]:
    """The family at the GPT-2 vocabulary, a few steps on Botchan (held-out data fits)."""
    torch.manual_seed(0)
    config = _config(request.param, 50304)
    model = train_on_botchan(
        GPTModel(config), tokenizer, steps=8, window=SEQ, batch_size=4, text_end=60000
    )
    folder = tmp_path_factory.mktemp(request.param)
    save_model(folder, model, config, tokenizer_config)
    return request.param, folder


def test_int8_quantize_evaluate_and_serve(trained, datasets, tmp_path, capsys) -> None:
    serving = pytest.importorskip("mg.generate_server.loading")
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.runner import ModelRunner
    from mg.generate_server.sampling import SamplingParams

    family, ckpt = trained
    _, heldout = datasets
    save, report = tmp_path / "q", tmp_path / "report.json"
    code, err = quantize(
        capsys, "--load", str(ckpt), "--save", str(save), "--recipe", "int8_wo",
        "--eval-data-path", heldout, "--eval-samples", "8", "--report", str(report),
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(report.read_text())
    assert abs(data["ppl_change_pct"]) < 1, data
    assert data["same_top_token_pct"] > 95, data
    assert data["size_after_bytes"] < data["size_before_bytes"]

    model, config, _, _ = load_model(save)
    quantized = {n for n, m in model.named_modules() if isinstance(m, Int8WeightOnlyLinear)}
    assert len(quantized) == data["quantized_linears"]
    assert not any("router" in n or n == "output_layer" for n in quantized)
    layer = model.decoder.layers[-1]  # an MoE layer in each MoE family
    if family == "deepseek_v3":
        attention = layer.self_attention
        assert {"linear_q_down_proj", "linear_kv_up_proj"} <= {
            n for n, m in attention.named_children() if isinstance(m, Int8WeightOnlyLinear)
        }
        assert isinstance(layer.mlp.shared_experts.linear_fc1, Int8WeightOnlyLinear)
        assert any(n.startswith("mtp.") for n in quantized)
    if family != "gemma3":
        expert = layer.mlp.experts.local_experts[0]
        assert isinstance(expert.linear_fc2, Int8WeightOnlyLinear)
    if family == "gpt_oss":
        assert expert.linear_fc1.bias is not None
        assert layer.self_attention.core_attention.softmax_offset is not None

    loaded = serving.load_for_serving(save)
    prompt = loaded.tokenizer.tokenize("The school was a long way from")
    ids = list(prompt)
    with torch.no_grad():  # the reloaded quantized model's own greedy choice, whole forward
        for _ in range(6):
            ids.append(int(loaded.model(torch.tensor([ids]))[0, -1].argmax()))
    runner = ModelRunner(loaded.model, 2, 64, block_size=4)
    engine = GenerationEngine(
        runner, loaded.tokenizer.detokenize, loaded.tokenizer.vocab_size, max_num_batched_tokens=5
    )
    try:
        events = engine.generate(prompt, SamplingParams(max_new_tokens=6, greedy=True))
    finally:
        engine.shutdown()
    assert [e.choice.token for e in events if e.choice is not None] == ids[len(prompt) :]


@pytest.mark.parametrize("recipe", ["int4_awq", "int8_sq", "fp8"])
def test_calibration_reaches_the_mtp_layer_and_spares_an_unrouted_expert(recipe) -> None:
    """DeepSeek-V3's MTP layer runs in calibration (given labels), and an expert the router
    never picks (its expert bias far below the others) is quantized without statistics:
    plain int4, no smoothing, or its layer's largest expert input amax (fp8)."""
    from mg.core.quantization import Fp8Linear
    from mg.quantize_export.recipes import RecipeOptions, quantize_model

    torch.manual_seed(0)
    model = GPTModel(_config("deepseek_v3", 128)).eval()
    for router in (m for n, m in model.named_modules() if n.endswith("router")):
        router.expert_bias[3] = -1e4
    samples = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))
    options = RecipeOptions(recipe=recipe, group_size=32, progress=False)
    result = quantize_model(model, options, samples)
    assert any(name.startswith("mtp.") for name in result.config.modules)
    assert all(err < 0.2 for err in result.weight_error.values()), result.weight_error
    experts = model.decoder.layers[1].mlp.experts.local_experts
    if recipe == "fp8":
        unrouted, routed = experts[3].linear_fc1, [e.linear_fc1 for e in experts[:3]]
        assert isinstance(unrouted, Fp8Linear)
        assert float(unrouted.input_scale) == max(float(e.input_scale) for e in routed)
        mtp_proj = model.mtp.layers[0].eh_proj
        assert float(mtp_proj.input_scale) > 1e-6  # calibrated: the MTP layer ran
    with torch.no_grad():
        assert torch.isfinite(model(samples)).all()
