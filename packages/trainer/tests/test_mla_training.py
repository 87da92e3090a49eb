"""mg-train gpt with multi-latent attention and YaRN: flags onto core's config, refusals by
name, and a short DeepSeek-V3-shaped run whose loss falls."""

from __future__ import annotations

import math

import pytest
import torch

from mg.core.models import GPTModel
from mg.core.models.mla import MLASelfAttention
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.families import gpt_config

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
MLA = [
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--ffn-hidden-size",
    "48",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--multi-latent-attention",
    "--q-lora-rank",
    "24",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "8",
    "--qk-pos-emb-head-dim",
    "4",
    "--v-head-dim",
    "8",
    "--qk-layernorm",
    "--rotary-scaling-factor",
    "4",
    "--mscale",
    "1.0",
    "--mscale-all-dim",
    "1.0",
    "--yarn-original-max-position-embeddings",
    "8",
]
# DeepSeek-V3's MoE: sigmoid scores, expert bias, group-limited top-k, scaling factor, a
# shared expert, the first layer dense
DEEPSEEK_MOE = [
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-shared-expert-intermediate-size",
    "16",
    "--moe-layer-freq",
    "[0]+[1]*1",
    "--moe-router-topk",
    "2",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-num-groups",
    "2",
    "--moe-router-group-topk",
    "1",
    "--moe-router-topk-scaling-factor",
    "2.5",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
    "--moe-aux-loss-coeff",
    "1e-3",
    "--moe-router-dtype",
    "fp32",
]


def test_mla_flags_become_core_config_fields(tmp_path, mock_argv) -> None:
    config = gpt_config(parse_args(mock_argv(tmp_path, *MLA)), 128)
    assert config.multi_latent_attention and config.rope_type == "yarn"  # MLA's default
    assert (config.q_lora_rank, config.kv_lora_rank) == (24, 16)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (8, 4, 8)
    assert (config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (4, 1, 1)
    assert (config.original_max_position_embeddings, config.beta_fast) == (8, 32.0)
    assert config.attention_softmax_scale == pytest.approx(
        (0.1 * math.log(4) + 1) ** 2 / math.sqrt(12)
    )
    shape_only = MLA[: MLA.index("--rotary-scaling-factor")]
    assert parse_args(mock_argv(tmp_path, *MLA, "--mla-down-proj-fusion")).mla.mla_down_proj_fusion
    plain_rope = gpt_config(
        parse_args(mock_argv(tmp_path, *shape_only, "--rope-type", "rope")), 128
    )
    assert plain_rope.rope_type == "rope"
    yarn_gpt = ["--position-embedding-type", "rope", "--rope-type", "yarn"]
    yarn_gpt += ["--rotary-scaling-factor", "8", "--no-yarn-correction-range-round-to-int"]
    config = gpt_config(parse_args(mock_argv(tmp_path, *yarn_gpt)), 128)
    assert not config.multi_latent_attention and config.rope_type == "yarn"
    assert not config.yarn_correction_range_round_to_int


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--position-embedding-type", "rope", "--kv-lora-rank", "8"], "add --multi-latent"),
        (["--position-embedding-type", "rope", "--mscale", "2"], "--mscale applies to YaRN"),
        (["--multi-latent-attention"], "needs --position-embedding-type rope"),
        (
            [*MLA, "--group-query-attention", "--num-query-groups", "2"],
            "--group-query-attention exclude",
        ),
        ([*MLA, "--qk-pos-emb-head-dim", "3"], "--qk-pos-emb-head-dim 3: RoPE needs an even"),
        (["--mla-down-proj-fusion"], "--mla-down-proj-fusion requires --multi-latent"),
        ([*MLA, "--cache-mla-latents"], "--cache-mla-latents is an inference option"),
    ],
)
def test_mla_flags_refused_by_name(tmp_path, mock_argv, extra, message) -> None:
    with pytest.raises(ArgumentError, match=message):
        parse_args(mock_argv(tmp_path, *extra))


def test_deepseek_v3_shaped_run_trains(tmp_path, mock_argv, train) -> None:
    argv = mock_argv(tmp_path, *MLA, *DEEPSEEK_MOE, *NO_DROPOUT, iters=8)
    result = train(argv)
    assert len(result.losses) == 8 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0] - 0.1
    with torch.device("meta"):
        model = GPTModel(gpt_config(parse_args(argv), 128))
    assert isinstance(model.decoder.layers[0].self_attention, MLASelfAttention)


def test_deepseek_v3_shaped_run_resumes_from_torch_dist_bitwise(tmp_path, mock_argv, train) -> None:
    """Saved at iteration 3 in torch_dist (the latents' projections, the expert bias),
    resumed to 6: the straight run's losses exactly."""
    argv = mock_argv(tmp_path, *MLA, *DEEPSEEK_MOE, *NO_DROPOUT, mbs=2, gbs=4, iters=6)
    straight = train(argv).losses
    ckpt = ["--ckpt-format", "torch_dist", "--save-interval", "3"]
    first = train([*argv, "--save", str(tmp_path / "ck"), *ckpt, "--exit-interval", "3"])
    second = train([*argv, "--load", str(tmp_path / "ck"), "--ckpt-format", "torch_dist"])
    assert first.losses + second.losses == straight
