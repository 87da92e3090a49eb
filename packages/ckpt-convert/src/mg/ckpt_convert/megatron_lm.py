"""`mg-convert import-megatron` / `export-megatron`: Megatron-LM `torch`-format GPT checkpoints.

The weights already have Megatron-Core names (our GPTModel uses them), so the
work is the config and the layout. Megatron-LM records its flags as an
`argparse.Namespace` under ``args``; we read the model-shaping ones into a
`TransformerConfig` (:mod:`.megatron_args`) and, on export, write a Namespace
back with the same names (and ``transformer_impl``: "local", whose layer spec names match ours, or
"transformer_engine" for a model built with the TE spec's names).

Any TP × PP layout, both ways, through the code that reshards our own
checkpoints (:mod:`.checkpoint_source`, :mod:`.reshard`): the layouts are the
same. ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``; each pipeline stage
numbers its layers from 0 (virtual stages as ``model0``, ``model1``…), the last
stage of a tied model holds its own copy of the word embeddings as
``output_layer.weight``; column-parallel tensors (QKV, MLP-in, word embeddings
and output layer, padded to Megatron's padded vocabulary) are split along dim 0,
row-parallel ones (attention projection, MLP-out) along dim 1. QKV rows are
grouped per query group ([q heads; k; v] of group 0, then group 1…), so a
dim-0 split gives each rank whole groups, which is Megatron's GQA layout; a
SwiGLU MLP-in is [gate; up], and each rank holds [gate_r; up_r].

MoE checkpoints (``--num-experts``): Megatron-LM's MoE flags are Megatron-Core's
``TransformerConfig`` fields, and so ours (``num_experts`` is ``num_moe_experts``,
every ``moe_*`` flag the field of its name); export writes them back. With expert
parallelism each ``mp_rank_TT[_PPP]_EEE`` file holds the dense weights and its own
experts numbered from 0; import renumbers them to their place in the layer and
export numbers them per rank again (``--target-expert-parallel-size``). Expert
weights are split over TP as the MLP's are (expert tensor parallelism = TP,
Megatron's default; another ``--expert-tensor-parallel-size`` is refused). The
experts come in two layouts: ``sequential`` (SequentialMLP,
``local_experts.N.linear_fc1.weight``) and ``grouped`` (grouped GEMM, TEGroupedMLP's
``linear_fc1.weightN``); import keeps the checkpoint's (or ``--expert-layout``), and
export writes ``grouped`` only for a model with Transformer Engine names, since
Megatron-LM's local spec builds grouped GEMM as the legacy GroupedMLP
(``weight1``/``weight2``, which mg does not read or write); otherwise
``sequential`` with ``moe_grouped_gemm`` off in the args.

Hybrid (Mamba) checkpoints of ``pretrain_mamba.py`` give a ``MambaConfig`` (its
spec, layer pattern and ``mamba_*`` args); each mixer's TP shards are joined and cut
by core's ``tp_merge`` / ``tp_split`` (heads and groups per rank), and export writes
the args with the ``mamba_stack_spec`` and that spec's Transformer Engine names.

Checkpoints written with the Transformer Engine spec fuse the norms into the
next linear layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`);
import renames those to the local spec's `input_layernorm` / `pre_mlp_layernorm`.

Optimizer and RNG state are not carried over (their layout depends on the
parallel layout; Megatron's converter drops them too). The Namespace needs
pickle to load, so only convert checkpoints you trust.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from mg.ckpt_convert.checkpoint_source import CheckpointSource, open_checkpoint, open_torch_files
from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.format_convert import write_torch_dist
from mg.ckpt_convert.import_hf import expected_shapes
from mg.ckpt_convert.layout_plan import DEFAULT_DIVISIBLE_BY, plan_target
from mg.ckpt_convert.megatron_args import (
    config_of_megatron,
    megatron_args_of,
    mg_state_of_megatron,
)
from mg.ckpt_convert.reshard import sizes, write_torch
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.core.checkpoint import CHECKPOINT_VERSION, mg_metadata
from mg.core.checkpoint.dist_format import is_torch_dist, load_common
from mg.core.checkpoint.layout import Iteration
from mg.core.checkpoint.model_io import resolve_tokenizer_paths
from mg.core.checkpoint.torch_format import iteration_dir, resolve_iteration
from mg.core.models import TransformerConfig
from mg.core.models.gpt_oss_hf import MEGATRON_GPT_OSS_YARN
from mg.core.models.mamba import MambaConfig, megatron_te_names
from mg.core.tokenizers.config import TokenizerConfig

# Transformer Engine spec name → local spec name (suffix replacements).
_TE_RENAMES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"),
    # a Mamba layer's norm, fused into its in_proj by megatron-core's mamba_stack_spec
    (".mixer.in_proj.layer_norm_weight", ".norm.weight"),
    (".mixer.in_proj.layer_norm_bias", ".norm.bias"),
)
MAMBA_STACK_SPEC = ("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec")


def megatron_args_from_config(
    config: TransformerConfig,
    tokenizer: TokenizerConfig | None,
    *,
    tp: int = 1,
    pp: int = 1,
    make_vocab_size_divisible_by: int | None = None,
    ep: int = 1,
) -> argparse.Namespace:
    """The inverse: the Namespace Megatron-LM's `load_checkpoint` and `convert.py` read
    (for an MoE, with its ``moe_*`` flags, so Megatron-LM builds the same layers)."""
    c = config
    args = argparse.Namespace(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads,
        group_query_attention=c.num_query_groups != c.num_attention_heads,
        num_query_groups=c.num_query_groups,
        kv_channels=c.kv_channels,
        seq_length=c.seq_length,
        max_position_embeddings=c.max_position_embeddings,
        position_embedding_type=c.position_embedding_type,
        rotary_base=int(c.rotary_base),
        rotary_percent=c.rotary_percent,
        use_rope_scaling=c.rope_scaling is not None,
        rope_scaling_factor=c.rope_scaling.factor if c.rope_scaling else 8.0,
        normalization=c.normalization,
        norm_epsilon=c.layernorm_epsilon,
        apply_layernorm_1p=c.layernorm_zero_centered_gamma,
        swiglu=c.activation == "swiglu",
        squared_relu=c.activation == "squared_relu",
        openai_gelu=c.activation == "gelu_tanh",
        add_bias_linear=c.add_bias_linear,
        add_qkv_bias=c.add_qkv_bias or c.add_bias_linear,
        qk_layernorm=c.qk_layernorm,
        untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights,
        padded_vocab_size=c.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by or DEFAULT_DIVISIBLE_BY,
        window_size=list(c.window_size) if c.window_size else None,
        window_attn_skip_freq=c.window_attn_skip_freq,
        quick_geglu=c.activation == "quick_geglu",
        glu_linear_offset=c.glu_linear_offset,
        activation_func_clamp_value=c.activation_func_clamp_value,
        softmax_type=c.softmax_type,
        enable_gpt_oss=all(getattr(c, k) == v for k, v in MEGATRON_GPT_OSS_YARN.items()),
        init_method_std=c.init_method_std,
        attention_dropout=c.attention_dropout,
        hidden_dropout=c.hidden_dropout,
        num_experts=None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        expert_model_parallel_size=ep,
        # the spec whose names the weights carry: ours are the local spec's, or with
        # transformer_impl="transformer_engine" the TE spec's (norms fused into linears)
        transformer_impl=c.transformer_impl,
        model_type="GPT",
    )
    if c.rope_type == "yarn":  # Megatron-LM's YaRN flags (MLA's and gpt-oss's)
        args.rope_type, args.rotary_scaling_factor = "yarn", c.rotary_scaling_factor
        args.mscale, args.mscale_all_dim = c.mscale, c.mscale_all_dim
        args.yarn_original_max_position_embeddings = c.original_max_position_embeddings
        args.yarn_beta_fast, args.yarn_beta_slow = c.beta_fast, c.beta_slow
        args.yarn_correction_range_round_to_int = c.yarn_correction_range_round_to_int
    if c.multi_latent_attention:  # Megatron-LM's MLA flags (its default RoPE is YaRN)
        args.multi_latent_attention, args.rope_type = True, c.rope_type
        args.q_lora_rank, args.kv_lora_rank = c.q_lora_rank, c.kv_lora_rank
        args.qk_head_dim, args.qk_pos_emb_head_dim = c.qk_head_dim, c.qk_pos_emb_head_dim
        args.v_head_dim = c.v_head_dim
    if c.num_moe_experts:
        args.num_experts = c.num_moe_experts
        args.expert_tensor_parallel_size = tp  # experts split over TP as the MLP is
        for f in dataclasses.fields(c):
            if f.name.startswith("moe_"):
                value = getattr(c, f.name)
                setattr(args, f.name, list(value) if isinstance(value, list) else value)
    if isinstance(c, MambaConfig):  # pretrain_mamba.py's flags and its layer spec
        args.spec = list(MAMBA_STACK_SPEC)
        args.mamba_state_dim, args.mamba_head_dim = c.mamba_state_dim, c.mamba_head_dim
        args.mamba_num_groups, args.mamba_num_heads = c.mamba_num_groups, c.mamba_num_heads
        args.hybrid_attention_ratio, args.hybrid_mlp_ratio = 0.0, 0.0
        args.hybrid_override_pattern = c.layer_pattern
        args.is_hybrid_model = True
        args.transformer_impl = "transformer_engine"  # the stack spec's (fused-norm) names
    if tokenizer is not None:
        for key, value in tokenizer.to_dict().items():
            setattr(args, key, value)
    return args


def local_spec_name(name: str) -> str:
    """A Transformer Engine fused-norm name → the local spec's name (others unchanged)."""
    for te, local in _TE_RENAMES:
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def open_megatron(load: str | Path, iteration: Iteration | None = None) -> CheckpointSource:
    """A Megatron-LM checkpoint of any TP × PP layout as one whole model (lazily read):
    `torch` (``mp_rank_TT[_PPP]`` files) or `torch_dist` (Megatron-Core's sharded keys).

    The model config comes from its args; the state is what an mg checkpoint records
    (plain-data args, ``mg`` with the model and tokenizer configs), so the result can
    be written by the same code as any of our checkpoints.
    """
    load_dir = Path(load)
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    if is_torch_dist(folder):
        if (load_common(folder, allow_pickle=True).get("mg") or {}).get("model_config"):
            raise ConvertError(
                f"{folder} is an mg torch_dist checkpoint already; mg tools load it as it "
                "is, and mg-convert format --to torch writes it in a given layout"
            )
        source = open_checkpoint(load_dir, iteration, check_gpt=False)
        _check_shapes(source, folder)
        return source
    source = open_torch_files(
        load_dir,
        folder,
        iteration,
        config_of_megatron,
        rename=local_spec_name,
        allow_pickle=True,
    )
    args = megatron_args_of(source.state, folder)
    recorded = (
        int(args.get("tensor_model_parallel_size") or 1),
        int(args.get("pipeline_model_parallel_size") or 1),
        int(args.get("expert_model_parallel_size") or 1),
    )
    if recorded != (source.tp, source.pp, source.ep):
        raise ConvertError(
            f"{folder}: the args say {_sizes(*recorded)}, the mp_rank_* folders "
            f"{_sizes(source.tp, source.pp, source.ep)}; the checkpoint is incomplete or "
            "inconsistent"
        )
    config = source.config
    if not config.untie_embeddings_and_output_weights:
        source.shards.pop("output_layer.weight", None)  # a tied copy, when saved at all
    _check_shapes(source, folder)
    source.state = mg_state_of_megatron(
        args, config, source.tp, source.pp, source.state.get("iteration", 0), ep=source.ep
    )
    return source


def _sizes(tp: int, pp: int, ep: int) -> str:
    return f"TP={tp} PP={pp}" + (f" EP={ep}" if ep > 1 else "")


def _check_shapes(source: CheckpointSource, where: Path) -> None:
    shapes = expected_shapes(source.config)
    unknown = sorted(set(source.names) - set(shapes))
    missing = sorted(set(shapes) - set(source.names))
    if unknown or missing:
        raise ConvertError(
            f"{where}: the weights do not fit the model its args describe; "
            f"unexpected {unknown[:6]}, missing {missing[:6]}"
        )
    for name in source.names:
        shape = source.meta(name).shape
        if shape != shapes[name]:
            raise ConvertError(
                f"{where}: shape mismatch for {name}: {tuple(shape)} in the checkpoint "
                f"(tensor-parallel shards joined), {tuple(shapes[name])} from its args"
            )


def import_megatron(
    load: str | Path,
    save: str | Path,
    iteration: Iteration | None = None,
    tp: int | None = None,
    pp: int | None = None,
    divisible_by: int | None = None,
    report: Any = print,
    ep: int | None = None,
    expert_layout: str | None = None,
) -> Path:
    """Megatron-LM checkpoint (any TP × PP × EP) → mg `torch` checkpoint with the same
    iteration, in the layout ``tp`` × ``pp`` × ``ep`` (None: the source's), an MoE's experts
    in ``expert_layout`` ("sequential" or "grouped"; None: the source's)."""
    check_target(save)
    source = open_megatron(load, iteration)
    target = plan_target(source, tp, pp, divisible_by, ep, expert_layout)
    with staged_dir(save) as staging:
        write_torch(staging, source, target, source.iteration)
    report(
        f"imported iteration {source.iteration}: Megatron-LM "
        f"{sizes(source.tp, source.pp, source.ep)} → mg {sizes(target.tp, target.pp, target.ep)}"
    )
    for note in target.notes:
        report(f"note: {note}")
    return Path(save)


def export_megatron(
    load: str | Path,
    save: str | Path,
    iteration: Iteration | None = None,
    tp: int | None = None,
    pp: int | None = None,
    divisible_by: int | None = None,
    report: Any = print,
    ckpt_format: str = "torch",
    ep: int | None = None,
    expert_layout: str | None = None,
) -> Path:
    """mg checkpoint (either format, any layout) → Megatron-LM checkpoint: `torch` with
    local layer spec names, in the layout ``tp`` × ``pp`` × ``ep`` (None: the source's), or
    `torch_dist` in Megatron-Core's layout (loads at any layout; its args record ``tp`` ×
    ``pp``), written one layer at a time. An MoE's experts go in ``expert_layout``
    (None: grouped GEMM for a model with Transformer Engine names that has it, sequential
    otherwise; see the module docstring)."""
    if ckpt_format not in ("torch", "torch_dist"):
        raise ConvertError(f"--ckpt-format {ckpt_format!r}: expected torch or torch_dist")
    check_target(save)
    source = open_checkpoint(load, iteration)
    mamba = isinstance(source.config, MambaConfig)
    target = plan_target(
        source, tp, pp, divisible_by, ep, _megatron_expert_layout(source.config, expert_layout)
    )
    tokenizer_config = (source.state.get("mg") or {}).get("tokenizer_config")
    tokenizer = None
    if tokenizer_config:
        tokenizer = resolve_tokenizer_paths(TokenizerConfig.from_dict(dict(tokenizer_config)), load)
    args = megatron_args_from_config(
        target.config,
        tokenizer,
        tp=target.tp,
        pp=target.pp,
        make_vocab_size_divisible_by=divisible_by
        or source.args.get("make_vocab_size_divisible_by"),
        ep=target.ep,
    )
    args.ckpt_format = ckpt_format
    common = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": source.iteration if isinstance(source.iteration, int) else 0,
        "mg": mg_metadata(
            target.config.to_dict(), tokenizer_config, tp=target.tp, pp=target.pp, ep=target.ep
        ),
    }
    with staged_dir(save) as staging:
        if ckpt_format == "torch_dist":
            write_torch_dist(staging, source, target, source.iteration, common=common)
        else:
            # pretrain_mamba.py builds the TE mamba_stack_spec: norms fused into the linears
            rename = megatron_te_names if mamba else None
            write_torch(staging, source, target, source.iteration, common=common, rename=rename)
    report(
        f"exported iteration {source.iteration}: {source.format} "
        f"({sizes(source.tp, source.pp, source.ep)}) → Megatron-LM {ckpt_format} "
        f"{sizes(target.tp, target.pp, target.ep)}"
    )
    for note in target.notes:
        report(f"note: {note}")
    return Path(save)


def _megatron_expert_layout(config: TransformerConfig, asked: str | None) -> str | None:
    """The experts layout Megatron-LM loads for this model: grouped GEMM's weightN names
    are TEGroupedMLP's, built only with the Transformer Engine spec (the local spec's
    grouped GEMM is the legacy GroupedMLP, weight1/weight2); sequential otherwise."""
    if not config.num_moe_experts:
        return asked  # plan_target refuses a layout for a dense model
    te = config.transformer_impl == "transformer_engine"
    if asked == "grouped" and not te:
        raise ConvertError(
            "--expert-layout grouped: Megatron-LM builds grouped-GEMM experts with these "
            "names (TEGroupedMLP's linear_fc1.weightN) only with --transformer-impl "
            "transformer_engine, and this model has the local spec's names; use sequential"
        )
    if asked is not None:
        return asked
    return "grouped" if config.moe_grouped_gemm and te else "sequential"
