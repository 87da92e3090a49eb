"""Transformer Engine's `_extra_state` (its FP8 scaling state) under pipeline parallelism: each
stage's TE modules store theirs in the `torch_dist` checkpoint under whole-model keys (the
layer's Megatron-Core ShardedObject), and a resume hands them back to the modules.

One 2-rank gloo launch of te_parallel_worker.py (the stand-in TE, whose modules' extra
state is an empty uint8 tensor): PP = 2 trains 2 iterations and saves, then resumes to 4.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mg.core.checkpoint.global_chunks import single_process_is_intended
from mg.core.testing.launch import launch_workers

pytestmark = pytest.mark.slow  # two gloo ranks, two runs
WORKER = Path(__file__).with_name("te_parallel_worker.py")
MODULES = ("linear_qkv", "linear_proj", "core_attention")


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        *("gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "16", "--max-position-embeddings", "16", "--mock-data"),
        *("--vocab-size", "127", "--data-cache-path", str(tmp_path / "cache")),
        *("--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3"),
        *("--eval-iters", "0", "--log-interval", "1", "--distributed-backend", "gloo"),
        *("--transformer-impl", "transformer_engine", "--pipeline-model-parallel-size", "2"),
        *("--save", str(tmp_path / "ckpt"), "--save-interval", "2"),
        *extra,
    ]


def test_each_stage_saves_and_restores_its_te_extra_state(tmp_path: Path) -> None:
    out = tmp_path / "losses.json"
    first = _argv(tmp_path, "--train-iters", "4", "--exit-interval", "2")
    resumed = _argv(tmp_path, "--train-iters", "4", "--load", str(tmp_path / "ckpt"))
    launch_workers(str(WORKER), 2, [str(out), json.dumps([first, resumed])], timeout=600)
    assert [len(run) for run in json.loads(out.read_text())] == [2, 2]
    folder = tmp_path / "ckpt" / "iter_0000002"
    keys = [
        f"decoder.layers.self_attention.{module}._extra_state/shard_{layer}_2"
        for module in MODULES
        for layer in (0, 1)  # layer 0 on the first stage, layer 1 on the second
    ]
    objects = {key: io.BytesIO() for key in keys}
    with single_process_is_intended():
        dcp.load(objects, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    for key, value in objects.items():
        (state,) = value  # the ShardedObject's data: the module's own, not None
        assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8, key
