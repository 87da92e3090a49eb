"""Shard-aware construction on 4 gloo ranks: each rank allocates only its part, and its
part equals the single-process model built with the same seed, bit for bit.

This file is also the rank worker (`python test_parallel_materialize.py OUT_DIR`).
For TP=2×PP=2, TP=4 and PP=4 (interleaved too) each rank builds on the meta
device, applies tensor parallelism, keeps its pipeline chunks and materialises
them; it then compares every tensor it holds with the slice of the reference
model (built whole, once, after the check so it cannot hide the peak), and
reports how many parameter elements it allocated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from mg.core.models import GPTModel, presets
from mg.core.parallel.layout import build_parallel_layout
from mg.core.parallel.materialize import materialize, owned_tensors
from mg.core.parallel.pipeline import split_model
from mg.core.parallel.tensor_parallel import apply_tensor_parallel
from mg.core.testing.launch import launch_workers

WORLD = 4
LAYOUTS = [(2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 2, 2)]
"""(tp, pp, virtual) — TP=2×PP=2, TP=4, PP=4, PP=2 interleaved over 2 chunks each."""
CONFIGS = {
    "gpt2": lambda: presets.tiny_gpt2(num_layers=4, hidden_size=32, seq_length=16),
    "llama": lambda: presets.tiny_llama(
        num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48
    ),
}


def _scenario(name: str, tp: int, pp: int, virtual: int) -> dict:
    config = CONFIGS[name]()
    layout = build_parallel_layout(
        WORLD, dist.get_rank(), tp=tp, pp=pp, virtual=virtual, tied_embedding=True
    )
    with torch.device("meta"):
        model = GPTModel(config)
    if tp > 1:
        apply_tensor_parallel(model, layout.tp_mesh, False, device=torch.device("cpu"))
    parts = split_model(model, layout.pp_rank, pp, virtual) if pp > 1 else [model]
    torch.manual_seed(11)
    materialize(parts, config, torch.device("cpu"))
    owned = owned_tensors(parts)
    allocated = sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel()
        for tensors in owned.values()
        for t in tensors
    )
    torch.manual_seed(11)
    reference = GPTModel(config).state_dict()
    mismatched = []
    for name_, tensors in owned.items():
        for tensor in tensors:
            expected = reference[name_]
            if isinstance(tensor, DTensor):
                expected = distribute_tensor(
                    expected, tensor.device_mesh, tensor.placements, src_data_rank=None
                ).to_local()
                tensor = tensor.to_local()
            if not torch.equal(tensor, expected):
                mismatched.append(name_)
    return {
        "allocated": allocated,
        "whole": sum(t.numel() for t in reference.values()),
        "mismatched": mismatched,
        "names": sorted(owned),
        "reference_names": sorted(reference),
    }


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    results = {
        f"{name}-tp{tp}-pp{pp}-v{v}": _scenario(name, tp, pp, v)
        for name in CONFIGS
        for tp, pp, v in LAYOUTS
    }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("materialize")
    launch_workers(__file__, WORLD, [str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("tp", "pp", "virtual"), LAYOUTS)
def test_each_rank_holds_its_part_of_the_single_process_model(
    reports, name: str, tp: int, pp: int, virtual: int
) -> None:
    key = f"{name}-tp{tp}-pp{pp}-v{virtual}"
    ranks = [r[key] for r in reports]
    assert all(not r["mismatched"] for r in ranks), [r["mismatched"] for r in ranks]
    whole = ranks[0]["whole"]
    # every tensor of the model is held somewhere, and no rank holds more than about its
    # share (the tied embedding's copy and replicated norms are the excess)
    assert set().union(*(r["names"] for r in ranks)) == set(ranks[0]["reference_names"])
    for r in ranks:
        assert r["allocated"] < whole * (1.0 / (tp * pp) + 0.35), (r["allocated"], whole)
    if tp * pp == WORLD:  # the model split over all ranks: together they hold it once or so
        assert sum(r["allocated"] for r in ranks) < whole * 1.4


if __name__ == "__main__":
    _worker(sys.argv[1])
