"""The TE-spec GPT under tensor (+ sequence) and context parallelism on 2 gloo ranks, against the
local-spec model on one process: in its plain-PyTorch form (the fused norms kept whole while the
linears split) and with Transformer Engine's modules swapped in and told the groups, checked
with the stand-in TE package (mg.core.testing.te_standin, which runs TE's collectives); context
parallelism takes the TE spec whichever attention kernel it was built with (flash too).

This file is also the rank worker (`python test_parallel_te_spec.py OUT_DIR`). Each rank builds
the local-spec reference (same seed) and a TE-spec copy with its weights renamed, parallelises
the copy, and compares the loss and every gradient (gathered from shards, summed over cp ranks)
with the reference's. fp32: parallelism changes only the order of sums, so losses agree to 1e-6
relative and gradients to 1e-5 of their largest entry (measured: 1e-7 and 6e-7).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mg.core.models import GPTModel, presets
from mg.core.models.core_attention import FlashAttention
from mg.core.models.te_parallel import TEParallelism
from mg.core.models.te_spec import apply_transformer_engine, te_spec_names
from mg.core.parallel.context_parallel import apply_context_parallel, shard_batch
from mg.core.parallel.mesh import ParallelDims
from mg.core.parallel.tensor_parallel import apply_tensor_parallel, sync_tensor_parallel_grads
from mg.core.testing.launch import launch_workers

WORLD = 2
SHAPES = ("gpt2", "llama")  # LayerNorm + biases + GELU; RMSNorm + SwiGLU + GQA + RoPE
LAYOUTS = ("tp", "tp_sp", "cp")
LOSS_RTOL = 1e-6
GRAD_TOL = 1e-5


def _config(shape: str):
    make = presets.tiny_llama if shape == "llama" else presets.tiny_gpt2
    return make(hidden_size=32, seq_length=16, attention_dropout=0.0, hidden_dropout=0.0)


def _models(shape: str) -> tuple[GPTModel, GPTModel]:
    torch.manual_seed(0)
    config = _config(shape)
    reference = GPTModel(config)
    te = GPTModel(dataclasses.replace(config, transformer_impl="transformer_engine"))
    te.load_state_dict(te_spec_names(reference.state_dict(), config))
    return reference, te


def _flash_attention_modules(model: GPTModel) -> None:
    """FlashAttention modules in place of SDPA (flash-attn itself needs a GPU)."""
    for layer in model.decoder.layers:
        flash = FlashAttention.__new__(FlashAttention)
        nn.Module.__init__(flash)
        flash.causal = True
        layer.self_attention.core_attention = flash


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _scenario(shape: str, layout: str, swap: bool) -> dict:
    reference, model = _models(shape)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(7))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    parallel = TEParallelism()
    if layout == "cp":
        if swap:  # the flash kernel, as --use-flash-attn builds it on a GPU: TE's replaces it
            _flash_attention_modules(model)
        group = dist.group.WORLD
        apply_context_parallel(model, group)
        batch = shard_batch(batch, dist.get_rank(), WORLD)
        parallel = TEParallelism(cp_group=group)
    else:
        mesh = ParallelDims.from_world(WORLD, tp=WORLD).build_mesh()["tp"]
        apply_tensor_parallel(model, mesh, sequence_parallel=layout == "tp_sp")
        parallel = TEParallelism(mesh.get_group(), sequence_parallel=layout == "tp_sp")
    if swap:
        apply_transformer_engine(model, parallel=parallel)
    full_batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    loss_ref = reference(full_batch["tokens"], labels=full_batch["labels"]).sum()
    loss = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"]).sum()
    loss_ref.backward()
    loss.backward()
    sync_tensor_parallel_grads(model)
    if layout == "cp":  # each cp rank's gradients cover its tokens: sum them
        for p in model.parameters():
            dist.all_reduce(p.grad)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    renamed = te_spec_names(dict(reference.named_parameters()), reference.config)
    worst = 0.0
    for name, p_ref in renamed.items():
        scale = float(p_ref.grad.abs().max()) or 1.0
        worst = max(worst, float((grads[name] - p_ref.grad).abs().max()) / scale)
    return {
        "loss": [float(loss.detach()), float(loss_ref.detach())],
        "grad_rel": worst,
        "names": sorted(k for k in model.state_dict() if not k.endswith("_extra_state")),
        "reference_names": sorted(te_spec_names(reference.state_dict(), reference.config)),
    }


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    report = {}
    for shape in SHAPES:
        for layout in LAYOUTS:
            report[f"{shape}-{layout}-plain"] = _scenario(shape, layout, swap=False)
    with pytest.MonkeyPatch.context() as patch:
        from mg.core.testing import te_standin

        recorder = te_standin.install(patch)
        for shape in SHAPES:
            for layout in LAYOUTS:
                report[f"{shape}-{layout}-te"] = _scenario(shape, layout, swap=True)
        report["te_parallel_modes"] = list(dict.fromkeys(map(tuple, recorder.parallel)))
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("te_parallel")
    launch_workers(__file__, WORLD, [str(out)], timeout=600)  # ~20 s of CPU per rank
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("swap", ["plain", "te"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_te_spec_parallel_matches_local_spec_on_one_process(
    reports, shape: str, layout: str, swap: str
) -> None:
    for rank in range(WORLD):
        r = reports[rank][f"{shape}-{layout}-{swap}"]
        loss, loss_ref = r["loss"]
        assert loss == pytest.approx(loss_ref, rel=LOSS_RTOL), (rank, r)
        assert r["grad_rel"] < GRAD_TOL, (rank, r["grad_rel"])
        assert r["names"] == r["reference_names"]  # Megatron's TE-spec names, unchanged


def test_te_modules_are_told_their_tensor_parallel_mode(reports) -> None:
    """TE's linears are built column- and row-parallel, with and without sequence
    parallelism (and plain under context parallelism alone)."""
    modes = {tuple(m) for m in reports[0]["te_parallel_modes"]}
    for sp in (False, True):
        assert ("LayerNormLinear", "column", sp) in modes
        assert ("Linear", "row", sp) in modes
    assert ("Linear", None, False) in modes


if __name__ == "__main__":
    _worker(sys.argv[1])
