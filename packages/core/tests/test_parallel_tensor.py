"""Tensor and sequence parallelism on 4 gloo ranks against the same model on one process.

This file is also the rank worker (`python test_parallel_tensor.py OUT_DIR`
under RANK/WORLD_SIZE/MASTER_*). Each rank builds the full model (same seed),
keeps an unsharded copy as the reference, shards the other with
`apply_tensor_parallel`, and compares the loss, every gradient (gathered from
its shards), the global gradient norm, the logits, and the parameters after
three AdamW steps.

Tolerance (fp32): tensor parallelism changes only the order of floating-point
sums (a matmul's inner sum split in tp pieces then all-reduced, the softmax
denominator summed per vocab shard), ~1e-7 relative per operation; losses
agree to 1e-5 relative and gradients to 1e-5 of their largest entry. After
three AdamW steps (lr 1e-2) parameters agree to 1e-4: Adam divides by
sqrt(v), so for a gradient entry near zero a 1e-7 difference can move the
update by a visible fraction of lr.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mg.core.models import GPTModel, presets
from mg.core.parallel import ParallelDims
from mg.core.parallel.grad_norm import clip_grad_norm
from mg.core.parallel.tensor_parallel import (
    TensorParallelError,
    apply_tensor_parallel,
    sync_tensor_parallel_grads,
)
from mg.core.testing.launch import launch_workers

WORLD = 4
SCENARIOS = [
    ("gpt2", 2, False),
    ("gpt2", 2, True),
    ("gpt2", 4, True),
    ("llama", 2, False),
    ("llama", 2, True),
    ("gpt2_untied_nobias", 4, False),
]
LOSS_RTOL = 1e-5
GRAD_TOL = 1e-5
PARAM_ATOL = 1e-4


def _config(name: str):
    if name == "llama":
        return presets.tiny_llama(hidden_size=32, ffn_hidden_size=48, seq_length=16)
    overrides = dict(hidden_size=32, seq_length=16, attention_dropout=0.0, hidden_dropout=0.0)
    if name == "gpt2_untied_nobias":
        overrides |= dict(untie_embeddings_and_output_weights=True, add_bias_linear=False)
    return presets.tiny_gpt2(**overrides)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _scenario(name: str, tp: int, sp: bool) -> dict:
    mesh = ParallelDims.from_world(WORLD, tp=tp).build_mesh()
    torch.manual_seed(0)
    reference = GPTModel(_config(name))
    model = copy.deepcopy(reference)
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sp)
    g = torch.Generator().manual_seed(7 + mesh.rank("dp"))
    tokens = torch.randint(0, 128, (2, 17), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    result: dict = {}
    loss_ref = reference(inputs, labels=labels).mean()
    loss = model(inputs, labels=labels).mean()
    loss_ref.backward()
    loss.backward()
    sync_tensor_parallel_grads(model)
    result["loss"] = [float(loss), float(loss_ref)]
    grads = dict(model.named_parameters())
    worst = 0.0
    for pname, p_ref in reference.named_parameters():
        g_tp = _full(grads[pname].grad)
        scale = float(p_ref.grad.abs().max()) or 1.0
        worst = max(worst, float((g_tp - p_ref.grad).abs().max()) / scale)
    result["grad_rel"] = worst
    result["placements"] = {
        n: str(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)
    }
    result["partial_grads"] = [
        n
        for n, p in model.named_parameters()
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements
    ]
    norm = clip_grad_norm(model.parameters(), 1e-3)
    norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    result["norm"] = [norm, float(norm_ref)]
    with torch.no_grad():
        logits = model(inputs)
        result["logits"] = float((logits - reference(inputs)).abs().max())
    for m in (model, reference):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            m(inputs, labels=labels).mean().backward()
            if m is model:
                sync_tensor_parallel_grads(model)
            (clip_grad_norm if m is model else torch.nn.utils.clip_grad_norm_)(m.parameters(), 1e-2)
            opt.step()
    params = dict(model.named_parameters())
    result["param_diff"] = max(
        float((_full(params[n]) - p).abs().max()) for n, p in reference.named_parameters()
    )
    return result


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {f"{n}-tp{tp}-sp{int(sp)}": _scenario(n, tp, sp) for n, tp, sp in SCENARIOS}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    launch_workers(__file__, WORLD, [str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow  # ~2 min; mg-train's test_tp_training covers the same layouts end to end
@pytest.mark.parametrize("scenario", [f"{n}-tp{tp}-sp{int(sp)}" for n, tp, sp in SCENARIOS])
def test_sharded_model_matches_single_process(reports, scenario: str) -> None:
    for rank in range(WORLD):
        r = reports[rank][scenario]
        loss, loss_ref = r["loss"]
        assert loss == pytest.approx(loss_ref, rel=LOSS_RTOL), (rank, scenario)
        assert r["grad_rel"] < GRAD_TOL, (rank, scenario)
        assert r["partial_grads"] == [], (rank, scenario)
        assert r["norm"][0] == pytest.approx(r["norm"][1], rel=LOSS_RTOL)
        assert r["logits"] < 1e-5
        assert r["param_diff"] < PARAM_ATOL


def test_sizes_that_do_not_split_are_refused() -> None:
    from mg.core.parallel.tensor_parallel import check_tensor_parallel_sizes

    with pytest.raises(TensorParallelError, match=r"num_query_groups \(2\).*\(4\)"):
        check_tensor_parallel_sizes(presets.tiny_llama(), 4)
    with pytest.raises(TensorParallelError, match="--make-vocab-size-divisible-by"):
        check_tensor_parallel_sizes(presets.tiny_gpt2(vocab_size=129), 2)


if __name__ == "__main__":
    _worker(sys.argv[1])
