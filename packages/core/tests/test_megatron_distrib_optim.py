"""`distrib_optim.pt` both ways with megatron-core 0.16.1 (CPU, one rank).

Megatron-Core's DDP + DistributedOptimizer train one step and save their
parameter state; ours loads it and finds every parameter's Adam moments and main
weights where Megatron keeps them. Then ours steps and saves, and megatron-core
loads that file. Both with one bucket and with several (overlapped reduction,
small buckets), GPT-2 (tied, biases) and Llama (untied, RMSNorm, SwiGLU) shapes; and an
MoE with its experts apart (Megatron's ChainedOptimizer: [dense, experts]).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mg.core.models import TransformerConfig
from mg.core.models.gpt import GPTModel
from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.megatron_buffers import megatron_parameter_order
from mg.core.testing.megatron_reference import tiny_config as _config

pytestmark = pytest.mark.compat


@pytest.fixture
def megatron(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
        pytest.importorskip("megatron.core")
        from mg.core.testing.megatron_reference import (
            megatron_on_cpu,
            megatron_optimizer_cpu_patches,
        )

        with megatron_on_cpu(tmp_path):
            patches = pytest.MonkeyPatch()
            megatron_optimizer_cpu_patches(patches)
            try:
                yield
            finally:
                patches.undo()


def _megatron_run(config: TransformerConfig, bucket_size: int | None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mg.core.testing.megatron_reference import megatron_gpt_model

    model = megatron_gpt_model(config).train()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp]
    )
    return model, ddp, optimizer.chained_optimizers[0]


def _step_megatron(ddp, optimizer) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    ddp.zero_grad_buffer()
    ddp(tokens, positions, None, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]


def _ours(config: TransformerConfig, megatron_model, bucket_size: int | None):
    model = GPTModel(config)
    theirs = dict(megatron_model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(theirs[name])
    optimizer = DistributedOptimizer(
        [{"params": list(model.parameters())}],
        lambda groups: torch.optim.AdamW(groups, lr=1e-2),
        bucket_size=bucket_size,
        overlap_grad_reduce=bucket_size is not None,
        model=model,
    )
    return model, optimizer


def _their_state(megatron_model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {
            key: value.detach().clone().view(-1)
            for key, value in optimizer._get_main_param_and_optimizer_states(param).items()
            if key != "step"
        }
        for name, param in megatron_model.named_parameters()
    }


def _our_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    full = optimizer.state_dict()["state"]
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: {
            "param": p.detach().view(-1),
            "exp_avg": full[i]["exp_avg"].view(-1),
            "exp_avg_sq": full[i]["exp_avg_sq"].view(-1),
        }
        for i, p in enumerate(optimizer.params)
    }


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_our_parameter_order_is_megatrons(megatron, shape) -> None:
    from mg.core.testing.megatron_reference import megatron_gpt_model

    config = _config(shape)
    theirs = [n for n, _ in megatron_gpt_model(config).named_parameters()]
    ours = [n for n, _ in GPTModel(config).named_parameters()]
    assert megatron_parameter_order(ours) == theirs


@pytest.mark.parametrize(("shape", "bucket_size"), [("gpt2", None), ("llama", 5000)])
def test_distrib_optim_pt_both_ways(megatron, tmp_path, shape, bucket_size) -> None:
    config = _config(shape)
    their_model, ddp, their_opt = _megatron_run(config, bucket_size)
    _step_megatron(ddp, their_opt)
    their_opt.save_parameter_state(str(tmp_path / "megatron.pt"))
    saved = torch.load(tmp_path / "megatron.pt", weights_only=True)

    model, ours = _ours(config, their_model, bucket_size)
    buffers = ours.megatron_buffers([model])
    (entry,) = saved[0].values()
    assert [b.numel_unpadded for b in buffers] == [entry["numel_unpadded"]]
    ours.load_parameter_state(saved, buffers, step=1, source="megatron.pt")
    expected, got = _their_state(their_model, their_opt), _our_state(model, ours)
    assert set(got) == set(expected)
    for name in expected:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][key], expected[name][key]), (name, key)
    # ours writes the same bytes in the same places
    written = ours.parameter_state_dp_zero(buffers)
    (ours_entry,) = written[0].values()
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ours_entry[key], entry[key]), key

    # ours steps on, saves; megatron-core loads it and holds the same numbers
    model.train()
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens, torch.arange(16).expand(2, 16), labels=tokens).float().mean().backward()
    ours.finish_grad_sync()
    ours.step()
    torch.save(ours.parameter_state_dp_zero(buffers), tmp_path / "ours.pt")
    # Megatron's torch-Adam fallback keeps `step` per parameter, where TE's and Apex's
    # FusedAdam (what its GPU runs use) keep it in the groups: take it out while loading.
    steps = {p: s.pop("step") for p, s in their_opt.optimizer.state.items()}
    with torch.no_grad():  # fp32 main parameters are views of the model's (on GPU too)
        their_opt.load_parameter_state(str(tmp_path / "ours.pt"))
    for p, step in steps.items():
        their_opt.optimizer.state[p]["step"] = step
    expected, got = _our_state(model, ours), _their_state(their_model, their_opt)
    for name in expected:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][key], expected[name][key]), (name, key)


def _moe_config() -> TransformerConfig:
    import dataclasses

    moe = {"num_moe_experts": 4, "moe_ffn_hidden_size": 16, "moe_router_topk": 2}
    return dataclasses.replace(_config("llama"), **moe, moe_aux_loss_coeff=0.0)


def _experts_apart(model: torch.nn.Module) -> None:
    """Mark the routed experts as Megatron marks expert-parallel ones (allreduce=False), so
    both sides keep them apart on one rank: Megatron's DDP in `expert_parallel_buffers` and
    a second DistributedOptimizer (a ChainedOptimizer), ours in the expert part."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def test_chained_distrib_optim_pt_both_ways(megatron, tmp_path) -> None:
    """The experts apart: Megatron's ChainedOptimizer writes `distrib_optim.pt` as
    [dense state, expert state]; ours loads it (every parameter's main weight and Adam
    moments where Megatron keeps them), writes the same bytes, steps, saves, and
    megatron-core's ChainedOptimizer loads that."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mg.core.parallel.expert_optimizer import ExpertParallelDistributedOptimizer
    from mg.core.testing.megatron_reference import megatron_gpt_model

    config = _moe_config()
    their_model = megatron_gpt_model(config).train()
    _experts_apart(their_model)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True
    )
    ddp = DistributedDataParallel(their_model.config, ddp_config, their_model)
    chained = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp]
    )
    assert len(chained.chained_optimizers) == 2  # dense, experts
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16))
    ddp.zero_grad_buffer()
    ddp(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    assert chained.step()[0]
    chained.save_parameter_state(str(tmp_path / "megatron.pt"))
    saved = torch.load(tmp_path / "megatron.pt", weights_only=True)
    assert isinstance(saved, list) and len(saved) == 2

    model = GPTModel(config)
    theirs = dict(their_model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(theirs[name])
    _experts_apart(model)
    ours = ExpertParallelDistributedOptimizer(
        [{"params": list(model.parameters())}],
        lambda groups: torch.optim.AdamW(groups, lr=1e-2),
        dp_group=None,
        expert_dp_group=None,
        ep_group=None,
    )
    groups = [{"optimizer": {"param_groups": [{"step": 1.0}]}}] * 2
    ours.load_parameter_states(groups, [saved, saved], [model], ["megatron.pt"] * 2)
    expected = {
        name: {
            key: value.detach().clone().view(-1)
            for key, value in part._get_main_param_and_optimizer_states(theirs[name]).items()
            if key != "step"
        }
        for part in chained.chained_optimizers
        for name in theirs
        if any(
            theirs[name] is p for g in part.model_float16_groups + part.model_fp32_groups for p in g
        )
    }
    assert set(expected) == set(theirs)
    names = {id(p): n for n, p in model.named_parameters()}
    full = {}
    for part in (ours.dense, ours.experts):
        state = part.state_dict()["state"]
        for i, p in enumerate(part.params):
            full[names[id(p)]] = {
                "param": p.detach().view(-1),
                "exp_avg": state[i]["exp_avg"].view(-1),
                "exp_avg_sq": state[i]["exp_avg_sq"].view(-1),
            }
    for name in expected:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full[name][key], expected[name][key]), (name, key)
    written = ours.parameter_state_dp_zero([model])
    for mine, theirs_part in zip(written, saved, strict=True):
        for index in (k for k in theirs_part if k != "buckets_coalesced"):
            (a,), (b,) = mine[index].values(), theirs_part[index].values()
            for key in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a[key], b[key]), (index, key)

    # ours steps on and saves; megatron-core's ChainedOptimizer loads it
    model.train()
    model(tokens, torch.arange(16).expand(2, 16), labels=tokens).float().mean().backward()
    ours.finish_grad_sync()
    ours.step()
    torch.save(ours.parameter_state_dp_zero([model]), tmp_path / "ours.pt")
    inner = [part.optimizer.state for part in chained.chained_optimizers]
    steps = [{p: s.pop("step") for p, s in state.items()} for state in inner]
    with torch.no_grad():
        chained.load_parameter_state(str(tmp_path / "ours.pt"))
    for state, popped in zip(inner, steps, strict=True):
        for p, step in popped.items():
            state[p]["step"] = step
    for part in (ours.dense, ours.experts):
        state = part.state_dict()["state"]
        for i, p in enumerate(part.params):
            name = names[id(p)]
            owner = next(
                o
                for o in chained.chained_optimizers
                if any(
                    theirs[name] is q
                    for g in o.model_float16_groups + o.model_fp32_groups
                    for q in g
                )
            )
            got = owner._get_main_param_and_optimizer_states(theirs[name])
            assert torch.equal(got["param"].view(-1), p.detach().view(-1)), name
            assert torch.equal(got["exp_avg"].view(-1), state[i]["exp_avg"].view(-1)), name
