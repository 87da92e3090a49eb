"""`mg-train vlm --dry-run` plans LLaVA-1.5-style projector pretraining (Mistral-7B with a
CLIP ViT-L/14 at 336 pixels) from Megatron-LM core_v0.19.0's own script,
examples/multimodal/pretrain_mistral_clip.sh (8 GPUs, TP 4), flag for flag with the
defaults of its variables (DEBUG=0), except where this test must:

- `--tokenizer-type MultimodalTokenizer --tokenizer-model mistralai/Mistral-7B-Instruct-v0.3`
  and `--data-path`: a NullTokenizer of Mistral's vocabulary (32768 after padding) and mock
  data (no network, no dataset here); the script's folders (`--save`, `--load`,
  `--pretrained-checkpoint`, `--dataloader-save`, `--tensorboard-dir`, `--prompt-path`)
  under the test's temporary folder.

`--apply-layernorm-1p` applies to the language model's norms only: Megatron's vision config
sets `layernorm_zero_centered_gamma = False` for CLIP (examples/multimodal/config.py).

The plan: the language model's 7.25B parameters and the ViT's 0.30B, both frozen, the
projector's 21M trained; 576 image tokens (24 x 24 patches, class token dropped) in each
1024-token sample.
"""

from __future__ import annotations

import re

import pytest

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.dry_run import report

SCRIPT = """
--attention-softmax-in-fp32 --use-checkpoint-args
--no-use-tokenizer-model-from-checkpoint-args --use-distributed-optimizer
--transformer-impl transformer_engine --use-te --normalization RMSNorm --group-query-attention
--num-query-groups 8 --no-masked-softmax-fusion --num-workers 2 --exit-duration-in-mins 230
--use-flash-attn --untie-embeddings-and-output-weights --disable-bias-linear
--position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000 --swiglu
--attention-dropout 0.0 --hidden-dropout 0.1 --tensor-model-parallel-size 4
--pipeline-model-parallel-size 1 --num-layers 32 --hidden-size 4096 --num-attention-heads 32
--seq-length 576 --decoder-seq-length 1024 --max-position-embeddings 4096
--ffn-hidden-size 14336 --train-iters 20000 --micro-batch-size 1 --global-batch-size 256
--lr-decay-iters 20000 --lr-warmup-fraction .01 --lr 0.00015 --min-lr 1.0e-5
--lr-decay-style cosine --log-interval 10 --eval-iters 10 --eval-interval 1000
--tokenizer-type NullTokenizer --vocab-size 32767 --tokenizer-prompt-format mistral
--mock-data --prompt-path {tmp}/manual_prompts.json --save-interval 1000
--save {tmp}/checkpoints --load {tmp}/checkpoints --dataloader-save {tmp}/checkpoints/dataloader
--pretrained-checkpoint {tmp}/combined/checkpoints --split 100,0,0 --clip-grad 1.0
--weight-decay 1e-2 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.014
--log-params-norm --log-num-zeros-in-grad --bf16 --eod-mask-loss --freeze-LM --freeze-ViT
--patch-dim 14 --img-h 336 --img-w 336 --dataloader-type external
--tensorboard-dir {tmp}/tensorboard --language-model-type=mistral_7b
--disable-vision-class-token --distributed-timeout-minutes 60 --apply-layernorm-1p
--allow-missing-vision-projection-checkpoint --ckpt-format torch
"""


def _argv(tmp_path) -> list[str]:
    return ["vlm", "--dry-run", *SCRIPT.format(tmp=tmp_path).split()]


def _billions(text: str, tower: str) -> float:
    return float(re.search(rf"{re.escape(tower)}\s+([\d.]+) B", text)[1])


@pytest.mark.slow  # the meta-device model of 7.6B parameters: ~20 s on 2 CPUs
def test_pretrain_mistral_clip_plan(tmp_path) -> None:
    args = parse_args(_argv(tmp_path), world_size=8)
    text = report(args)
    assert _billions(text, "language_model") == pytest.approx(7.248, abs=1e-3)  # Mistral-7B
    assert _billions(text, "vision_model (clip)") == pytest.approx(0.3035, abs=1e-4)
    projector = 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert _billions(text, "vision_projection (mlp)") == pytest.approx(projector / 1e9, abs=1e-4)
    assert re.search(r"vision_model \(clip\).*frozen", text)
    assert re.search(r"language_model .*frozen", text)
    assert re.search(r"vision_projection \(mlp\).*trained", text)
    assert "tokens per sample: 1024 = 576 image tokens + 448 text tokens" in text
    assert "world 8 = TP 4 x PP 1 x DP 2" in text


def test_layernorm_1p_reaches_the_language_model_only(tmp_path) -> None:
    from mg.trainer.family_vlm import vlm_config

    config = vlm_config(parse_args(_argv(tmp_path), world_size=8), 32768)
    assert config.language.layernorm_zero_centered_gamma
    assert not getattr(config.vision, "layernorm_zero_centered_gamma", False)


def test_a_real_run_refuses_transformer_engine_by_name(tmp_path) -> None:
    dropped = ("--dry-run", "--allow-missing-vision-projection-checkpoint")  # (torch format)
    argv = [a for a in _argv(tmp_path) if a not in dropped]
    with pytest.raises(ArgumentError, match="--transformer-impl transformer_engine"):
        parse_args(argv, world_size=8)
