"""FSDP2's collectives on gloo, in place, on 3 gloo ranks (an odd count: uneven chunks).

This file is also the rank worker (`python test_fully_sharded_gloo.py OUT`). Each rank
checks the broadcast all-gather and the all-reduce reduce-scatter against gloo's own
collectives, then trains GPT-2 under ZeRO-3 for three steps, against the model trained
whole in one process: untied, reporting which collectives its units use, whether the
embedding's gathered weight lives in the all-gather's output (held once, not copied out
of it) and whether a pending all-gather keeps a copy of this rank's part; tied, with the
weight sharded by vocabulary rows outside every unit (`mg.core.parallel.vocab_shards`).
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


def _config(untied: bool):  # learned positions: a unit of their own; 101 rows: uneven shards
    return presets.tiny_gpt2(
        num_layers=2, vocab_size=101, untie_embeddings_and_output_weights=untied
    )


def _collectives_match_gloo(group: dist.ProcessGroup) -> dict[str, bool]:
    rank = dist.get_rank()
    shard = torch.randn(7, 5, generator=torch.Generator().manual_seed(rank))
    expected = torch.empty(WORLD * 7, 5)
    dist.all_gather_into_tensor(expected, shard, group=group)
    comm = BroadcastAllGather(torch.nn.Module())  # not a unit: a buffer of its own
    output = comm.allocate((WORLD * 35,), dtype=torch.float32, device=torch.device("cpu"))
    own = output.narrow(0, 35 * rank, 35)
    own.copy_(shard.view(-1))  # FSDP2's copy-in
    work = comm(output, own, group)  # runs when waited for; until then the output is empty
    lazy = output.untyped_storage().nbytes() == 0
    gathered = lazy and work.wait() and torch.equal(output.view(-1, 5), expected)
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


def _train(model, batches: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens in batches:
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded(untied: bool):
    options = ConstructOptions(
        layout=build_parallel_layout(WORLD, dist.get_rank()),
        device=torch.device("cpu"),
        seed=SEED,
        fully_sharded=FullyShardedOptions("optim_grads_params", split_layer_bytes=0),
    )
    torch.manual_seed(SEED)
    with torch.device("meta"):
        return construct(GPTModel(_config(untied)), options)


def _whole(untied: bool) -> GPTModel:
    torch.manual_seed(SEED)
    return GPTModel(_config(untied))


def _worker(out: str) -> None:
    dist.init_process_group("gloo")
    result = _collectives_match_gloo(dist.group.WORLD)
    draw = torch.Generator().manual_seed(3)
    short, long = (torch.randint(0, 101, shape, generator=draw) for shape in ((2, 12), (3, 32)))
    # tied: 24 tokens a rank (fewer than hidden 64) exchange logits, 96 gather the rows
    batches = [short, long, short]
    # untied: the embedding's and the output layer's units hold one weight each
    model = _sharded(untied=True)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    gathers = [m._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm for m in units]
    outputs: list[int] = []  # where each all-gather's output lives
    allocate = BroadcastAllGather.allocate

    def recorded(self, *args, **kwargs):
        buffer = allocate(self, *args, **kwargs)
        outputs.append(buffer.untyped_storage()._cdata)  # the storage, not its memory
        return buffer

    call = BroadcastAllGather.__call__
    copies: list[bool] = []  # whether a pending all-gather keeps a copy of its own part

    def called(self, *args, **kwargs):
        work = call(self, *args, **kwargs)
        copies.append(work._own is not None)
        return work

    BroadcastAllGather.allocate, BroadcastAllGather.__call__ = recorded, called
    weights: list[int] = []  # where the gathered embedding weight lives (FSDP2's
    model.embedding.register_forward_pre_hook(  # pre-forward hook, which gathers it, ran)
        lambda module, _: weights.append(module.word_embeddings.weight.untyped_storage()._cdata)
    )
    losses = _train(model, [short] * 3)
    BroadcastAllGather.allocate, BroadcastAllGather.__call__ = allocate, call
    result.update(
        units=len(units),
        copies_kept=any(copies),
        gathers=len(copies),
        broadcast=all(isinstance(g, BroadcastAllGather) for g in gathers),
        gathered_in_place=weights[-1] in outputs,
        losses=losses,
        expected=_train(_whole(untied=True), [short] * 3),
    )
    # tied: the weight stays sharded by vocabulary rows, outside every unit
    model = _sharded(untied=False)
    weight = model.embedding.word_embeddings.weight
    result.update(
        tied_units=sum(isinstance(m, FSDPModule) for m in model.modules()),
        tied_rows=weight.to_local().shape[0],
        tied_losses=_train(model, batches),
        tied_expected=_train(_whole(untied=False), batches),
    )
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def test_in_place_collectives_and_vocabulary_shards_match_one_process(tmp_path) -> None:
    out = tmp_path / "ranks.json"
    launch_workers(__file__, WORLD, [str(out)], timeout=300)
    for rank, result in enumerate(json.loads(out.read_text())):
        assert result["all_gather"]
        assert all(v for k, v in result.items() if k.startswith("reduce_scatter"))
        # the embedding, its positions, 2 layers with their qkv, proj, fc1 and fc2, the
        # output layer, the root
        assert result["units"] == 2 + 2 * 5 + 1 + 1
        assert result["broadcast"]
        # re-read from the shards at the wait, not copied while pending
        assert result["gathers"] > 0 and not result["copies_kept"]
        assert result["gathered_in_place"]
        assert result["losses"] == pytest.approx(result["expected"], rel=1e-5)
        # tied: positions, 2 layers with their 4 linear layers, the root; the weight's 101
        # rows as torch.chunk splits
        assert result["tied_units"] == 1 + 2 * 5 + 1
        assert result["tied_rows"] == [34, 34, 33][rank]
        assert result["tied_losses"] == pytest.approx(result["tied_expected"], rel=1e-5)


if __name__ == "__main__":
    _worker(sys.argv[1])
