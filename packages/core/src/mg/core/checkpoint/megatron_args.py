"""Megatron-LM's saved args → our model config and the state an mg checkpoint records.

Megatron-LM records its flags as an `argparse.Namespace` under ``args`` (in each
``mp_rank_*`` file of a `torch` checkpoint, in ``common.pt`` of a `torch_dist`
one); the model-shaping ones give a `TransformerConfig` (an MoE's ``moe_*`` flags
are its fields of the same name; ``pretrain_mamba.py``'s give a `MambaConfig`).
Every reader of a Megatron-LM checkpoint uses this: ``load_model`` (so mg-eval,
mg-serve and mg-quantize load a Megatron-LM `torch_dist` checkpoint as it is) and
mg-convert (``import-megatron``, ``export-hf``, ``inspect``). Problems are
:class:`MegatronArgsError` errors, which name the folder and the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mg.core.checkpoint.layout import CheckpointError
from mg.core.checkpoint.torch_format import mg_metadata
from mg.core.models import ConfigError, RopeScaling, TransformerConfig
from mg.core.models.config import MOE_DISPATCHERS
from mg.core.models.gpt_oss_hf import MEGATRON_GPT_OSS_YARN
from mg.core.models.mamba import MambaConfig
from mg.core.tokenizers.config import TokenizerConfig

_PLAIN = (str, int, float, bool, type(None))
# Megatron-LM MoE flags whose values change the model or its outputs and that mg does not
# build: a checkpoint saved with any of them on is refused rather than imported wrongly.
_MOE_UNSUPPORTED = (
    "moe_use_legacy_grouped_gemm",
    "moe_apply_probs_on_input",
    "moe_latent_size",
    "moe_router_force_load_balancing",
)
_LEGACY_GROUPED = re.compile(r"\bmlp\.experts\.weight[12]$")
_GROUPED_EXPERT = re.compile(r"\bmlp\.experts\.linear_fc[12]\.weight\d+$")
_SEQUENTIAL_EXPERT = re.compile(r"\bmlp\.experts\.local_experts\.\d+\.")
# Megatron-LM flags that move layers between pipeline stages unevenly.
_UNEVEN_PIPELINE = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
)


class MegatronArgsError(CheckpointError):
    """Megatron-LM's args describe a model mg does not build, or are not Megatron-LM's."""


def config_from_megatron_args(args: Mapping[str, Any]) -> TransformerConfig:
    """Megatron-LM's parsed flags → TransformerConfig (the fields that shape the model)."""

    def get(name: str, default: Any = None) -> Any:
        value = args.get(name, default)
        return default if value is None else value

    if get("swiglu", False):
        activation = "swiglu"
    elif get("squared_relu", False):
        activation = "squared_relu"
    elif get("openai_gelu", False):
        activation = "gelu_tanh"
    elif get("quick_geglu", False):  # gpt-oss's
        activation = "quick_geglu"
    else:
        activation = "gelu"
    position = get("position_embedding_type", "learned_absolute")
    rope_position = "rope" if position == "yarn" else position  # Megatron's YaRN RoPE
    rope_scaling = None
    if get("use_rope_scaling", False):
        rope_scaling = RopeScaling(factor=float(get("rope_scaling_factor", 8.0)))
    window = get("window_size")
    try:
        config = TransformerConfig(
            num_layers=args["num_layers"],
            hidden_size=args["hidden_size"],
            num_attention_heads=args["num_attention_heads"],
            vocab_size=args["padded_vocab_size"],
            ffn_hidden_size=get("ffn_hidden_size"),
            num_query_groups=get("num_query_groups") if get("group_query_attention") else None,
            kv_channels=get("kv_channels"),
            seq_length=get("seq_length", 1024),
            max_position_embeddings=get("max_position_embeddings"),
            position_embedding_type=rope_position,
            rotary_base=float(get("rotary_base", 10000)),
            rotary_percent=float(get("rotary_percent", 1.0)),
            rope_scaling=rope_scaling if position == "rope" else None,
            normalization=get("normalization", "LayerNorm"),
            layernorm_epsilon=float(get("norm_epsilon", get("layernorm_epsilon", 1e-5))),
            layernorm_zero_centered_gamma=bool(get("apply_layernorm_1p", False)),
            activation=activation,
            add_bias_linear=bool(get("add_bias_linear", True)),
            add_qkv_bias=bool(get("add_qkv_bias", False)),
            qk_layernorm=bool(get("qk_layernorm", False)),
            untie_embeddings_and_output_weights=bool(
                get("untie_embeddings_and_output_weights", False)
            ),
            window_size=tuple(window) if window else None,
            window_attn_skip_freq=get("window_attn_skip_freq") if window else None,
            softmax_type=get("softmax_type", "vanilla"),
            glu_linear_offset=float(get("glu_linear_offset", 0.0)),
            activation_func_clamp_value=get("activation_func_clamp_value"),
            init_method_std=float(get("init_method_std", 0.02)),
            attention_dropout=float(get("attention_dropout", 0.1)),
            hidden_dropout=float(get("hidden_dropout", 0.1)),
        )
    except KeyError as exc:
        raise MegatronArgsError(f"Megatron-LM args lack {exc.args[0]!r}") from None
    except ConfigError as exc:
        raise MegatronArgsError(f"Megatron-LM args describe an unsupported model: {exc}") from None
    mla = bool(get("multi_latent_attention", False))
    if mla:
        config = _mla_config(config, get)
    if get("enable_gpt_oss", False):  # the YaRN values Megatron's model builder sets
        config = dataclasses.replace(config, **MEGATRON_GPT_OSS_YARN)
    elif position == "yarn" or get("rope_type", "yarn" if mla else "rope") == "yarn":
        config = _yarn_config(config, get)  # (MLA's default RoPE is YaRN, as in Megatron)
    if get("num_experts"):
        config = _moe_config(config, get)
    return _mamba_config(config, get) if _is_mamba(get) else config


def _mla_config(config: TransformerConfig, get: Any) -> TransformerConfig:
    """Multi-latent attention from Megatron-LM's args (`--multi-latent-attention`,
    `--q-lora-rank`, `--kv-lora-rank`, `--qk-head-dim`, `--qk-pos-emb-head-dim`,
    `--v-head-dim`; Megatron's defaults where one is absent)."""
    q_lora_rank = get("q_lora_rank")
    try:
        return dataclasses.replace(
            config,
            multi_latent_attention=True,
            q_lora_rank=int(q_lora_rank) if q_lora_rank is not None else None,
            kv_lora_rank=int(get("kv_lora_rank", 32)),
            qk_head_dim=int(get("qk_head_dim", 128)),
            qk_pos_emb_head_dim=int(get("qk_pos_emb_head_dim", 64)),
            v_head_dim=int(get("v_head_dim", 128)),
        )
    except ConfigError as exc:
        raise MegatronArgsError(f"Megatron-LM args describe an unsupported MLA: {exc}") from None


def _yarn_config(config: TransformerConfig, get: Any) -> TransformerConfig:
    """YaRN RoPE from Megatron-LM's args (`--position-embedding-type yarn` or
    `--rope-type yarn`, with its `--rotary-scaling-factor`, `--mscale*` and `--yarn-*`)."""
    try:
        return dataclasses.replace(
            config,
            rope_type="yarn",
            rotary_scaling_factor=float(get("rotary_scaling_factor", 1.0)),
            mscale=float(get("mscale", 1.0)),
            mscale_all_dim=float(get("mscale_all_dim", 0.0)),
            original_max_position_embeddings=int(
                get("yarn_original_max_position_embeddings", 4096)
            ),
            beta_fast=float(get("yarn_beta_fast", 32.0)),
            beta_slow=float(get("yarn_beta_slow", 1.0)),
            yarn_correction_range_round_to_int=bool(
                get("yarn_correction_range_round_to_int", True)
            ),
        )
    except ConfigError as exc:
        raise MegatronArgsError(f"Megatron-LM args describe an unsupported YaRN: {exc}") from None


def _moe_config(config: TransformerConfig, get: Any) -> TransformerConfig:
    """The MoE fields of Megatron-LM's args on top of the decoder's: `num_experts` is
    `num_moe_experts`, every other one has its TransformerConfig field's name."""
    unsupported = [name for name in _MOE_UNSUPPORTED if get(name, False)]
    if unsupported:
        flags = ", ".join("--" + name.replace("_", "-") for name in unsupported)
        raise MegatronArgsError(f"Megatron-LM args: {flags} is not supported by mg's MoE layer")
    tp = int(get("tensor_model_parallel_size", 1))
    etp = get("expert_tensor_parallel_size")
    if etp is not None and int(etp) not in (1, tp):
        raise MegatronArgsError(
            f"Megatron-LM args: --expert-tensor-parallel-size {etp} differs from "
            f"--tensor-model-parallel-size {tp}; import-megatron reads experts whole (1) or "
            "split as the MLP is (expert tensor parallelism = TP). Re-save with Megatron-LM's "
            "tools/checkpoint/convert.py at TP=1 first"
        )
    dispatcher = get("moe_token_dispatcher_type", "allgather")
    fields = {f.name for f in dataclasses.fields(TransformerConfig) if f.name.startswith("moe_")}
    moe = {name: get(name) for name in fields if get(name) is not None}
    # how tokens travel to the experts does not change the model: flex (DeepEP) is all-to-all
    moe["moe_token_dispatcher_type"] = dispatcher if dispatcher in MOE_DISPATCHERS else "alltoall"
    moe["moe_grouped_gemm"] = bool(get("moe_grouped_gemm", False))
    try:
        return dataclasses.replace(config, num_moe_experts=int(get("num_experts")), **moe)
    except (ConfigError, TypeError, ValueError) as exc:
        raise MegatronArgsError(
            f"Megatron-LM args describe an unsupported MoE model: {exc}"
        ) from None


def _is_mamba(get: Any) -> bool:
    """pretrain_mamba.py's args: a Mamba layer spec, a hybrid pattern or hybrid ratios."""
    spec = " ".join(get("spec", None) or [])
    return (
        "mamba" in spec
        or bool(get("hybrid_override_pattern"))
        or float(get("hybrid_attention_ratio", 0.0)) > 0
        or float(get("hybrid_mlp_ratio", 0.0)) > 0
    )


def _mamba_config(config: TransformerConfig, get: Any) -> MambaConfig:
    """The Mamba / hybrid fields of pretrain_mamba.py's args on top of the decoder's."""
    try:
        return MambaConfig(
            **config.to_dict(),
            mamba_state_dim=int(get("mamba_state_dim", 128)),
            mamba_head_dim=int(get("mamba_head_dim", 64)),
            mamba_num_groups=int(get("mamba_num_groups", 8)),
            mamba_num_heads=get("mamba_num_heads"),
            hybrid_attention_ratio=float(get("hybrid_attention_ratio", 0.0)),
            hybrid_mlp_ratio=float(get("hybrid_mlp_ratio", 0.0)),
            hybrid_override_pattern=get("hybrid_override_pattern"),
        )
    except ConfigError as exc:
        raise MegatronArgsError(f"Megatron-LM args describe an unsupported model: {exc}") from None


def megatron_args_of(state: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """A rank file's (or common.pt's) ``args`` as a dict: Megatron-LM's Namespace, or the
    dict mg tools save."""
    raw = state.get("args")
    if raw is None:
        raise MegatronArgsError(
            f"{where}: the checkpoint has no 'args'; not written by Megatron-LM"
        )
    return vars(raw) if isinstance(raw, argparse.Namespace) else dict(raw)


def config_of_megatron(state: Mapping[str, Any], where: Path) -> TransformerConfig:
    """The model a Megatron-LM rank file's args describe; an mg checkpoint, or one split
    unevenly over its pipeline stages, is refused."""
    args = megatron_args_of(state, where)
    # Megatron-LM pickles its args Namespace (so does export-megatron); mg tools save a dict
    saved_by_mg = not isinstance(state["args"], argparse.Namespace)
    if saved_by_mg and (state.get("mg") or {}).get("model_config"):
        raise MegatronArgsError(
            f"{where} is an mg checkpoint already (it records its model config); "
            "mg tools load it as it is, and mg-convert reshard changes its layout"
        )
    uneven = [name for name in _UNEVEN_PIPELINE if args.get(name)]
    if uneven and args.get("pipeline_model_parallel_size", 1) > 1:
        raise MegatronArgsError(
            f"{where}: saved with an uneven pipeline split ({', '.join(uneven)}); "
            "import-megatron reads layers spread evenly over the stages. Re-save it with "
            "Megatron-LM's tools/checkpoint/convert.py --target-pipeline-parallel-size 1 first"
        )
    config = config_from_megatron_args(args)
    if config.num_moe_experts:
        config = _with_stored_expert_layout(config, state, where, args)
    return config


def _with_stored_expert_layout(
    config: TransformerConfig, state: Mapping[str, Any], where: Path, args: Mapping[str, Any]
) -> TransformerConfig:
    """``moe_grouped_gemm`` as the rank-0 file's expert names say (grouped GEMM's
    ``linear_fc1.weightN`` or SequentialMLP's ``local_experts.N``); where that file holds no
    expert (a first stage of dense layers), as the args say: grouped GEMM under the
    Transformer Engine spec is TEGroupedMLP, under the local spec the legacy GroupedMLP."""
    names = [name for chunk in _model_entries(state) for name in chunk]
    legacy = any(_LEGACY_GROUPED.search(name) for name in names)
    if any(_GROUPED_EXPERT.search(name) for name in names) and not legacy:
        grouped = True
    elif any(_SEQUENTIAL_EXPERT.search(name) for name in names):
        grouped = False
    elif legacy or (config.moe_grouped_gemm and args.get("transformer_impl") == "local"):
        raise MegatronArgsError(
            f"{where}: experts saved by Megatron-Core's legacy GroupedMLP (mlp.experts.weight1 "
            "/ weight2: --moe-grouped-gemm with the local spec, or "
            "--moe-use-legacy-grouped-gemm) are not supported; re-save without "
            "--moe-grouped-gemm, or with --transformer-impl transformer_engine"
        )
    else:
        grouped = config.moe_grouped_gemm
    return dataclasses.replace(config, moe_grouped_gemm=grouped)


def _model_entries(state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The model chunks of one rank file (``model``, or ``model0``, ``model1``…)."""
    return [v for k, v in state.items() if k.startswith("model") and isinstance(v, Mapping)]


def mg_state_of_megatron(
    args: Mapping[str, Any],
    config: TransformerConfig,
    tp: int,
    pp: int,
    iteration: Any,
    converted_by: str = "mg-convert import-megatron",
    ep: int = 1,
) -> dict[str, Any]:
    """What an mg checkpoint records, from Megatron-LM's args: plain-data args, the
    iteration, ``mg`` with the model and tokenizer configs."""
    tokenizer = TokenizerConfig.from_dict(dict(args)) if args.get("tokenizer_type") else None
    plain_args = {k: _plain(v) for k, v in args.items() if isinstance(v, _PLAIN + (enum.Enum,))}
    plain_args["converted_by"] = converted_by
    return {
        "args": plain_args,
        "iteration": iteration,
        "mg": mg_metadata(
            config.to_dict(), tokenizer.to_dict() if tokenizer else None, tp=tp, pp=pp, ep=ep
        ),
    }


def _plain(value: Any) -> Any:
    """An enum (``signal.SIGTERM`` is an int too) by its member's name, so the file we
    write pickles plain data only; other values as they are."""
    return value.name if isinstance(value, enum.Enum) else value


def megatron_source_state(
    common: Mapping[str, Any], folder: Path
) -> tuple[TransformerConfig, dict[str, Any], int, int]:
    """A Megatron-LM torch_dist checkpoint's common.pt → its model config, the state an mg
    checkpoint records, and the TP × PP it was saved with (its args')."""
    config = config_of_megatron(common, folder)
    args = megatron_args_of(common, folder)
    tp = int(args.get("tensor_model_parallel_size") or 1)
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    state = mg_state_of_megatron(
        args, config, tp, pp, common.get("iteration", 0), "mg-convert (Megatron-LM torch_dist)"
    )
    return config, state, tp, pp
