"""Ring attention (context parallelism) on gloo ranks against full attention on one process.

One launch per world size runs every scenario; this file is also the rank
worker (`python test_parallel_context.py OUT_DIR` under RANK/WORLD_SIZE). Each
rank builds the same inputs from a fixed seed, computes the unsharded
reference itself (SDPA / the whole GPTModel), and compares its own shard.

Tolerance (fp32): the ring sums C partial softmax blocks through their
log-sum-exp instead of one softmax, a few ulps per element; outputs and
gradients agree with SDPA to 1e-5 absolute (values are O(1)), and a tiny
GPT's loss to 1e-6 relative with parameter gradients to 1e-5 relative of the
largest entry.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mg.core.models import GPTModel, presets
from mg.core.models.core_attention import causal_mask, sink_attention
from mg.core.parallel.context_parallel import (
    ContextParallelError,
    apply_context_parallel,
    chunk_indices,
    ring_attention,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)

ATOL = 1e-5
GRAD_RTOL = 1e-5


def _attention_case(group, heads: int, groups: int) -> dict:
    """ring_attention vs SDPA: local output rows and dq/dk/dv shards."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(7)
    b, s, d = 2, 8 * size, 8
    q = torch.randn(b, s, heads, d, generator=g, requires_grad=True)
    k = torch.randn(b, s, groups, d, generator=g, requires_grad=True)
    v = torch.randn(b, s, groups, d, generator=g, requires_grad=True)
    grad = torch.randn(b, s, heads * d, generator=g)
    ref = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=heads != groups
    )
    ref = ref.transpose(1, 2).reshape(b, s, -1)
    ref.backward(grad)
    local = [shard_sequence(t.detach(), rank, size).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group)
    out.backward(shard_sequence(grad, rank, size))
    diffs = [float((out - shard_sequence(ref, rank, size)).abs().max())]
    for mine, full in zip(local, (q, k, v), strict=True):
        diffs.append(float((mine.grad - shard_sequence(full.grad, rank, size)).abs().max()))
    gathered = unshard_sequence(out.detach(), group)
    diffs.append(float((gathered - ref.detach()).abs().max()))
    return {"case": f"attention heads={heads} groups={groups}", "diffs": diffs}


def _sink_window_case(group, window: tuple[int, int] | None, learnable: bool) -> dict:
    """ring_attention with sinks and/or a sliding window vs `sink_attention` / SDPA with
    the windowed causal mask on the whole sequence: outputs, dq/dk/dv and the sinks'
    gradient (summed over the cp ranks)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(5)
    b, s, heads, groups, d = 2, 8 * size, 4, 2, 8
    q = torch.randn(b, s, heads, d, generator=g, requires_grad=True)
    k = torch.randn(b, s, groups, d, generator=g, requires_grad=True)
    v = torch.randn(b, s, groups, d, generator=g, requires_grad=True)
    sinks = (torch.randn(heads, generator=g) if learnable else torch.zeros(heads)).requires_grad_()
    grad = torch.randn(b, s, heads * d, generator=g)
    allowed = causal_mask(s, window, q.device)
    ref = sink_attention(*(t.transpose(1, 2) for t in (q, k, v)), allowed, sinks, d**-0.5)
    ref = ref.transpose(1, 2).reshape(b, s, -1)
    ref.backward(grad)
    local = [shard_sequence(t.detach(), rank, size).requires_grad_() for t in (q, k, v)]
    mine = sinks.detach().clone().requires_grad_()
    out = ring_attention(*local, group, sinks=mine, window_size=window)
    out.backward(shard_sequence(grad, rank, size))
    diffs = [float((out - shard_sequence(ref, rank, size)).abs().max())]
    for part, full in zip(local, (q, k, v), strict=True):
        diffs.append(float((part.grad - shard_sequence(full.grad, rank, size)).abs().max()))
    dist.all_reduce(mine.grad, group=group)
    diffs.append(float((mine.grad - sinks.grad).abs().max()))
    name = f"attention sinks={'learnable' if learnable else 'off-by-one'} window={window}"
    return {"case": name, "diffs": diffs}


def _model_case(group, preset: str) -> dict:
    """A tiny GPT with ring attention: summed loss and all-reduced grads equal one process."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    overrides = {}
    if preset == "tiny_gpt_oss":  # sinks, every other layer a sliding window of 5
        preset = "tiny_llama"
        overrides = {"softmax_type": "learnable", "window_size": (5, 0), "window_attn_skip_freq": 2}
    config = getattr(presets, preset)(attention_dropout=0.0, hidden_dropout=0.0, **overrides)
    torch.manual_seed(3)
    reference = GPTModel(config)
    torch.manual_seed(3)
    model = apply_context_parallel(GPTModel(config), group)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1), generator=g)
    mask = (torch.rand(2, config.seq_length, generator=g) > 0.2).float()
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}
    ref_loss = (reference(batch["tokens"], labels=batch["labels"]) * mask).sum() / mask.sum()
    ref_loss.backward()
    local = shard_batch(batch, rank, size)
    per_token = model(local["tokens"], position_ids=local["position_ids"], labels=local["labels"])
    local_sum = (per_token * local["loss_mask"]).sum()
    tokens_total = local["loss_mask"].sum()
    dist.all_reduce(tokens_total, group=group)
    (local_sum / tokens_total).backward()
    loss = local_sum.detach().clone()
    dist.all_reduce(loss, group=group)
    loss /= tokens_total
    grad_diff = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        dist.all_reduce(p.grad, group=group)  # Megatron sums gradients over the cp ranks
        scale = float(q.grad.abs().max()) or 1.0
        grad_diff = max(grad_diff, float((p.grad - q.grad).abs().max()) / scale)
    return {
        "case": f"model {preset}",
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "grad_diff": grad_diff,
    }


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    results = [
        _attention_case(group, heads=4, groups=4),
        _attention_case(group, heads=4, groups=2),
        _model_case(group, "tiny_llama"),
        _model_case(group, "tiny_gpt2"),
        _sink_window_case(group, window=None, learnable=True),
        _sink_window_case(group, window=(3, 0), learnable=False),
        _sink_window_case(group, window=(5, 0), learnable=True),
        _sink_window_case(group, window=(0, 0), learnable=True),
        _model_case(group, "tiny_gpt_oss"),
    ]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp: Path, world: int) -> list[list[dict]]:
    from mg.core.testing.launch import launch_workers

    launch_workers(__file__, world, [str(tmp)], timeout=240)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def results(request, tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    return _launch(tmp_path_factory.mktemp(f"cp{request.param}"), request.param)


def test_chunk_layout_is_megatron_load_balanced() -> None:
    # 16 tokens, C=2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_indices(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_indices(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    whole = torch.cat([chunk_indices(24, r, 3) for r in range(3)]).sort().values
    assert whole.tolist() == list(range(24))
    with pytest.raises(ContextParallelError, match="divisible by 2 × context-parallel size"):
        chunk_indices(10, 0, 3)


def test_shard_batch_adds_global_positions_and_refuses_masks() -> None:
    tokens = torch.arange(16).view(1, 16)
    out = shard_batch({"tokens": tokens, "labels": tokens + 1, "loss_mask": tokens}, 1, 2)
    assert out["position_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert out["labels"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    with pytest.raises(ContextParallelError, match="--reset-attention-mask"):
        shard_batch({"tokens": tokens, "attention_mask": torch.ones(1, 1, 16, 16)}, 0, 2)


def test_ring_attention_equals_full_attention(results) -> None:
    for rank_results in results:
        for case in rank_results:
            if case["case"].startswith("attention"):
                assert max(case["diffs"]) < ATOL, case


def test_model_loss_and_gradients_equal_one_process(results) -> None:
    for rank_results in results:
        for case in rank_results:
            if case["case"].startswith("model"):
                assert case["loss"] == pytest.approx(case["ref_loss"], rel=1e-6), case
                assert case["grad_diff"] < GRAD_RTOL, case


if __name__ == "__main__":
    _worker(sys.argv[1])
