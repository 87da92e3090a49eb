"""Hugging Face ↔ Megatron-Core names and layouts for the GPT family, as data.

One `HFArchitecture` table per HF `model_type` lists which HF tensors make each
Megatron tensor and how (`layout`). The functions below only interpret the
tables, so another architecture (Qwen2, Mixtral with an `{e}` expert index) is
one more table, not more code paths. Both directions are exact: no arithmetic,
only transposes, concatenations and row permutations, so a round trip
reproduces every tensor bit for bit.

Layouts:
  "copy"     same tensor (transposed first with `transpose=True`: GPT-2's
             Conv1D stores weights as [in, out], nn.Linear as [out, in]).
  "qkv"      HF (q, k, v) separately, or one [q; k; v] stack (GPT-2 c_attn)
             ↔ Megatron's fused linear_qkv, interleaved per query group:
             [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...].
  "gate_up"  HF (gate, up) ↔ Megatron's linear_fc1 = [gate; up].

Rules whose HF tensors are all absent are skipped (optional biases); a rule
with some of its tensors present is an error, and so is any tensor that no
rule consumes, so a silent partial conversion cannot happen. Vocabulary
padding (Megatron's padded vocab vs HF's) is left to the converter.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mg.core.models.bert import bert_config_from_hf
from mg.core.models.config import RopeScaling, TransformerConfig
from mg.core.models.deepseek_v3_hf import (
    DEEPSEEK_V3_CLASS,
    DEEPSEEK_V3_TYPE,
    deepseek_v3_config_from_hf,
    deepseek_v3_config_to_hf,
)
from mg.core.models.gemma3_hf import (
    GEMMA3_CLASS,
    GEMMA3_TYPE,
    gemma3_config_from_hf,
    gemma3_config_to_hf,
)
from mg.core.models.gpt_oss_hf import (
    GPT_OSS_CLASS,
    GPT_OSS_TYPE,
    gpt_oss_config_from_hf,
    gpt_oss_config_to_hf,
    pack_experts,
    unpack_experts,
)
from mg.core.models.hf_config_fields import decoder_shape
from mg.core.models.te_spec import te_spec_name

# Weight tables ---------------------------------------------------------------


@dataclass(frozen=True)
class WeightRule:
    """One Megatron tensor and the HF tensors it is made of. `{i}` is the layer index."""

    megatron: str
    hf: tuple[str, ...]
    layout: str = "copy"
    transpose: bool = False


@dataclass(frozen=True)
class HFArchitecture:
    model_type: str
    hf_class: str
    rules: tuple[WeightRule, ...]
    base_model_prefix: str
    """Prefix of the base model's keys ("transformer." / "model."). Checkpoints
    saved from the base class (the original openai-community/gpt2 files) lack
    it; `hf_to_megatron` adds it back."""
    ignored_hf: tuple[str, ...] = ()
    """Regexes of HF state-dict keys that are buffers, not weights."""
    head_prefixes: tuple[str, ...] = ("lm_head.",)
    """Keys outside the base model (never given `base_model_prefix`)."""
    tied_output_hf: str = "lm_head.weight"
    """The HF output weight that is only a copy of the embeddings when tied."""
    zero_centered_norms: bool = False
    """HF stores the norms as gamma - 1 itself (Gemma's x·(1 + w)), as Megatron's
    `--apply-layernorm-1p` does: the norm weights are copied without the +1."""
    unpack_hf: Callable[[dict[str, Tensor], TransformerConfig], dict[str, Tensor]] | None = None
    """HF tensors → the names the rules read, before them (gpt-oss's stacked experts)."""
    pack_hf: Callable[[dict[str, Tensor], TransformerConfig], dict[str, Tensor]] | None = None
    """The rules' HF tensors → the file's, after them (the inverse of `unpack_hf`)."""
    mtp_rules: tuple[WeightRule, ...] = ()
    """A multi-token prediction depth's own tensors (`{k}` its depth, `{n}` its HF layer,
    num_layers + k, as DeepSeek-V3 stores them); its transformer layer takes the decoder
    layers' rules. Empty: the architecture has no MTP layers."""


def _rule(megatron: str, *hf: str, layout: str = "copy", transpose: bool = False) -> WeightRule:
    return WeightRule(megatron, tuple(hf), layout, transpose)


_L = "decoder.layers.{i}."

GPT2 = HFArchitecture(
    model_type="gpt2",
    hf_class="GPT2LMHeadModel",
    base_model_prefix="transformer.",
    rules=(
        _rule("embedding.word_embeddings.weight", "transformer.wte.weight"),
        _rule("embedding.position_embeddings.weight", "transformer.wpe.weight"),
        *(
            rule
            for part in ("weight", "bias")
            for rule in (
                _rule(_L + f"input_layernorm.{part}", f"transformer.h.{{i}}.ln_1.{part}"),
                _rule(
                    _L + f"self_attention.linear_qkv.{part}",
                    f"transformer.h.{{i}}.attn.c_attn.{part}",
                    layout="qkv",
                    transpose=part == "weight",
                ),
                _rule(
                    _L + f"self_attention.linear_proj.{part}",
                    f"transformer.h.{{i}}.attn.c_proj.{part}",
                    transpose=part == "weight",
                ),
                _rule(_L + f"pre_mlp_layernorm.{part}", f"transformer.h.{{i}}.ln_2.{part}"),
                _rule(
                    _L + f"mlp.linear_fc1.{part}",
                    f"transformer.h.{{i}}.mlp.c_fc.{part}",
                    transpose=part == "weight",
                ),
                _rule(
                    _L + f"mlp.linear_fc2.{part}",
                    f"transformer.h.{{i}}.mlp.c_proj.{part}",
                    transpose=part == "weight",
                ),
                _rule(f"decoder.final_layernorm.{part}", f"transformer.ln_f.{part}"),
            )
        ),
        _rule("output_layer.weight", "lm_head.weight"),
    ),
    ignored_hf=(r"\.attn\.bias$", r"\.attn\.masked_bias$"),
)

_H = "model.layers.{i}."

LLAMA = HFArchitecture(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    base_model_prefix="model.",
    rules=(
        _rule("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        _rule(_L + "input_layernorm.weight", _H + "input_layernorm.weight"),
        *(
            rule
            for part in ("weight", "bias")  # biases: Llama attention_bias/mlp_bias, Qwen2
            for rule in (
                _rule(
                    _L + f"self_attention.linear_qkv.{part}",
                    _H + f"self_attn.q_proj.{part}",
                    _H + f"self_attn.k_proj.{part}",
                    _H + f"self_attn.v_proj.{part}",
                    layout="qkv",
                ),
                _rule(_L + f"self_attention.linear_proj.{part}", _H + f"self_attn.o_proj.{part}"),
                _rule(
                    _L + f"mlp.linear_fc1.{part}",
                    _H + f"mlp.gate_proj.{part}",
                    _H + f"mlp.up_proj.{part}",
                    layout="gate_up",
                ),
                _rule(_L + f"mlp.linear_fc2.{part}", _H + f"mlp.down_proj.{part}"),
            )
        ),
        _rule(_L + "pre_mlp_layernorm.weight", _H + "post_attention_layernorm.weight"),
        _rule("decoder.final_layernorm.weight", "model.norm.weight"),
        _rule("output_layer.weight", "lm_head.weight"),
    ),
    ignored_hf=(r"\.rotary_emb\.inv_freq$",),
)

MISTRAL = dataclasses.replace(LLAMA, model_type="mistral", hf_class="MistralForCausalLM")
# Qwen2/Qwen2.5: Llama's layer with biases on q/k/v only (Megatron's --add-qkv-bias).
QWEN2 = dataclasses.replace(LLAMA, model_type="qwen2", hf_class="Qwen2ForCausalLM")
# Qwen3 (dense): Llama's layer with per-head RMSNorms of queries and keys (--qk-layernorm).
QWEN3 = dataclasses.replace(
    LLAMA,
    model_type="qwen3",
    hf_class="Qwen3ForCausalLM",
    rules=(
        *LLAMA.rules,
        _rule(_L + "self_attention.q_layernorm.weight", _H + "self_attn.q_norm.weight"),
        _rule(_L + "self_attention.k_layernorm.weight", _H + "self_attn.k_norm.weight"),
    ),
)

# Gemma 3 (text): Qwen3's attention (q/k norms) and Llama's MLP, sandwich norms, and
# zero-centred norm weights stored as they are (see mg.core.models.gemma3_hf).
GEMMA3 = HFArchitecture(
    model_type=GEMMA3_TYPE,
    hf_class=GEMMA3_CLASS,
    base_model_prefix="model.",
    zero_centered_norms=True,
    rules=(
        *(r for r in QWEN3.rules if r.megatron != _L + "pre_mlp_layernorm.weight"),
        _rule(_L + "post_self_attn_layernorm.weight", _H + "post_attention_layernorm.weight"),
        _rule(_L + "pre_mlp_layernorm.weight", _H + "pre_feedforward_layernorm.weight"),
        _rule(_L + "post_mlp_layernorm.weight", _H + "post_feedforward_layernorm.weight"),
    ),
    ignored_hf=(r"\.rotary_emb\.", r"\.embed_scale$"),
)

_E = "encoder.layers.{i}."
_B = "bert.encoder.layer.{i}."

# Post-LN BertModel (`transformer_layer_order="post_ln"`) ↔ BertForPreTraining. A
# BertModel / BertForMaskedLM file holds a subset (no `cls.` heads / no pooler):
# the rules of absent tensors are skipped, so the same table reads all three.
BERT = HFArchitecture(
    model_type="bert",
    hf_class="BertForPreTraining",
    base_model_prefix="bert.",
    head_prefixes=("cls.",),
    tied_output_hf="cls.predictions.decoder.weight",
    rules=(
        _rule("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
        _rule("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
        _rule(
            "embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"
        ),
        *(
            rule
            for part in ("weight", "bias")
            for rule in (
                _rule(f"embedding.layernorm.{part}", f"bert.embeddings.LayerNorm.{part}"),
                _rule(
                    _E + f"self_attention.linear_qkv.{part}",
                    _B + f"attention.self.query.{part}",
                    _B + f"attention.self.key.{part}",
                    _B + f"attention.self.value.{part}",
                    layout="qkv",
                ),
                _rule(
                    _E + f"self_attention.linear_proj.{part}", _B + f"attention.output.dense.{part}"
                ),
                _rule(
                    _E + f"post_attention_layernorm.{part}",
                    _B + f"attention.output.LayerNorm.{part}",
                ),
                _rule(_E + f"mlp.linear_fc1.{part}", _B + f"intermediate.dense.{part}"),
                _rule(_E + f"mlp.linear_fc2.{part}", _B + f"output.dense.{part}"),
                _rule(_E + f"post_mlp_layernorm.{part}", _B + f"output.LayerNorm.{part}"),
                _rule(f"pooler.dense.{part}", f"bert.pooler.dense.{part}"),
                _rule(f"lm_head.dense.{part}", f"cls.predictions.transform.dense.{part}"),
                _rule(f"lm_head.layer_norm.{part}", f"cls.predictions.transform.LayerNorm.{part}"),
                _rule(f"binary_head.{part}", f"cls.seq_relationship.{part}"),
            )
        ),
        _rule("output_layer.bias", "cls.predictions.bias"),
        _rule("output_layer.weight", "cls.predictions.decoder.weight"),
    ),
    # decoder.bias is tied to cls.predictions.bias; position_ids is a buffer
    ignored_hf=(r"^cls\.predictions\.decoder\.bias$", r"\.position_ids$"),
)

# Mixture-of-experts families: the dense table's attention (and its MLP rules for the
# dense layers), plus the router and `{e}`-indexed experts on the MoE layers, named as
# the checkpoints on disk name them (transformers 5 fuses the experts in memory but
# saves them one by one).
_EXPERT = _L + "mlp.experts.local_experts.{e}."
_DENSE_ATTENTION = tuple(r for r in LLAMA.rules if ".mlp." not in r.megatron)
MIXTRAL = dataclasses.replace(
    MISTRAL,
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    rules=(
        *_DENSE_ATTENTION,
        _rule(_L + "mlp.router.weight", _H + "block_sparse_moe.gate.weight"),
        _rule(
            _EXPERT + "linear_fc1.weight",
            _H + "block_sparse_moe.experts.{e}.w1.weight",
            _H + "block_sparse_moe.experts.{e}.w3.weight",
            layout="gate_up",
        ),
        _rule(_EXPERT + "linear_fc2.weight", _H + "block_sparse_moe.experts.{e}.w2.weight"),
    ),
)
_QWEN_EXPERTS = (
    _rule(_L + "mlp.router.weight", _H + "mlp.gate.weight"),
    _rule(
        _EXPERT + "linear_fc1.weight",
        _H + "mlp.experts.{e}.gate_proj.weight",
        _H + "mlp.experts.{e}.up_proj.weight",
        layout="gate_up",
    ),
    _rule(_EXPERT + "linear_fc2.weight", _H + "mlp.experts.{e}.down_proj.weight"),
)
QWEN3_MOE = dataclasses.replace(
    QWEN3,
    model_type="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    rules=(*QWEN3.rules, *_QWEN_EXPERTS),
)
QWEN2_MOE = dataclasses.replace(
    QWEN2,
    model_type="qwen2_moe",
    hf_class="Qwen2MoeForCausalLM",
    rules=(
        *QWEN2.rules,
        *_QWEN_EXPERTS,
        _rule(
            _L + "mlp.shared_experts.linear_fc1.weight",
            _H + "mlp.shared_expert.gate_proj.weight",
            _H + "mlp.shared_expert.up_proj.weight",
            layout="gate_up",
        ),
        _rule(
            _L + "mlp.shared_experts.linear_fc2.weight", _H + "mlp.shared_expert.down_proj.weight"
        ),
        _rule(_L + "mlp.shared_experts.gate_weight", _H + "mlp.shared_expert_gate.weight"),
    ),
)

# gpt-oss: Llama's attention with biases and per-head sinks, a biased router, biased
# experts; the experts read through per-expert names (see mg.core.models.gpt_oss_hf).
GPT_OSS = HFArchitecture(
    model_type=GPT_OSS_TYPE,
    hf_class=GPT_OSS_CLASS,
    base_model_prefix="model.",
    unpack_hf=unpack_experts,
    pack_hf=pack_experts,
    rules=(
        *_DENSE_ATTENTION,
        _rule(_L + "self_attention.core_attention.softmax_offset", _H + "self_attn.sinks"),
        _rule(_L + "mlp.router.weight", _H + "mlp.router.weight"),
        _rule(_L + "mlp.router.bias", _H + "mlp.router.bias"),
        *(
            rule
            for part in ("weight", "bias")
            for rule in (
                _rule(
                    _EXPERT + f"linear_fc1.{part}",
                    _H + f"mlp.experts.{{e}}.gate_proj.{part}",
                    _H + f"mlp.experts.{{e}}.up_proj.{part}",
                    layout="gate_up",
                ),
                _rule(_EXPERT + f"linear_fc2.{part}", _H + f"mlp.experts.{{e}}.down_proj.{part}"),
            )
        ),
    ),
    ignored_hf=(r"\.rotary_emb\.",),
)

# DeepSeek-V3: multi-latent attention (either query form), dense MLPs on the first
# layers, then a sigmoid router with its score-correction bias (Megatron's expert_bias),
# per-expert weights as saved and the shared experts (see mg.core.models.deepseek_v3_hf).
_MLA = _L + "self_attention."
_MLA_HF = _H + "self_attn."
DEEPSEEK_V3 = HFArchitecture(
    model_type=DEEPSEEK_V3_TYPE,
    hf_class=DEEPSEEK_V3_CLASS,
    base_model_prefix="model.",
    rules=(
        *(r for r in LLAMA.rules if ".self_attention." not in r.megatron),
        _rule(_MLA + "linear_q_proj.weight", _MLA_HF + "q_proj.weight"),
        _rule(_MLA + "linear_q_down_proj.weight", _MLA_HF + "q_a_proj.weight"),
        _rule(_MLA + "q_layernorm.weight", _MLA_HF + "q_a_layernorm.weight"),
        _rule(_MLA + "linear_q_up_proj.weight", _MLA_HF + "q_b_proj.weight"),
        _rule(_MLA + "linear_kv_down_proj.weight", _MLA_HF + "kv_a_proj_with_mqa.weight"),
        _rule(_MLA + "kv_layernorm.weight", _MLA_HF + "kv_a_layernorm.weight"),
        _rule(_MLA + "linear_kv_up_proj.weight", _MLA_HF + "kv_b_proj.weight"),
        _rule(_MLA + "linear_proj.weight", _MLA_HF + "o_proj.weight"),
        *_QWEN_EXPERTS,
        _rule(_L + "mlp.router.expert_bias", _H + "mlp.gate.e_score_correction_bias"),
        _rule(
            _L + "mlp.shared_experts.linear_fc1.weight",
            _H + "mlp.shared_experts.gate_proj.weight",
            _H + "mlp.shared_experts.up_proj.weight",
            layout="gate_up",
        ),
        _rule(
            _L + "mlp.shared_experts.linear_fc2.weight", _H + "mlp.shared_experts.down_proj.weight"
        ),
    ),
    # the released model's MTP layer (model.layers.{num_layers + k}); its embed_tokens and
    # shared_head.head are copies of the shared embedding and output layer, not read
    mtp_rules=(
        _rule("mtp.layers.{k}.enorm.weight", "model.layers.{n}.enorm.weight"),
        _rule("mtp.layers.{k}.hnorm.weight", "model.layers.{n}.hnorm.weight"),
        _rule("mtp.layers.{k}.eh_proj.weight", "model.layers.{n}.eh_proj.weight"),
        _rule("mtp.layers.{k}.final_layernorm.weight", "model.layers.{n}.shared_head.norm.weight"),
    ),
    ignored_hf=(
        r"\.rotary_emb\.",
        r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$",
    ),
)

UNSUPPORTED_MODEL_TYPES: dict[str, str] = {}

ARCHITECTURES: dict[str, HFArchitecture] = {
    a.model_type: a
    for a in (
        GPT2,
        LLAMA,
        MISTRAL,
        QWEN2,
        QWEN3,
        MIXTRAL,
        QWEN3_MOE,
        QWEN2_MOE,
        BERT,
        GEMMA3,
        GPT_OSS,
        DEEPSEEK_V3,
    )
}


def get_architecture(arch: HFArchitecture | str) -> HFArchitecture:
    if isinstance(arch, HFArchitecture):
        return arch
    if arch in UNSUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {arch!r}: not supported yet ({UNSUPPORTED_MODEL_TYPES[arch]})"
        )
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(
            f"no HF mapping for model_type {arch!r}; known: {sorted(ARCHITECTURES)}"
        ) from None


# Layout transforms -------------------------------------------------------------


def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, config: TransformerConfig) -> Tensor:
    """Separate q [heads·d, ...], k, v [groups·d, ...] → Megatron's per-group fused
    layout. Works for weights (trailing `hidden` dim) and biases alike."""
    groups, d = config.num_query_groups, config.kv_channels
    rest = q.shape[1:]
    parts = (
        q.reshape(groups, -1, *rest),  # [groups, heads_per_group·d, ...]
        k.reshape(groups, d, *rest),
        v.reshape(groups, d, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def split_qkv(fused: Tensor, config: TransformerConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `interleave_qkv`."""
    groups, d = config.num_query_groups, config.kv_channels
    heads_per_group = config.num_attention_heads // groups
    rest = fused.shape[1:]
    per_group = fused.reshape(groups, (heads_per_group + 2) * d, *rest)
    q, k, v = per_group.split([heads_per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _to_megatron(rule: WeightRule, sources: list[Tensor], config: TransformerConfig) -> Tensor:
    if rule.transpose:
        sources = [t.t() for t in sources]
    if rule.layout == "copy":
        (tensor,) = sources
        return tensor.contiguous()
    if rule.layout == "qkv":
        if len(sources) == 1:  # one [q; k; v] stack
            sizes = [config.query_projection_size] + [config.kv_projection_size] * 2
            sources = list(sources[0].split(sizes, dim=0))
        return interleave_qkv(*sources, config)
    if rule.layout == "gate_up":
        return torch.cat(sources, dim=0).contiguous()
    raise ValueError(f"unknown layout {rule.layout!r} in rule for {rule.megatron}")


def _to_hf(rule: WeightRule, tensor: Tensor, config: TransformerConfig) -> list[Tensor]:
    if rule.layout == "copy":
        parts = [tensor]
    elif rule.layout == "qkv":
        parts = list(split_qkv(tensor, config))
        if len(rule.hf) == 1:
            parts = [torch.cat(parts, dim=0)]
    elif rule.layout == "gate_up":
        parts = list(tensor.chunk(2, dim=0))
    else:
        raise ValueError(f"unknown layout {rule.layout!r} in rule for {rule.megatron}")
    if rule.transpose:
        parts = [t.t() for t in parts]
    return [t.contiguous() for t in parts]


# State-dict conversion -----------------------------------------------------------


def _expanded_rules(arch: HFArchitecture, config: TransformerConfig):
    """Yield (megatron_name, hf_names, rule) with `{i}` filled for every layer.

    With tied embeddings the output_layer rule is dropped: the model has no such
    parameter, and HF's lm_head.weight is then only the tied copy.
    """
    moe_layers = config.moe_layer_pattern
    for rule in arch.rules:
        if rule.megatron == "output_layer.weight" and not (
            config.untie_embeddings_and_output_weights
        ):
            continue
        moe_rule = any(part in rule.megatron for part in _MOE_PARTS)
        dense_mlp_rule = ".mlp." in rule.megatron and not moe_rule
        layers = range(config.num_layers) if "{i}" in rule.megatron else [None]
        for i in layers:
            # an MoE layer has a router and experts in place of the dense MLP
            if i is not None and (
                (moe_rule and not moe_layers[i]) or (dense_mlp_rule and moe_layers[i])
            ):
                continue
            experts = range(config.num_moe_experts) if "{e}" in rule.megatron else [None]
            for e in experts:
                name = rule.megatron.format(i=i, e=e)
                if config.moe_grouped_gemm:  # TE's names: experts.linear_fc1.weight{e}
                    name = _GROUPED_NAME.sub(r"experts.\2.\3\1", name)
                yield name, tuple(n.format(i=i, e=e) for n in rule.hf), rule
    if arch.mtp_rules and config.mtp_num_layers:
        yield from _expanded_mtp_rules(arch, config)


def _expanded_mtp_rules(arch: HFArchitecture, config: TransformerConfig):
    """The MTP depths' rules: depth k is HF layer n = num_layers + k, its transformer layer
    mapped as a decoder layer of the last layer's kind (dense or MoE), then its own."""
    moe = config.moe_layer_pattern[-1]
    prefix = _L.format(i="{i}")
    for k in range(config.mtp_num_layers):
        n = config.num_layers + k
        for rule in arch.rules:
            if not rule.megatron.startswith(prefix):
                continue
            moe_rule = any(part in rule.megatron for part in _MOE_PARTS)
            if moe_rule != moe and ".mlp." in rule.megatron:
                continue
            layer = f"mtp.layers.{k}.transformer_layer." + rule.megatron[len(prefix) :]
            experts = range(config.num_moe_experts) if "{e}" in rule.megatron else [None]
            for e in experts:
                name = layer.format(e=e)
                if config.moe_grouped_gemm:
                    name = _GROUPED_NAME.sub(r"experts.\2.\3\1", name)
                yield name, tuple(h.format(i=n, e=e) for h in rule.hf), rule
        for rule in arch.mtp_rules:
            hf = tuple(h.format(n=n) for h in rule.hf)
            yield rule.megatron.format(k=k), hf, rule


_MOE_PARTS = (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")
_GROUPED_NAME = re.compile(r"experts\.local_experts\.(\d+)\.(linear_fc\d)\.(weight|bias)$")


def hf_to_megatron(
    hf_state: Mapping[str, Tensor], config: TransformerConfig, arch: HFArchitecture | str
) -> dict[str, Tensor]:
    """HF state dict (e.g. `LlamaForCausalLM.state_dict()` or its safetensors) →
    Megatron-Core / `GPTModel` state dict."""
    arch = get_architecture(arch)
    prefix = arch.base_model_prefix
    if not any(name.startswith(prefix) for name in hf_state):
        hf_state = {
            name if name.startswith(arch.head_prefixes) else prefix + name: tensor
            for name, tensor in hf_state.items()
        }
    if arch.unpack_hf is not None:
        hf_state = arch.unpack_hf(dict(hf_state), config)
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for megatron_name, hf_names, rule in _expanded_rules(arch, config):
        present = [name in hf_state for name in hf_names]
        if not any(present):
            continue
        if not all(present):
            missing = [n for n, p in zip(hf_names, present, strict=True) if not p]
            raise KeyError(f"{megatron_name} needs {list(hf_names)}, but {missing} are missing")
        out[megatron_name] = _to_megatron(rule, [hf_state[n] for n in hf_names], config)
        used.update(hf_names)
    tied_copy = {arch.tied_output_hf} if not config.untie_embeddings_and_output_weights else set()
    leftover = sorted(
        name
        for name in hf_state
        if name not in used
        and name not in tied_copy
        and not any(re.search(p, name) for p in arch.ignored_hf)
    )
    if leftover:
        raise KeyError(
            f"{len(leftover)} HF tensors have no Megatron counterpart for model_type "
            f"{arch.model_type!r} with this config (wrong architecture or num_layers?): "
            f"{leftover[:8]}"
        )
    return out


def megatron_to_hf(
    megatron_state: Mapping[str, Tensor], config: TransformerConfig, arch: HFArchitecture | str
) -> dict[str, Tensor]:
    """Megatron-Core / `GPTModel` state dict → HF state dict, as `save_pretrained`
    writes it (with tied embeddings, no separate lm_head.weight). The norms may carry
    the Transformer Engine spec's fused names (`linear_qkv.layer_norm_weight`)."""
    arch = get_architecture(arch)
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for local_name, hf_names, rule in _expanded_rules(arch, config):
        megatron_name = local_name
        if local_name not in megatron_state:
            megatron_name = te_spec_name(local_name)
        if megatron_name not in megatron_state:
            continue
        tensor = megatron_state[megatron_name]
        if (
            config.layernorm_zero_centered_gamma
            and not arch.zero_centered_norms
            and local_name.endswith("layernorm.weight")
        ):
            tensor = tensor + 1  # --apply-layernorm-1p stores gamma - 1; HF norms take gamma
        parts = _to_hf(rule, tensor, config)
        out.update(zip(hf_names, parts, strict=True))
        used.add(megatron_name)
    leftover = sorted(
        name for name in megatron_state if name not in used and not name.endswith("_extra_state")
    )
    if leftover:
        raise KeyError(
            f"{len(leftover)} Megatron tensors have no HF counterpart for model_type "
            f"{arch.model_type!r}: {leftover[:8]}"
        )
    return out if arch.pack_hf is None else arch.pack_hf(out, config)


# Configs -------------------------------------------------------------------------

_GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}


def _as_dict(hf_config: Any) -> dict[str, Any]:
    return dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()


def _rope_from_hf(c: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read RoPE settings from either transformers 5 (`rope_parameters`) or 4
    (`rope_theta` + `rope_scaling`) style configs."""
    params = dict(c.get("rope_parameters") or {})
    if not params:
        params = dict(c.get("rope_scaling") or {})
        params.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(params["rope_theta"]), None
    if rope_type == "llama3":
        return float(params["rope_theta"]), RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"RoPE type {rope_type!r} is not supported (only 'default' and 'llama3')")


def config_from_hf(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """HF config (a `PretrainedConfig` or a config.json dict) → `TransformerConfig`.

    The vocabulary is taken as is (no Megatron padding) and seq_length is set to
    max_position_embeddings; pass overrides to change either.
    """
    c = _as_dict(hf_config)
    model_type = c.get("model_type")
    if model_type in UNSUPPORTED_MODEL_TYPES:
        get_architecture(model_type)  # raises "not supported yet (...)"
    if model_type == "bert":
        config = bert_config_from_hf(c)
        extra = dict(config.extra, hf_model_type="bert")
        return dataclasses.replace(config, **{**overrides, "extra": extra})
    if model_type == "gpt2":
        activation = c.get("activation_function", "gelu_new")
        if activation not in _GPT2_ACTIVATIONS:
            raise ValueError(f"GPT-2 activation_function {activation!r} is not supported")
        if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True):
            raise ValueError("GPT-2 attention-scaling variants are not supported")
        fields: dict[str, Any] = dict(
            num_layers=c["n_layer"],
            hidden_size=c["n_embd"],
            num_attention_heads=c["n_head"],
            ffn_hidden_size=c.get("n_inner") or 4 * c["n_embd"],
            vocab_size=c["vocab_size"],
            seq_length=c["n_positions"],
            max_position_embeddings=c["n_positions"],
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            layernorm_epsilon=c.get("layer_norm_epsilon", 1e-5),
            activation=_GPT2_ACTIVATIONS[activation],
            add_bias_linear=True,
            untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
            init_method_std=c.get("initializer_range", 0.02),
            attention_dropout=c.get("attn_pdrop", 0.1),
            hidden_dropout=c.get("resid_pdrop", 0.1),
        )
    elif model_type in ("llama", "mistral", "qwen2", "qwen3", *_MOE_BASE):
        base, model_type = model_type, _MOE_BASE.get(model_type, model_type)
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
        attention_bias, mlp_bias = c.get("attention_bias", False), c.get("mlp_bias", False)
        if model_type in ("qwen2", "qwen3") and c.get("use_sliding_window"):
            raise ValueError(
                f"{model_type} use_sliding_window (sliding attention on the layers above "
                "max_window_layers) is not supported; set it to false"
            )
        if model_type == "qwen3" and attention_bias:
            raise ValueError(
                "Qwen3 attention_bias (biases on q/k/v/o but not the MLP) cannot be expressed "
                "with Megatron's add_bias_linear / add_qkv_bias"
            )
        if model_type == "qwen2":
            attention_bias = mlp_bias = False  # Qwen2's q/k/v biases: add_qkv_bias below
        if attention_bias != mlp_bias:
            raise ValueError(
                "attention_bias != mlp_bias cannot be expressed with Megatron's "
                "add_bias_linear (it puts biases on all linear layers or none)"
            )
        rotary_base, rope_scaling = _rope_from_hf(c)
        sliding_window = c.get("sliding_window") if model_type == "mistral" else None
        fields = dict(
            **decoder_shape(c, eps=1e-6),
            rotary_base=rotary_base,
            rope_scaling=rope_scaling,
            activation="swiglu",
            add_bias_linear=bool(attention_bias),
            add_qkv_bias=model_type == "qwen2",
            qk_layernorm=model_type == "qwen3",
            untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
            window_size=(sliding_window - 1, 0) if sliding_window else None,
            init_method_std=c.get("initializer_range", 0.02),
            attention_dropout=c.get("attention_dropout", 0.0),
            hidden_dropout=0.0,
        )
        fields.update(_moe_fields_from_hf(base, c))
        model_type = base
    elif model_type == GEMMA3_TYPE:
        fields = gemma3_config_from_hf(c)
    elif model_type == GPT_OSS_TYPE:
        fields = gpt_oss_config_from_hf(c)
    elif model_type == DEEPSEEK_V3_TYPE:
        fields = deepseek_v3_config_from_hf(c)
    else:
        raise ValueError(
            f"no HF mapping for model_type {model_type!r}; known: {sorted(ARCHITECTURES)}"
        )
    fields["extra"] = {"hf_model_type": model_type}
    return TransformerConfig(**{**fields, **overrides})


_MOE_BASE = {"mixtral": "mistral", "qwen3_moe": "qwen3", "qwen2_moe": "qwen2"}
"""Each MoE family and the dense family whose attention it shares."""


def _moe_fields_from_hf(model_type: str, c: dict[str, Any]) -> dict[str, Any]:
    """Megatron's MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json (none for
    dense families). Mixtral renormalises its top-k softmax weights, which is Megatron's
    softmax over the top-k logits; Qwen's norm_topk_prob false is the pre-softmax top-k."""
    if model_type not in _MOE_BASE:
        return {}
    layers = c["num_hidden_layers"]
    if model_type == "mixtral":
        return dict(
            num_moe_experts=c["num_local_experts"],
            moe_router_topk=c["num_experts_per_tok"],
            moe_ffn_hidden_size=c["intermediate_size"],
            moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)),
        )
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    fields: dict[str, Any] = dict(
        # config.json says num_experts; transformers 5's Qwen3MoeConfig.to_dict num_local_experts
        num_moe_experts=c.get("num_experts") or c["num_local_experts"],
        moe_router_topk=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_router_pre_softmax=not c.get("norm_topk_prob", model_type == "qwen3_moe"),
        moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)),
        moe_layer_freq=[int(i not in dense and (i + 1) % step == 0) for i in range(layers)],
    )
    if model_type == "qwen2_moe":
        fields.update(
            moe_shared_expert_intermediate_size=c["shared_expert_intermediate_size"],
            moe_shared_expert_gate=True,
        )
    return fields


def _moe_config_to_hf(c: TransformerConfig, model_type: str) -> dict[str, Any]:
    """The MoE part of a Mixtral / Qwen-MoE config.json; raises for routing HF cannot run."""
    if (model_type in _MOE_BASE) != (c.num_moe_experts is not None):
        raise ValueError(
            f"model_type {model_type!r} {'needs' if model_type in _MOE_BASE else 'has no'} "
            "mixture-of-experts layers (num_moe_experts)"
        )
    if model_type not in _MOE_BASE:
        return {}
    plain_router = (
        c.moe_router_score_function == "softmax"
        and not c.moe_router_topk_scaling_factor
        and not c.moe_router_group_topk
        and c.moe_expert_capacity_factor is None
        and not c.moe_router_enable_expert_bias
    )
    shared = c.moe_shared_expert_intermediate_size
    if not plain_router or (shared is not None) != (model_type == "qwen2_moe"):
        raise ValueError(
            f"this MoE config's routing (score function, scaling, groups, capacity, expert "
            f"bias or shared experts) is not what {model_type} runs"
        )
    pattern = c.moe_layer_pattern
    common = dict(num_experts_per_tok=c.moe_router_topk, router_aux_loss_coef=c.moe_aux_loss_coeff)
    if model_type == "mixtral":
        if not all(pattern) or c.moe_router_pre_softmax:
            raise ValueError("Mixtral has MoE in every layer and renormalised top-k weights")
        return dict(
            common, num_local_experts=c.num_moe_experts, intermediate_size=c.moe_ffn_hidden_size
        )
    out = dict(
        common,
        num_experts=c.num_moe_experts,
        moe_intermediate_size=c.moe_ffn_hidden_size,
        norm_topk_prob=not c.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
    )
    if model_type == "qwen2_moe":
        if not c.moe_shared_expert_gate:
            raise ValueError("Qwen2-MoE's shared experts are gated (moe_shared_expert_gate)")
        out["shared_expert_intermediate_size"] = shared
    return out


def config_to_hf(config: TransformerConfig, arch: HFArchitecture | str) -> dict[str, Any]:
    """`TransformerConfig` → config.json dict for `arch`. Raises if the config uses
    something that HF architecture cannot express."""
    arch = get_architecture(arch)
    c = config
    if arch.model_type == GPT_OSS_TYPE:  # its MoE and layer variants are its own
        return gpt_oss_config_to_hf(c)
    if arch.model_type == DEEPSEEK_V3_TYPE:  # so are DeepSeek-V3's, and its attention
        return dict(
            architectures=[arch.hf_class],
            model_type=arch.model_type,
            vocab_size=c.vocab_size,
            tie_word_embeddings=not c.untie_embeddings_and_output_weights,
            initializer_range=c.init_method_std,
            **deepseek_v3_config_to_hf(c),
        )
    moe = _moe_config_to_hf(c, arch.model_type)
    base = _MOE_BASE.get(arch.model_type, arch.model_type)
    common = dict(
        architectures=[arch.hf_class],
        model_type=arch.model_type,
        vocab_size=c.vocab_size,
        tie_word_embeddings=not c.untie_embeddings_and_output_weights,
        initializer_range=c.init_method_std,
    )
    if arch.model_type == "bert":
        return dict(common, **_bert_config_to_hf(c))
    if arch.model_type == GEMMA3_TYPE:
        return dict(common, **gemma3_config_to_hf(c))
    variants = _layer_variants(c)
    if variants:
        raise ValueError(f"{arch.hf_class} has no {', '.join(variants)} (Gemma 3's, gpt-oss's)")
    if arch.model_type == "gpt2":
        to_hf_act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
        if (
            c.position_embedding_type != "learned_absolute"
            or c.normalization != "LayerNorm"
            or not c.add_bias_linear
            or c.activation not in to_hf_act
            or c.kv_channels * c.num_attention_heads != c.hidden_size
            or c.num_query_groups != c.num_attention_heads
            or c.window_size is not None
        ):
            raise ValueError("this config is not a GPT-2 architecture")
        return dict(
            common,
            n_layer=c.num_layers,
            n_embd=c.hidden_size,
            n_head=c.num_attention_heads,
            n_inner=c.ffn_hidden_size,
            n_positions=c.max_position_embeddings,
            layer_norm_epsilon=c.layernorm_epsilon,
            activation_function=to_hf_act[c.activation],
            attn_pdrop=c.attention_dropout,
            resid_pdrop=c.hidden_dropout,
            embd_pdrop=c.hidden_dropout,
        )
    if (
        c.position_embedding_type != "rope"
        or c.rotary_percent != 1.0
        or c.normalization != "RMSNorm"
        or c.activation != "swiglu"
        or c.add_qkv_bias != (base == "qwen2")
        or c.qk_layernorm != (base == "qwen3")
        or (c.add_bias_linear and base in ("qwen2", "qwen3"))
        or (c.window_size is not None and base != "mistral")
    ):
        raise ValueError(f"this config is not a {arch.hf_class} architecture")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": c.rotary_base}
        rope.update(dataclasses.asdict(c.rope_scaling))
    out = dict(
        common,
        num_hidden_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_query_groups,
        head_dim=c.kv_channels,
        intermediate_size=c.ffn_hidden_size,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.layernorm_epsilon,
        hidden_act="silu",
        attention_dropout=c.attention_dropout,
        # Both spellings: transformers 5 reads rope_parameters, 4 reads the others.
        rope_parameters=rope,
        rope_theta=c.rotary_base,
        rope_scaling=rope if c.rope_scaling is not None else None,
    )
    out.update(moe)
    if base == "llama":
        out.update(attention_bias=c.add_bias_linear, mlp_bias=c.add_bias_linear)
    elif base in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
        if base == "qwen3":
            out.update(attention_bias=False)
    else:
        if c.add_bias_linear:
            raise ValueError("MistralForCausalLM has no linear biases")
        out["sliding_window"] = c.window_size[0] + 1 if c.window_size is not None else None
    return out


def _layer_variants(c: TransformerConfig) -> list[str]:
    """The Gemma 3 and gpt-oss settings `c` uses, which only their own classes express."""
    set_fields = (
        "window_attn_skip_freq",
        "rotary_base_local",
        "rotary_seq_len_interpolation_factor",
        "softmax_scale",
        "attn_logit_softcapping",
    )
    names = [name for name in set_fields if getattr(c, name) is not None]
    names += [
        name for name in ("sandwich_norms", "scale_embeddings_by_sqrt_hidden") if getattr(c, name)
    ]
    # gpt-oss's pieces, which only GptOssForCausalLM expresses
    names += ["softmax_type"] if c.softmax_type != "vanilla" else []
    names += ["glu_linear_offset"] if c.glu_linear_offset else []
    names += ["activation_func_clamp_value"] if c.activation_func_clamp_value is not None else []
    return names


def _bert_config_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """BertConfig fields of a post-LN BertModel; Megatron-Core's pre-LN BERT has no HF class."""
    to_hf_act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
    if c.transformer_layer_order != "post_ln":
        raise ValueError(
            "this BERT is pre-LN (Megatron-Core's layer order); Hugging Face's BertModel is "
            "post-LN, so it cannot express it"
        )
    if (
        c.position_embedding_type != "learned_absolute"
        or c.normalization != "LayerNorm"
        or not c.add_bias_linear
        or c.activation not in to_hf_act
        or c.kv_channels * c.num_attention_heads != c.hidden_size
        or c.num_query_groups != c.num_attention_heads
    ):
        raise ValueError("this config is not a Hugging Face BERT architecture")
    return dict(
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads,
        intermediate_size=c.ffn_hidden_size,
        hidden_act=to_hf_act[c.activation],
        hidden_dropout_prob=c.hidden_dropout,
        attention_probs_dropout_prob=c.attention_dropout,
        max_position_embeddings=c.max_position_embeddings,
        type_vocab_size=c.extra.get("type_vocab_size", 2),
        layer_norm_eps=c.layernorm_epsilon,
        position_embedding_type="absolute",
    )
