"""`mg-train gpt --dry-run` plans DeepSeek-V3 from Megatron-LM core_v0.19.0's own script,
examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (256 GPUs, TP 1, EP 8, Megatron-FSDP),
flag for flag with the defaults of its variables, except where this test must:

- `--tokenizer-type HuggingFaceTokenizer --tokenizer-model deepseek-ai/DeepSeek-V3` and
  `--data-path`: a NullTokenizer of the same vocabulary (129280 after padding) and mock data
  (no network, no corpus here);
- nothing else: every other flag is the script's, `--transformer-impl transformer_engine`
  and `--recompute-modules mlp moe mla_up_proj layernorm` included.

The plan: DeepSeek-V3's main model within 1% of its 671B (the MTP depth besides), 37B
active per token, and MLA's KV cache: (kv_lora_rank + qk_pos_emb_head_dim) × layers × 2
bytes; `--moe-token-dispatcher-type flex` runs as alltoall, said in one line.
"""

from __future__ import annotations

import re

import pytest

from mg.core.models.flops import num_parameters
from mg.trainer.arguments import parse_args
from mg.trainer.dry_run import report
from mg.trainer.families import gpt_config

SCRIPT = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 8
--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --use-mcore-models --sequence-parallel
--use-flash-attn --disable-bias-linear --micro-batch-size 4 --global-batch-size 2048
--train-samples 585937500 --exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad
--manual-gc --manual-gc-interval 10 --recompute-granularity selective
--recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine
--seq-length 4096 --data-cache-path {tmp}/cache
--tokenizer-type NullTokenizer --vocab-size 129279 --mock-data --split 99,1,0
--no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6
--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
--kv-channels 128 --max-position-embeddings 4096 --position-embedding-type rope
--rotary-base 10000 --make-vocab-size-divisible-by 3232 --normalization RMSNorm
--norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention
--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1
--qk-layernorm --lr-decay-samples 584765624 --lr-warmup-samples 1536000
--lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine
--adam-beta1 0.9 --adam-beta2 0.95 --num-experts 256 --moe-layer-freq [0]*3+[1]*58
--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 8
--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep
--moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
--moe-router-group-topk 4 --moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.5
--moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
--q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
--v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 32 --eval-interval 100
--save {tmp}/checkpoints --save-interval 100 --init-method-std 0.02 --log-throughput
--log-interval 1 --logging-level 40 --tensorboard-dir {tmp}/tensorboard --bf16
--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
--no-gradient-accumulation-fusion --use-distributed-optimizer --calculate-per-token-loss
--init-model-with-meta-device --ckpt-format fsdp_dtensor --fsdp-double-buffer --use-nccl-ub
--megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16
--auto-detect-ckpt-format --dist-ckpt-strictness log_all --log-validation-ppl-to-tensorboard
--enable-experimental --moe-router-force-load-balancing --log-timers-to-tensorboard
--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
"""


def _argv(tmp_path) -> list[str]:
    return ["gpt", "--dry-run", *SCRIPT.format(tmp=tmp_path).split()]


@pytest.mark.slow  # the meta-device model of 671B parameters: ~17 s on 2 CPUs
def test_deepseek_v3_plan(tmp_path, capsys) -> None:
    args = parse_args(_argv(tmp_path), world_size=256)
    assert "flex (hybridep)" in capsys.readouterr().err  # the one line
    assert args.moe.moe_token_dispatcher_type == "alltoall"
    config = gpt_config(args, 129280)
    main_model = num_parameters(config, include_mtp=False)
    assert main_model == pytest.approx(671e9, rel=0.01)
    assert num_parameters(config, active=True, include_mtp=False) == pytest.approx(37e9, rel=0.03)
    text = report(args)
    kv = (512 + 64) * 61 * 2
    assert f"KV cache per token: {kv} bytes in bf16" in text
    total = float(
        re.search(r"number of parameters: ([\d.]+) B \(meta-device model: ([\d.]+)", text)[1]
    )
    assert total * 1e9 == pytest.approx(num_parameters(config), rel=1e-6)
    assert "!" not in re.search(r"number of parameters: .*", text)[0]  # meta model agrees


def test_the_script_s_own_recompute_transformer_engine_and_logging_flags(tmp_path) -> None:
    """The flags a Megatron user copies from the script reach the parsed arguments."""
    args = parse_args(_argv(tmp_path), world_size=256)
    assert args.model.recompute_modules == ["mlp", "moe", "mla_up_proj", "layernorm"]
    assert args.transformer_engine.transformer_impl == "transformer_engine"
    logging = vars(args.logging)
    for flag in ("log_timers_to_tensorboard", "log_memory_to_tensorboard"):
        assert logging[flag]
    for flag in ("log_num_zeros_in_grad", "log_params_norm"):
        assert logging[flag]
