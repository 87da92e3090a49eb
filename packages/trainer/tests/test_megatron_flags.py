"""Megatron flags of its example scripts that change what mg-train does, checked by number.

Each test shows the behaviour Megatron documents for its flag: the per-token
loss reduction against Megatron's formula on unequal masks (one process, and two
data-parallel ranks against one), the decoupled learning rate against
megatron-core's own OptimizerParamScheduler, zero-centred norms training exactly
as the plain model does, the profiler's trace, manual GC, the data loader's
workers, memory-mapped or read .bin files, the tiktoken pattern, bf16 gradient
reduction, and the documented no-ops leaving the model config as it was.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.training import Trainer

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Many short documents (1 to 9 tokens, then EOD): with --eod-mask-loss the loss
    masks of 32-token samples differ a lot. Returns the data and tokenizer flags."""
    from mg.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    prefix = str(tmp_path_factory.mktemp("short_docs") / "short_text_document")
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for _ in range(3000):
            ids = [*rng.integers(0, 127, int(rng.integers(1, 10))).tolist(), 127]  # 127: EOD
            builder.add_document(ids, [len(ids)])
        builder.finalize(prefix + ".idx")
    return ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]


# --- --calculate-per-token-loss ----------------------------------------------------------------


def test_per_token_loss_is_megatrons_reduction(tmp_path: Path, mock_argv) -> None:
    """Two micro-batches with 16 and 64 loss tokens: the gradient is that of
    sum(loss * mask) / 80 (Megatron's per-token loss), not of the mean of the two
    micro-batch means (its default, and mg-train's without the flag)."""
    argv = mock_argv(
        tmp_path, *NO_DROPOUT, "--clip-grad", "0", "--calculate-per-token-loss", mbs=2, gbs=4
    )
    trainer = Trainer(parse_args(argv))
    batches = [next(trainer.train_data) for _ in range(2)]
    batches[0]["loss_mask"][:, 8:] = 0  # 2 x 8 = 16 tokens against 2 x 32 = 64
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_data = iter(batches)
    loss, *_ = trainer.train_step()
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    def reference_grads(reduce) -> dict[str, torch.Tensor]:
        trainer.model.load_state_dict(start)
        trainer.model.zero_grad(set_to_none=True)
        terms = [trainer.family.loss_terms(trainer.model, b)[:2] for b in batches]
        reduce(terms).backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    per_token = reference_grads(lambda t: sum(s for s, _ in t) / sum(n for _, n in t))
    mean_of_means = reference_grads(lambda t: sum(s / n for s, n in t) / len(t))
    for name, grad in got.items():
        torch.testing.assert_close(grad, per_token[name], rtol=1e-5, atol=1e-7)
    differs = max(float((got[n] - mean_of_means[n]).abs().max()) for n in got)
    assert differs > 1e-4  # the two reductions really differ on these masks
    trainer.model.load_state_dict(start)
    sums = [trainer.family.loss_terms(trainer.model, b)[:2] for b in batches]
    expected_loss = sum(float(s) for s, _ in sums) / sum(float(n) for _, n in sums)
    assert loss == pytest.approx(expected_loss, rel=1e-6)


def test_two_ranks_match_one_with_per_token_loss_and_bf16_reduction(
    tmp_path: Path, short_docs: list[str], train
) -> None:
    """DP 2 x 2 micro-batches against one process with 4, on masks that differ per sample:
    --calculate-per-token-loss gives the same steps (the token count is the global
    batch's, over both ranks), and so do two pipeline stages; --grad-reduce-in-bf16
    (the all-reduce, and the distributed optimizer's reduce-scatter) changes the
    gradients by bf16 rounding only. SGD without clipping, so any factor on the
    gradient shows."""
    from mg.core.testing.launch import launch_workers

    base = [
        "gpt",
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--max-position-embeddings", "32", "--lr", "0.5"),
        *("--optimizer", "sgd", "--sgd-momentum", "0", "--clip-grad", "0", "--eval-iters", "0"),
        *("--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4"),
        *("--eod-mask-loss", "--split", "100,0,0", "--data-cache-path", str(tmp_path / "c")),
        *NO_DROPOUT,
        *short_docs,
    ]
    per_token = [*base, "--calculate-per-token-loss"]
    bf16 = [*base, "--grad-reduce-in-bf16"]
    bf16_dist_opt = [*bf16, "--use-distributed-optimizer"]
    one_per_token, one_plain = train(per_token), train(base)
    out = tmp_path / "two.json"
    pipeline = [*per_token, "--pipeline-model-parallel-size", "2"]
    argvs = [per_token, pipeline, bf16, bf16_dist_opt]
    launch_workers(str(Path(__file__).with_name("ddp_worker.py")), 2, [str(out), json.dumps(argvs)])
    two_per_token, two_stages, two_bf16, two_bf16_dist_opt = json.loads(out.read_text())
    for two in (two_per_token, two_stages):
        for a, b in zip(one_per_token.grad_norms, two["grad_norms"], strict=True):
            assert abs(a - b) / a <= 1e-5, (one_per_token.grad_norms, two["grad_norms"])
        for a, b in zip(one_per_token.losses, two["losses"], strict=True):
            assert abs(a - b) / a <= 1e-5
    # the flag matters on these masks: Megatron's default reduction steps differently
    assert (
        abs(one_per_token.grad_norms[0] - one_plain.grad_norms[0]) / one_plain.grad_norms[0] > 1e-3
    )
    for two in (two_bf16, two_bf16_dist_opt):  # all-reduce, and the optimizer's reduce-scatter
        gap = [abs(a - b) / a for a, b in zip(one_plain.grad_norms, two["grad_norms"], strict=True)]
        assert 0 < max(gap) < 1e-2, gap  # bf16 rounding of the reduction, no more


# --- --decoupled-lr / --decoupled-min-lr -------------------------------------------------------


@pytest.mark.parametrize("untie", [False, True])
def test_decoupled_lr_groups_follow_megatrons_scheduler(
    tmp_path: Path, mock_argv, untie: bool
) -> None:
    """The embedding (and the untied output layer) are in groups of their own whose
    learning rate, step by step, is megatron-core's OptimizerParamScheduler's for a
    group with max_lr = --decoupled-lr and min_lr = --decoupled-min-lr."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    flags = ["--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"]
    flags += ["--untie-embeddings-and-output-weights"] if untie else []
    trainer = Trainer(parse_args(mock_argv(tmp_path, *flags, iters=10)))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    expected = {"embedding.word_embeddings.weight"} | ({"output_layer.weight"} if untie else set())
    decoupled = {
        names[id(p)] for g in trainer.optimizer.param_groups if "max_lr" in g for p in g["params"]
    }
    assert decoupled == expected
    assert "max_lr" not in trainer.optimizer.param_groups[0]  # the log line's rate is --lr's

    reference_groups = [
        {
            "params": [torch.nn.Parameter(torch.zeros(1))],
            **{k: v for k, v in g.items() if k in ("max_lr", "min_lr")},
        }
        for g in trainer.optimizer.param_groups
    ]
    for g in reference_groups:
        g["wd_mult"] = g["lr_mult"] = 1.0
    reference = OptimizerParamScheduler(
        torch.optim.SGD(reference_groups, lr=0.0),
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=2 * 8,
        lr_decay_steps=10 * 8,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=10 * 8,
        wd_incr_style="constant",
    )
    seen_decoupled = set()
    for _ in range(10):
        trainer.train_step()
        reference.step(increment=8)
        for ours, theirs in zip(
            trainer.optimizer.param_groups, reference.optimizer.param_groups, strict=True
        ):
            assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-12, abs=1e-15)
            if "max_lr" in ours:
                seen_decoupled.add(round(ours["lr"], 12))
    assert max(seen_decoupled) > 1e-3  # above --lr: the decoupled peak is in effect


def test_decoupled_min_lr_needs_decoupled_lr(tmp_path: Path, mock_argv) -> None:
    with pytest.raises(ArgumentError, match="^--decoupled-min-lr needs --decoupled-lr"):
        parse_args(mock_argv(tmp_path, "--decoupled-min-lr", "1e-5"))


# --- --apply-layernorm-1p ----------------------------------------------------------------------


def test_layernorm_1p_trains_as_the_plain_model(tmp_path: Path, mock_argv, train) -> None:
    """Zero-centred gamma is a reparametrisation (weight = gamma - 1, no weight decay on
    norms): the same seed gives the same losses, the norm weights one less, and the
    checkpoint records the setting so other tools rebuild the same function."""
    argv = mock_argv(tmp_path, *NO_DROPOUT, iters=3)
    plain = train(argv)
    save = str(tmp_path / "ckpt")
    one_p = Trainer(parse_args([*argv, "--apply-layernorm-1p", "--save", save]))
    norms = [n for n, _ in one_p.model.named_parameters() if "layernorm.weight" in n]
    assert norms and all(
        float(p.abs().max()) == 0 for n, p in one_p.model.named_parameters() if n in norms
    )
    result = one_p.train()
    np.testing.assert_allclose(result.losses, plain.losses, rtol=1e-6)
    from mg.core.checkpoint import describe

    assert describe(save).model_config["layernorm_zero_centered_gamma"] is True


def test_layernorm_1p_is_refused_outside_gpt(tmp_path: Path, mock_argv) -> None:
    argv = ["mamba", *mock_argv(tmp_path, "--apply-layernorm-1p")[1:]]
    with pytest.raises(ArgumentError, match="^--apply-layernorm-1p is supported for gpt"):
        parse_args(argv)


# --- documented no-ops and model-shape aliases -------------------------------------------------


def test_no_ops_and_position_flags_set_megatrons_config(tmp_path: Path, mock_argv) -> None:
    from mg.trainer.families import get_family

    def config(*flags: str):
        return get_family("gpt").build_config(parse_args(mock_argv(tmp_path, *flags)), 128)

    assert config("--use-mcore-models", "--no-masked-softmax-fusion") == config()
    assert config("--no-position-embedding").position_embedding_type == "none"
    assert (
        config(
            "--no-position-embedding", "--position-embedding-type", "rope"
        ).position_embedding_type
        == "rope"
    )  # Megatron: rope is not a learned position table


def test_encoder_and_decoder_num_layers(tmp_path: Path, mock_argv) -> None:
    argv = mock_argv(tmp_path)
    args = parse_args(["t5", "--encoder-num-layers", "3", *argv[3:]])
    assert args.model.num_layers == 3 and args.model.decoder_num_layers == 3
    with pytest.raises(ArgumentError, match="^--decoder-num-layers 2: mg's T5 has as many"):
        parse_args(["t5", "--encoder-num-layers", "3", "--decoder-num-layers", "2", *argv[3:]])


# --- --profile, --manual-gc, --empty-unused-memory-level, --log-throughput ----------------------


def test_profile_writes_a_trace_of_the_chosen_steps(tmp_path: Path, mock_argv, train) -> None:
    tensorboard = tmp_path / "tb"
    flags = ["--profile", "--profile-step-start", "2", "--profile-step-end", "4"]
    train(mock_argv(tmp_path, *flags, "--tensorboard-dir", str(tensorboard), iters=5))
    traces = list(tensorboard.glob("*.pt.trace.json"))
    assert len(traces) == 1, list(tensorboard.iterdir())
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # iterations 3 and 4 (Megatron's)
    with pytest.raises(ArgumentError, match="^--profile writes its trace to --tensorboard-dir"):
        parse_args(mock_argv(tmp_path, "--profile"))


def test_profile_ranks_leave_other_ranks_alone(tmp_path: Path, mock_argv, train) -> None:
    tensorboard = tmp_path / "tb"
    flags = ["--profile", "--profile-step-start", "1", "--profile-step-end", "2"]
    flags += ["--profile-ranks", "1", "--tensorboard-dir", str(tensorboard)]
    train(mock_argv(tmp_path, *flags, iters=3))
    assert not list(tensorboard.glob("*.pt.trace.json"))


def test_manual_gc_collects_on_the_interval_only(
    tmp_path: Path, mock_argv, monkeypatch: pytest.MonkeyPatch
) -> None:
    collections: list[int] = []
    enabled: list[bool] = []
    trainer = Trainer(
        parse_args(mock_argv(tmp_path, "--manual-gc", "--manual-gc-interval", "3", iters=7))
    )
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(trainer.state.iteration) or 0)
    trainer.train(on_iteration=lambda t: enabled.append(gc.isenabled()))
    assert enabled == [False] * 7 and gc.isenabled()  # automatic GC off during training only
    assert collections == [0, 3, 6]  # at the start, then every 3 iterations (Megatron's)


def test_empty_unused_memory_levels(tmp_path: Path, mock_argv, monkeypatch) -> None:
    from mg.trainer.housekeeping import Housekeeping

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    for level, expected in ((0, 0), (1, 1), (2, 2)):
        calls.clear()
        args = parse_args(mock_argv(tmp_path, "--empty-unused-memory-level", str(level)))
        hooks = Housekeeping(args, rank=0)
        hooks.after_forward_backward()
        hooks.after_optimizer_step()
        assert len(calls) == expected


def test_log_throughput_line(tmp_path: Path, mock_argv, train, capsys) -> None:
    train(mock_argv(tmp_path, "--log-throughput", "--log-interval", "1", iters=3))
    lines = [x for x in capsys.readouterr().out.splitlines() if " iteration " in x]
    assert len(lines) == 3 and all("throughput per GPU (TFLOP/s/GPU):" in x for x in lines)


# --- data: --num-workers, --no-mmap-bin-files, --tiktoken-pattern ------------------------------


def test_workers_and_file_reads_give_the_same_batches(
    tmp_path: Path, short_docs: list[str], train, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--num-workers 2 (a DataLoader) and --no-mmap-bin-files (reads, not mmap) feed the
    same samples in the same order: the losses are bitwise those of the default."""
    from mg.indexed_dataset import reader

    opened: list[bool] = []
    original = reader.IndexedDataset.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        opened.append(self.mmap)

    monkeypatch.setattr(reader.IndexedDataset, "__init__", spy)
    base = [
        "gpt",
        *("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--max-position-embeddings", "32", "--lr", "1e-3"),
        *("--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4"),
        *("--eval-iters", "1", "--eval-interval", "2", "--split", "90,10,0"),
        *("--data-cache-path", str(tmp_path / "cache")),
        *NO_DROPOUT,
        *short_docs,
    ]
    default = train(base)
    assert opened and all(opened)
    opened.clear()
    other = train([*base, "--num-workers", "2", "--no-mmap-bin-files"])
    assert opened and not any(opened)
    assert other.losses == default.losses and other.validation == default.validation


def test_tiktoken_pattern_reaches_the_tokenizer(tmp_path: Path, mock_argv) -> None:
    from mg.core.fixtures import fixture_path

    model = str(fixture_path("gpt2-tiktoken", "gpt2.tiktoken"))
    tokens = {}
    for pattern in ("v1", "v2"):
        flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", model]
        argv = mock_argv(tmp_path, *flags, "--vocab-size", "50257", "--tiktoken-pattern", pattern)
        args = parse_args(argv)
        trainer = Trainer(args)
        assert trainer.tokenizer_config.tiktoken_pattern == pattern
        tokens[pattern] = trainer.tokenizer.tokenize("iPhone iPad")
    assert tokens["v1"] != tokens["v2"]  # v2 splits "iPhone" at the case change, v1 does not


# --- flags of the docs' recipes (llama_mistral.md, parallelism-guide.md) ----------------------


def test_rope_flags_match_megatron_core(tmp_path: Path, mock_argv) -> None:
    """--use-rotary-position-embeddings is rope; --use-rope-scaling's frequencies are
    megatron-core's RotaryEmbedding(rope_scaling=True) ones."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mg.core.models.rope import rope_inv_freq
    from mg.trainer.families import get_family

    flags = ["--use-rotary-position-embeddings", "--rotary-base", "500000"]
    flags += ["--use-rope-scaling", "--rope-scaling-factor", "16"]
    config = get_family("gpt").build_config(parse_args(mock_argv(tmp_path, *flags)), 128)
    assert config.position_embedding_type == "rope" and config.rope_scaling.factor == 16
    theirs = RotaryEmbedding(
        kv_channels=8,
        rotary_percent=1.0,
        rotary_base=500000,
        rope_scaling=True,
        rope_scaling_factor=16.0,
        use_cpu_initialization=True,
    ).inv_freq
    torch.testing.assert_close(rope_inv_freq(config).float(), theirs.float(), rtol=1e-6, atol=0)
    with pytest.raises(ArgumentError, match="^--use-rope-scaling needs --position-embedding"):
        parse_args(mock_argv(tmp_path, "--use-rope-scaling"))


@pytest.mark.parametrize(
    "flags",
    [
        ["--use-legacy-models"],
        ["--use-megatron-fsdp"],
        ["--data-parallel-sharding-strategy", "optim_grads_params"],
        ["--cp-comm-type", "a2a"],
        ["--tp-comm-overlap"],
    ],
)
def test_refused_by_name(tmp_path: Path, mock_argv, flags: list[str]) -> None:
    with pytest.raises(ArgumentError, match=f"^{flags[0]}"):
        parse_args(mock_argv(tmp_path, *flags))


def test_accepted_recipe_values_change_nothing(tmp_path: Path, mock_argv) -> None:
    from mg.trainer.families import get_family

    def config(*flags: str):
        return get_family("gpt").build_config(parse_args(mock_argv(tmp_path, *flags)), 128)

    same = ["--data-parallel-sharding-strategy", "no_shard", "--cp-comm-type", "p2p"]
    assert config(*same, "--no-gradient-accumulation-fusion") == config()


def test_exit_on_missing_checkpoint(tmp_path: Path, mock_argv, capsys) -> None:
    from mg.trainer.cli import main

    empty = tmp_path / "nothing_here"
    empty.mkdir()
    argv = mock_argv(tmp_path, "--load", str(empty), "--exit-on-missing-checkpoint", iters=4)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"mg-train: error: --exit-on-missing-checkpoint: no checkpoint in {empty} "
        "(no latest_checkpointed_iteration.txt)"
    ]


def test_attention_softmax_is_fp32_already() -> None:
    """--attention-softmax-in-fp32 is a documented no-op: in bf16, SDPA (what mg-train's
    attention runs) is at least as close to the fp32 attention as Megatron's unfused
    path with the flag (bf16 scores, softmax upcast to fp32)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32) * 3 for _ in range(3))
    causal = torch.ones(64, 64, dtype=torch.bool).tril()

    def megatron_unfused(q, k, v, softmax_dtype):
        scores = (q @ k.transpose(-1, -2) / 32**0.5).masked_fill(~causal, float("-inf"))
        return torch.softmax(scores.to(softmax_dtype), -1).to(q.dtype) @ v

    exact = megatron_unfused(q, k, v, torch.float32)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*bf16, is_causal=True).float()
    with_flag = megatron_unfused(*bf16, torch.float32).float()
    assert (sdpa - exact).abs().max() <= (with_flag - exact).abs().max()


def test_decoupled_lr_on_one_side_of_a_resume_is_one_line(tmp_path: Path, mock_argv, train, capsys):
    """--decoupled-lr adds parameter groups: a torch-format resume without it is refused
    naming the flag and --no-load-optim, not with torch's own message."""
    from mg.trainer.cli import main

    save = ["--ckpt-format", "torch", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    train(mock_argv(tmp_path, *save, "--decoupled-lr", "1e-2", iters=4))
    argv = mock_argv(tmp_path, *save, "--load", str(tmp_path / "ckpt"), iters=6)
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--decoupled-lr" in error and "--no-load-optim" in error
    assert main([*argv, "--no-load-optim"]) == 0
