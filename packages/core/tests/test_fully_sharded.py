"""Fully sharded construction on 2 gloo ranks: a meta model is sharded before it gets storage,
so each rank allocates half of it, and the shards are the single-process model's values.

This file is also the rank worker (`python test_fully_sharded.py OUT`). Each rank builds
a tiny Llama on the meta device and runs `construct` with FSDP (ZeRO-3); it reports the
parameter elements it holds, whether every full tensor equals the model built whole with
the same seed (built after the check, so it cannot hide the peak), the FSDP units, the
reduce-scatters of two micro-batches (none for the first, under `no_gradient_sync`), and
the gradient norm over the shards after them, the same batch on both ranks (gradients
averaged over equal ranks: the single-process model's norm).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from mg.core.models import GPTModel, presets
from mg.core.models.output_head import OutputModuleHead
from mg.core.parallel.construct import ConstructOptions, construct
from mg.core.parallel.fully_sharded import (
    FullyShardedOptions,
    grad_norm_squares,
    no_gradient_sync,
    output_unit,
    sublayer_units,
    units,
)
from mg.core.parallel.fully_sharded_gloo import AllReduceScatter
from mg.core.parallel.layout import build_parallel_layout
from mg.core.testing.launch import launch_workers

SEED = 1234


def _config():
    return presets.tiny_llama(
        num_layers=3, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48
    )


def _batch() -> torch.Tensor:
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(7))


def _worker(out: str) -> None:
    dist.init_process_group("gloo")
    layout = build_parallel_layout(2, dist.get_rank())
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = GPTModel(_config())
    options = ConstructOptions(
        layout=layout,
        device=torch.device("cpu"),
        seed=SEED,
        fully_sharded=FullyShardedOptions("optim_grads_params"),
    )
    model = construct(model, options)
    held = sum(p.to_local().numel() for p in model.parameters())
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    tokens = _batch()
    reduced: list[int] = []  # FSDP2's reduce-scatters (on gloo: AllReduceScatter), counted
    original = AllReduceScatter.__call__
    AllReduceScatter.__call__ = lambda *a, **k: (reduced.append(1), original(*a, **k))[1]
    with no_gradient_sync(model):  # two micro-batches: the first without a reduction
        model(tokens, labels=tokens).mean().backward()
    first = len(reduced)
    model(tokens, labels=tokens).mean().backward()
    AllReduceScatter.__call__ = original
    norm = float(grad_norm_squares([p.grad for p in model.parameters()]).sqrt())
    torch.manual_seed(SEED)
    reference = GPTModel(_config())
    equal = all(torch.equal(full[n], p) for n, p in reference.named_parameters())
    for _ in range(2):
        reference(tokens, labels=tokens).mean().backward()
    expected = float(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    )
    result = {
        "held": held,
        "numel": sum(p.numel() for p in reference.parameters()),
        "equal": equal,
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "norm": norm,
        "reductions": [first, len(reduced) - first],
        "expected_norm": expected,
    }
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # ~50 s on 2 cores; the trainer's DP=2 test runs this path by default
def test_meta_model_is_sharded_before_storage_and_equals_one_process(tmp_path) -> None:
    out = tmp_path / "ranks.json"
    launch_workers(__file__, 2, [str(out)], timeout=300)
    ranks = json.loads(out.read_text())
    numel = ranks[0]["numel"]
    assert sum(r["held"] for r in ranks) == numel  # one copy between the two ranks
    for r in ranks:
        assert r["equal"] and r["dtensors"]
        # the (untied) embedding, 3 layers, the output layer, the root (the final norm)
        assert r["units"] == 1 + 3 + 1 + 1
        assert r["norm"] == pytest.approx(r["expected_norm"], rel=1e-5)
        assert r["reductions"] == [0, 6]  # one per unit, after the last micro-batch only


def test_units_are_the_embedding_the_layers_and_the_output_layer() -> None:
    """The head's weight is a unit of its own where the plain head can call its module:
    the untied output layer, or the tied embedding; another head keeps it in the root."""
    with torch.device("meta"):
        tied = GPTModel(presets.tiny_gpt2(num_layers=2))
        untied = GPTModel(_config())
        fused = GPTModel(_config())
    assert output_unit(tied) is tied.embedding
    assert units(tied) == [tied.embedding, *tied.decoder.layers]
    assert output_unit(untied) is untied.output_layer
    assert units(untied) == [untied.embedding, *untied.decoder.layers, untied.output_layer]
    fused.output_head = OutputModuleHead()  # e.g. a quantized output layer's
    assert output_unit(fused) is None
    assert units(fused) == [fused.embedding, *fused.decoder.layers]


def test_a_large_layers_linear_layers_are_units_inside_it() -> None:
    """Above `min_bytes` of parameters a layer's attention and MLP linear layers become
    units (in forward order); at or below it the layer stays one unit."""
    with torch.device("meta"):
        model = GPTModel(presets.tiny_gpt2(num_layers=2))
    layers = list(model.decoder.layers)
    size = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    assert sublayer_units(layers, min_bytes=size) == {}
    split = sublayer_units(layers, min_bytes=size - 1)
    attention, mlp = layers[1].self_attention, layers[1].mlp
    expected = [attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2]
    assert split[layers[1]] == expected and len(split) == 2


if __name__ == "__main__":
    _worker(sys.argv[1])
