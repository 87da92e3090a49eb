"""Shard-aware construction and reading on 4 gloo ranks: each rank allocates only its
part, and its part equals the single-process model built with the same seed, bit for bit,
and each rank reads only its part of a checkpoint (`load_model_part`), from any layout.

This file is also the rank worker (`python test_parallel_materialize.py OUT_DIR`).
For TP=2×PP=2, TP=4 and PP=4 (interleaved too) each rank builds on the meta
device, applies tensor parallelism, keeps its pipeline chunks and materialises
them; it then compares every tensor it holds with the slice of the reference
model (built whole, once, after the check so it cannot hide the peak), and
reports how many parameter elements it allocated. Then it reads the same model,
saved by the test in three ways (`torch` whole, `torch` at TP=2×PP=2, `torch_dist`),
into each layout and compares again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from mg.core.checkpoint import RELEASE
from mg.core.checkpoint.dist_format import save_dist_checkpoint
from mg.core.checkpoint.model_io import save_model
from mg.core.checkpoint.model_part import load_model_part
from mg.core.checkpoint.pp_split import split_pipeline
from mg.core.checkpoint.torch_format import mg_metadata, save_checkpoint_shards
from mg.core.checkpoint.tp_split import split_tensor_parallel
from mg.core.models import GPTModel, presets
from mg.core.parallel.layout import ParallelLayout, build_parallel_layout
from mg.core.parallel.materialize import materialize, owned_tensors
from mg.core.parallel.pipeline import split_model
from mg.core.parallel.tensor_parallel import apply_tensor_parallel
from mg.core.testing.launch import launch_workers

WORLD = 4
CHECKPOINTS = ("torch", "torch_tp2_pp2", "torch_dist")
LAYOUTS = [(2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 2, 2)]
"""(tp, pp, virtual) — TP=2×PP=2, TP=4, PP=4, PP=2 interleaved over 2 chunks each."""
CONFIGS = {
    "gpt2": lambda: presets.tiny_gpt2(num_layers=4, hidden_size=32, seq_length=16),
    "llama": lambda: presets.tiny_llama(
        num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48
    ),
}


def _mismatched(owned: dict[str, list[torch.Tensor]], reference: dict) -> list[str]:
    """Names of the owned tensors that differ from their slice of the reference."""
    bad = []
    for name, tensors in owned.items():
        for tensor in tensors:
            expected = reference[name]
            if isinstance(tensor, DTensor):
                expected = distribute_tensor(
                    expected, tensor.device_mesh, tensor.placements, src_data_rank=None
                ).to_local()
                tensor = tensor.to_local()
            if not torch.equal(tensor, expected):
                bad.append(name)
    return bad


def _scenario(name: str, layout: ParallelLayout, saved: Path) -> dict:
    config = CONFIGS[name]()
    torch.manual_seed(11)  # seeded before the build, as the trainer does: nothing on the
    with torch.device("meta"):  # way to materialize may draw from the generator
        model = GPTModel(config)
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.tp_mesh, False, device=torch.device("cpu"))
    parts = [model]
    if layout.pp > 1:
        parts = split_model(model, layout.pp_rank, layout.pp, layout.virtual)
    materialize(parts, config, torch.device("cpu"))
    owned = owned_tensors(parts)
    allocated = sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel()
        for tensors in owned.values()
        for t in tensors
    )
    torch.manual_seed(11)
    reference = GPTModel(config).state_dict()
    read = {}
    for kind in CHECKPOINTS:
        part = load_model_part(saved / name / kind, layout)
        read[kind] = _mismatched(owned_tensors(part.parts), reference)
    return {
        "allocated": allocated,
        "whole": sum(t.numel() for t in reference.values()),
        "mismatched": _mismatched(owned, reference),
        "read_mismatched": read,
        "names": sorted(owned),
        "reference_names": sorted(reference),
    }


def _worker(out_dir: str, saved: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for tp, pp, v in LAYOUTS:
        layout = build_parallel_layout(
            WORLD, dist.get_rank(), tp=tp, pp=pp, virtual=v, tied_embedding=True
        )
        for name in CONFIGS:
            results[f"{name}-tp{tp}-pp{pp}-v{v}"] = _scenario(name, layout, Path(saved))
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _save_checkpoints(folder: Path) -> None:
    """Each config's seed-11 model as `torch` (one file), `torch` at TP=2×PP=2 (four
    mp_rank files, Megatron's split) and `torch_dist`."""
    for name, make in CONFIGS.items():
        config = make()
        torch.manual_seed(11)
        weights = GPTModel(config).state_dict()
        meta = {"model_config": config.to_dict(), "tokenizer_config": None}
        save_model(folder / name / "torch", weights, config, None)
        tied = not config.untie_embeddings_and_output_weights
        shards = {}
        for tp, shard in enumerate(split_tensor_parallel(weights, 2, config.gated_linear_unit)):
            for pp, (chunk,) in enumerate(split_pipeline(shard, config.num_layers, 2, tied=tied)):
                shards[(tp, pp)] = {
                    "model": chunk,
                    "args": {},
                    "iteration": 0,
                    "mg": mg_metadata(**meta, tp=2, pp=2),
                }
        save_checkpoint_shards(folder / name / "torch_tp2_pp2", RELEASE, shards)
        common = {"iteration": 0, "args": {}, "mg": mg_metadata(**meta)}
        save_dist_checkpoint(folder / name / "torch_dist", RELEASE, {"model": weights}, common)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("materialize")
    _save_checkpoints(out / "saved")
    launch_workers(__file__, WORLD, [str(out), str(out / "saved")], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("tp", "pp", "virtual"), LAYOUTS)
def test_each_rank_builds_and_reads_its_part_of_the_single_process_model(
    reports, name: str, tp: int, pp: int, virtual: int
) -> None:
    key = f"{name}-tp{tp}-pp{pp}-v{virtual}"
    ranks = [r[key] for r in reports]
    assert all(not r["mismatched"] for r in ranks), [r["mismatched"] for r in ranks]
    for kind in CHECKPOINTS:  # read back from each format and saved layout, equally exact
        assert all(not r["read_mismatched"][kind] for r in ranks), (kind, ranks)
    whole = ranks[0]["whole"]
    # every tensor of the model is held somewhere, and no rank holds more than about its
    # share (the tied embedding's copy and replicated norms are the excess)
    assert set().union(*(r["names"] for r in ranks)) == set(ranks[0]["reference_names"])
    for r in ranks:
        assert r["allocated"] < whole * (1.0 / (tp * pp) + 0.35), (r["allocated"], whole)
    if tp * pp == WORLD:  # the model split over all ranks: together they hold it once or so
        assert sum(r["allocated"] for r in ranks) < whole * 1.4


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
