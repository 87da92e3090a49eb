"""Tensor parallelism communicates as Megatron does: one all-reduce per row-parallel layer.

This file is also the rank worker (`python test_parallel_tensor_comms.py OUT_DIR`
under RANK/WORLD_SIZE/MASTER_*). Each of 2 gloo ranks shards a GPT-2-shaped
model (biases on) and counts the collectives of one forward and one
forward + backward with DTensor's `CommDebugMode`. Without sequence
parallelism a layer needs two all-reduces (attention and MLP outputs) and the
embedding one; with it, two all-gathers and two reduce-scatters per layer.
A replicated bias on a row-parallel linear must not make DTensor gather the
input and the weight to run the whole matmul on every rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from mg.core.models import GPTModel, presets
from mg.core.parallel import ParallelDims
from mg.core.parallel.tensor_parallel import apply_tensor_parallel
from mg.core.testing.launch import launch_workers

LAYERS = 2


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def _measure(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    mesh = ParallelDims.from_world(2, tp=2).build_mesh()
    torch.manual_seed(0)
    config = presets.tiny_gpt2(num_layers=LAYERS, hidden_size=32, seq_length=16)
    assert config.add_bias_linear
    model = GPTModel(config)
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), CommDebugMode() as forward:
        model(tokens[:, :-1])
    with CommDebugMode() as training:
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    return {"forward": _counts(forward), "training": _counts(training)}


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    report = {f"sp{int(sp)}": _measure(sp) for sp in (False, True)}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_row_parallel_layers_reduce_instead_of_gathering(tmp_path: Path) -> None:
    launch_workers(__file__, 2, [str(tmp_path)], timeout=300)
    report = json.loads((tmp_path / "rank0.json").read_text())
    layer_ops = 2 * LAYERS  # attention and MLP blocks
    # no SP: an all-reduce after each row-parallel linear and the vocab-parallel
    # embedding; backward all-reduces each column-parallel input's gradient and the
    # output layer's; the 3 loss all-reduces are [tokens]-sized (vocab-parallel CE)
    assert report["sp0"]["forward"] == {"all_reduce": layer_ops + 1, "all_gather_into_tensor": 1}
    assert report["sp0"]["training"] == {"all_reduce": 2 * (layer_ops + 1), "allreduce_": 3}
    # SP: all-gather before each column-parallel linear and the output layer,
    # reduce-scatter after each row-parallel one; backward swaps them
    assert report["sp1"]["forward"] == {
        "all_reduce": 1,
        "all_gather_into_tensor": layer_ops + 2,
        "reduce_scatter_tensor": layer_ops,
    }
    assert report["sp1"]["training"] == {
        "all_reduce": 1,
        "all_gather_into_tensor": 2 * layer_ops + 2,
        "reduce_scatter_tensor": 2 * layer_ops + 1,
        "allreduce_": 3,
    }


if __name__ == "__main__":
    _worker(sys.argv[1])
