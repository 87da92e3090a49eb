"""Expert parallelism on 4 gloo ranks against the same MoE layers on one process.

This file is also the rank worker (`python test_moe_expert_parallel.py OUT_DIR`
under RANK/WORLD_SIZE/MASTER_*). Every rank builds the full model (same seed)
and keeps unsharded copies as references; the sharded copy keeps this rank's
experts (`apply_expert_parallel`) and routes its own tokens over the
expert-parallel group.

- Layer: with EP = 2 and 4, both dispatchers, dropless and capacity-limited,
  sequential and grouped experts, the output and input gradient on each rank
  equal the reference layer's on that rank's tokens; a local expert's weight
  gradient equals the reference's summed over the tokens of every rank in the
  expert-parallel group (those tokens reached it); router and shared-expert
  gradients are the rank's own (data parallelism averages them later).
- Training: a 2-layer MoE GPT, EP = 2 × expert-DP = 2 (DP = 4 for the dense
  weights), 20 AdamW steps, each rank its own batch; the reference runs the 4
  batches on one process with the aux-loss gradient scaled 1/dp as the
  data-parallel average makes it. Losses per step and all parameters agree.

Tolerance (fp32): EP changes the order of sums (an expert's gradient summed
over ranks by all-reduce); outputs and gradients agree to 1e-5 relative, the
20-step losses to 1e-5 and parameters to 1e-4 absolute (AdamW divides by
sqrt(v): tiny gradient differences move near-zero entries by a fraction of lr).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mg.core.models import TransformerConfig
from mg.core.models.gpt import GPTModel
from mg.core.models.moe import AuxLossBackward, MoELayer
from mg.core.parallel.expert_parallel import (
    ExpertParallelError,
    apply_expert_parallel,
    expert_rank_groups,
    is_expert_parameter,
)
from mg.core.parallel.layout import build_parallel_layout
from mg.core.testing.launch import launch_workers

WORLD = 4
BASE = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    vocab_size=64,
    ffn_hidden_size=32,
    seq_length=8,
    activation="swiglu",
    add_bias_linear=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    moe_ffn_hidden_size=8,
)
LAYER_CASES = {
    "dropless-aux": dict(num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    "capacity-grouped": dict(
        num_moe_experts=8,
        moe_router_topk=2,
        moe_expert_capacity_factor=1.0,
        moe_grouped_gemm=True,
        moe_aux_loss_coeff=0.01,
    ),
    "sigmoid-bias-shared": dict(
        num_moe_experts=8,
        moe_router_topk=3,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=12,
        add_bias_linear=True,
    ),
    "pad-to-capacity": dict(
        num_moe_experts=4,
        moe_expert_capacity_factor=0.5,
        moe_pad_expert_input_to_capacity=True,
        moe_token_drop_policy="position",
    ),
}
REL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 6, 16, generator=gen), torch.randn(2, 6, 16, generator=gen)


def _layer_case(fields: dict, ep_group: dist.ProcessGroup, dispatcher: str) -> dict:
    config = TransformerConfig(**{**BASE, **fields, "moe_token_dispatcher_type": dispatcher})
    layer = MoELayer(config)
    torch.manual_seed(0)
    layer.init_weights(0.3, 0.2)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, config.num_moe_experts))
    own, everyone = copy.deepcopy(layer), copy.deepcopy(layer)
    apply_expert_parallel(layer, ep_group, dispatcher)
    ep, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    local = config.num_moe_experts // ep
    rank = dist.get_rank()

    x, g = _tokens(rank)
    x.requires_grad_()
    out = layer(x)
    out.backward(g)
    x_ref = x.detach().clone().requires_grad_()
    out_ref = own(x_ref)
    out_ref.backward(g)
    for member in dist.get_process_group_ranks(ep_group):
        xm, gm = _tokens(member)
        everyone(xm).backward(gm)

    expert_rel = 0.0
    full = dict(everyone.experts.named_parameters())
    for name, param in layer.experts.named_parameters():
        ref_name = _global_expert_name(name, ep_rank * local, config.moe_grouped_gemm)
        expert_rel = max(expert_rel, _rel(param.grad, full[ref_name].grad))
    own_params = dict(own.named_parameters())
    other_rel = max(
        _rel(p.grad, own_params[n].grad)
        for n, p in layer.named_parameters()
        if not n.startswith("experts.")
    )
    report = {
        "out": _rel(out, out_ref),
        "dx": _rel(x.grad, x_ref.grad),
        "experts": expert_rel,
        "router_and_shared": other_rel,
        "local_experts": layer.experts.num_local_experts,
    }
    if layer.router.expert_bias is not None:
        report["counts_equal"] = bool(
            layer.router.local_tokens_per_expert.equal(own.router.local_tokens_per_expert)
        )
    return report


def _global_expert_name(local_name: str, offset: int, grouped: bool) -> str:
    """`local_experts.1.linear_fc1.weight` on a rank → the whole layer's expert index."""
    if grouped:  # linear_fc1.weight1
        module, param = local_name.split(".")
        stem = param.rstrip("0123456789")
        return f"{module}.{stem}{int(param[len(stem) :]) + offset}"
    _, index, rest = local_name.split(".", 2)
    return f"local_experts.{int(index) + offset}.{rest}"


def _training(layout) -> dict:
    fields = dict(num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="alltoall")
    config = TransformerConfig(**{**BASE, **fields})
    torch.manual_seed(0)
    model = GPTModel(config)
    reference = copy.deepcopy(model)
    apply_expert_parallel(model, layout.ep_group, "alltoall")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    world, rank = dist.get_world_size(), dist.get_rank()

    def batch(r: int, step: int) -> torch.Tensor:
        return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step * 97 + r))

    losses, ref_losses = [], []
    for step in range(20):
        ids = batch(rank, step)
        loss = model(ids, labels=ids).mean()
        loss.backward()
        for param in model.parameters():
            if is_expert_parameter(param):  # summed over the expert-DP replicas, 1/dp scale
                dist.all_reduce(param.grad, group=layout.expert_dp_group)
            else:
                dist.all_reduce(param.grad)
            param.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        everyone = torch.tensor([loss.item()])
        dist.all_reduce(everyone)
        losses.append(everyone.item() / world)

        AuxLossBackward.scale = 1.0 / world
        total = 0.0
        for r in range(world):
            ids = batch(r, step)
            ref_loss = reference(ids, labels=ids).mean() / world
            ref_loss.backward()
            total += ref_loss.item()
        AuxLossBackward.scale = 1.0
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(total)

    ref_params = dict(reference.named_parameters())
    local = config.num_moe_experts // layout.ep
    param_diff = 0.0
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            name = (
                f"{prefix}.mlp.experts.{_global_expert_name(rest, layout.ep_rank * local, False)}"
            )
        param_diff = max(param_diff, (param - ref_params[name]).abs().max().item())
    return {"losses": losses, "ref_losses": ref_losses, "param_diff": param_diff}


CASES = [
    f"{name}-{dispatcher}-ep{ep}"
    for name in LAYER_CASES
    for dispatcher in ("alltoall", "allgather")
    for ep in (2, 4)
]
QUICK_CASES = ["dropless-aux-alltoall-ep2", "capacity-grouped-allgather-ep2"]


def _worker(out_dir: str, mode: str) -> None:
    """mode "quick": 2 ranks, two layer cases; "full": 4 ranks, every case and training."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layouts = {2: build_parallel_layout(world, rank, ep=2)}
    if world == 4:
        layouts[4] = build_parallel_layout(world, rank, ep=4)
    ep2 = layouts[2]
    report: dict = {"layout": [ep2.ep, ep2.ep_rank, ep2.expert_dp, ep2.expert_dp_rank]}
    for case in QUICK_CASES if mode == "quick" else CASES:
        stem, ep = case.rsplit("-ep", 1)
        name, dispatcher = stem.rsplit("-", 1)
        report[case] = _layer_case(LAYER_CASES[name], layouts[int(ep)].ep_group, dispatcher)
    if mode == "full":
        report["training"] = _training(ep2)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _launch(out: Path, world: int, mode: str) -> list[dict]:
    launch_workers(__file__, world, [str(out), mode], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch(tmp_path_factory.mktemp("ep_quick"), 2, "quick")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch(tmp_path_factory.mktemp("ep"), WORLD, "full")


def _check_layer(report: dict, case: str, rank: int) -> None:
    r = report[case]
    ep = int(case.rsplit("ep", 1)[1])
    experts = 4 if case.startswith(("dropless", "pad")) else 8
    assert r["local_experts"] == experts // ep
    for key in ("out", "dx", "experts", "router_and_shared"):
        assert r[key] < REL, (rank, case, key, r[key])
    assert r.get("counts_equal", True), (rank, case)


@pytest.mark.parametrize("case", QUICK_CASES)
def test_expert_parallel_layer_matches_one_process_quick(quick, case):
    """2 ranks, EP = 2: the default run's check (the full matrix is slow)."""
    assert [r["layout"] for r in quick] == [[2, 0, 1, 0], [2, 1, 1, 0]]
    for rank, report in enumerate(quick):
        _check_layer(report, case, rank)


@pytest.mark.slow  # ~1.5 min on 2 shared cores
def test_layout_has_megatron_expert_groups(reports):
    # tp = 1: EP groups [0, 1], [2, 3]; expert-DP groups [0, 2], [1, 3]
    assert [r["layout"] for r in reports] == [
        [2, 0, 2, 0],
        [2, 1, 2, 0],
        [2, 0, 2, 1],
        [2, 1, 2, 1],
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_layer_matches_one_process(reports, case):
    for rank, report in enumerate(reports):
        _check_layer(report, case, rank)


@pytest.mark.slow
def test_expert_parallel_training_matches_one_process(reports):
    for report in reports:
        t = report["training"]
        assert t["losses"] == pytest.approx(t["ref_losses"], rel=1e-5)
        assert t["param_diff"] < 1e-4
    assert reports[0]["training"]["losses"][-1] < reports[0]["training"]["losses"][0]


def test_expert_groups_are_megatrons_and_sizes_are_checked():
    groups = expert_rank_groups(8, tp=2, ep=2)  # etp = tp
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    etp1 = expert_rank_groups(8, tp=2, pp=2, ep=2, etp=1)
    assert etp1["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert etp1["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ExpertParallelError, match="--expert-model-parallel-size"):
        expert_rank_groups(6, ep=4)


@pytest.mark.parametrize(
    ("world", "tp", "pp", "ep", "etp"),
    [
        (8, 2, 1, 2, 2),
        (8, 2, 1, 2, 1),
        (8, 2, 2, 2, 1),
        (8, 4, 1, 2, 1),
        (8, 2, 1, 4, 1),
        (8, 4, 1, 2, 2),
        (16, 4, 2, 1, 2),
    ],
)
def test_expert_groups_equal_megatron_rank_generator(world, tp, pp, ep, etp):
    """Megatron-Core's expert RankGenerator (order tp-ep-dp-pp, expert TP in place of TP)
    builds the same ep, etp, edp and tp×ep groups, expert TP equal to TP or not."""
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    edp = world // (pp * ep * etp)
    megatron = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-ep-dp-pp")
    ours = expert_rank_groups(world, tp=tp, pp=pp, ep=ep, etp=etp)
    for name, token in (("ep", "ep"), ("etp", "tp"), ("edp", "dp"), ("etp_ep", "tp-ep")):
        assert sorted(ours[name]) == sorted(megatron.get_ranks(token)), name


def test_expert_tensor_parallel_groups_below_tp_are_consecutive_tp_ranks():
    """Expert TP 2 under TP 4: each expert TP group is two consecutive ranks of one TP
    group (its sequence slices are a contiguous chunk), the EP group pairs the two halves."""
    groups = expert_rank_groups(8, tp=4, ep=2, etp=2)
    assert groups["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


class _Mesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize(
    ("etp", "sequence_parallel", "message"),
    [
        (3, True, r"--expert-tensor-parallel-size \(3\) must divide --tensor-model-parallel"),
        (2, False, "size 2 under --tensor-model-parallel-size 4 needs --sequence-parallel"),
    ],
)
def test_shard_moe_layer_refuses_expert_meshes_it_cannot_use(etp, sequence_parallel, message):
    from mg.core.models.moe.tensor_parallel import shard_moe_layer

    layer = MoELayer(TransformerConfig(**{**BASE, "num_moe_experts": 4}))
    with pytest.raises(ValueError, match=message):
        shard_moe_layer(layer, _Mesh(4), sequence_parallel, expert_mesh=_Mesh(etp))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
