"""FSDP2's collectives on gloo, in place, on 3 gloo ranks (an odd count: uneven chunks).

This file is also the rank worker (`python test_fully_sharded_gloo.py OUT`). Each rank
checks the broadcast all-gather and the all-reduce reduce-scatter against gloo's own
collectives, then trains a tied GPT-2 under ZeRO-3 for two steps and reports which
collectives its units use, whether the embedding's gathered weight lives in the
all-gather's output (held once, not copied out of it), and its losses, against the
model trained whole in one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from mg.core.models import GPTModel, presets
from mg.core.parallel.construct import ConstructOptions, construct
from mg.core.parallel.fully_sharded import FullyShardedOptions
from mg.core.parallel.fully_sharded_gloo import AllReduceScatter, BroadcastAllGather
from mg.core.parallel.layout import build_parallel_layout
from mg.core.testing.launch import launch_workers

SEED = 99
WORLD = 3


def _config():  # learned positions: a unit of their own; 101 vocab rows: padded shards
    return presets.tiny_gpt2(num_layers=2, vocab_size=101)


def _collectives_match_gloo(group: dist.ProcessGroup) -> dict[str, bool]:
    rank = dist.get_rank()
    shard = torch.randn(7, 5, generator=torch.Generator().manual_seed(rank))
    expected = torch.empty(WORLD * 7, 5)
    dist.all_gather_into_tensor(expected, shard, group=group)
    comm = BroadcastAllGather(torch.nn.Module())  # not a unit: a buffer of its own
    output = comm.allocate((WORLD * 35,), dtype=torch.float32, device=torch.device("cpu"))
    own = output.narrow(0, 35 * rank, 35)
    own.copy_(shard.view(-1))  # FSDP2's copy-in
    done = comm(output, own, group).wait()  # finished on return
    gathered = done and torch.equal(output.view(-1, 5), expected)
    whole = torch.randn(WORLD * 4, 6, generator=torch.Generator().manual_seed(10 + rank))
    results = {"all_gather": gathered}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        reference = torch.empty(4, 6)
        dist.reduce_scatter_tensor(reference, whole.clone(), op=op, group=group)
        mine, given = torch.empty(4 * 6), whole.clone().view(-1)
        AllReduceScatter()(mine, given, group, op)
        results[f"reduce_scatter_{op}"] = torch.allclose(mine.view(4, 6), reference, rtol=1e-6)
        results[f"reduce_scatter_{op}_released"] = given.untyped_storage().size() == 0
    return results


def _worker(out: str) -> None:
    dist.init_process_group("gloo")
    result = _collectives_match_gloo(dist.group.WORLD)
    options = ConstructOptions(
        layout=build_parallel_layout(WORLD, dist.get_rank()),
        device=torch.device("cpu"),
        seed=SEED,
        fully_sharded=FullyShardedOptions("optim_grads_params"),
    )
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = construct(GPTModel(_config()), options)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    gathers = [m._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm for m in units]
    outputs: list[int] = []  # where each all-gather's output lives
    allocate = BroadcastAllGather.allocate

    def recorded(self, *args, **kwargs):
        buffer = allocate(self, *args, **kwargs)
        outputs.append(buffer.untyped_storage().data_ptr())
        return buffer

    BroadcastAllGather.allocate = recorded
    weights: list[int] = []  # where the gathered embedding weight lives (FSDP2's
    model.embedding.register_forward_pre_hook(  # pre-forward hook, which gathers it, ran)
        lambda module, _: weights.append(module.word_embeddings.weight.untyped_storage().data_ptr())
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(3):
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    BroadcastAllGather.allocate = allocate
    torch.manual_seed(SEED)
    reference = GPTModel(_config())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for _ in range(3):
        loss = reference(tokens, labels=tokens).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    result.update(
        units=len(units),
        broadcast=all(isinstance(g, BroadcastAllGather) for g in gathers),
        gathered_in_place=weights[-1] in outputs,
        losses=losses,
        expected=expected,
    )
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def test_in_place_collectives_match_gloo_and_gather_into_the_weight(tmp_path) -> None:
    out = tmp_path / "ranks.json"
    launch_workers(__file__, WORLD, [str(out)], timeout=300)
    for rank in json.loads(out.read_text()):
        assert rank["all_gather"]
        assert all(v for k, v in rank.items() if k.startswith("reduce_scatter"))
        assert (
            rank["units"] == 2 + 2 + 1 and rank["broadcast"]
        )  # embedding, positions, layers, root
        assert rank["gathered_in_place"]
        assert rank["losses"] == pytest.approx(rank["expected"], rel=1e-5)


if __name__ == "__main__":
    _worker(sys.argv[1])
