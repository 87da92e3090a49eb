"""Against megatron-core 0.16.1 at TP=2 and at PP=2 (2 gloo ranks on CPU; TP2 x PP2 on
4 ranks is marked slow): the checkpoints export-megatron writes load strictly into
Megatron's own tensor- and pipeline-parallel GPTModel and give our logits, and
checkpoints Megatron's model saves at those layouts import to a model with its logits.

GPT-2-shaped (tied embeddings, biases, LayerNorm) and Llama-shaped (GQA with two query
groups per rank, SwiGLU, RMSNorm, rope, untied) models, so QKV interleaving per group,
[gate; up] per rank, vocabulary-parallel embeddings and the last stage's tied copy
are all exercised. The ranks run megatron_parallel_worker.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from reshard_helpers import CONFIGS, build, logits, save_source  # noqa: E402

from mg.ckpt_convert.megatron_lm import export_megatron, import_megatron  # noqa: E402
from mg.core.testing.launch import launch_workers  # noqa: E402

pytestmark = pytest.mark.compat
WORKER = Path(__file__).parent / "megatron_parallel_worker.py"
QUIET = {"report": lambda _: None}
TOLERANCE = 1e-5  # fp32; TP sums partial products in another order
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


def _megatron_logits(folder: Path, layout: str, which: str) -> torch.Tensor:
    """The last stage's vocabulary shards, joined."""
    tp = LAYOUTS[layout][0]
    return torch.cat([torch.load(folder / f"{layout}-{which}-tp{r}.pt") for r in range(tp)], -1)


def _check(tmp_path: Path, layouts: list[str]) -> None:
    """Export to each layout, run the Megatron ranks, compare logits both ways."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    torch.save(ids, tmp_path / "ids.pt")
    # both sides run in eval mode: dropout off
    (tmp_path / "configs.json").write_text(json.dumps({k: c.to_dict() for k, c in CONFIGS.items()}))
    for name, config in CONFIGS.items():
        save_source(tmp_path / name / "ours", build(config))
        for layout in layouts:
            tp, pp = LAYOUTS[layout]
            target = tmp_path / name / f"exported-{layout}"
            export_megatron(tmp_path / name / "ours", target, tp=tp, pp=pp, **QUIET)

    world = max(tp * pp for tp, pp in (LAYOUTS[layout] for layout in layouts))
    launch_workers(str(WORKER), world, [str(tmp_path), *layouts], timeout=500)

    for name in CONFIGS:
        folder = tmp_path / name
        ours = logits(folder / "ours", ids)
        for layout in layouts:
            theirs = _megatron_logits(folder, layout, "exported")
            diff = (theirs - ours).abs().max().item()
            print(f"{name} {layout}: Megatron on our export, max |Δlogits| = {diff:.2e}")
            assert theirs.shape == ours.shape and diff <= TOLERANCE

            import_megatron(folder / f"written-{layout}", folder / f"imported-{layout}", **QUIET)
            theirs = _megatron_logits(folder, layout, "written")
            diff = (logits(folder / f"imported-{layout}", ids) - theirs).abs().max().item()
            print(f"{name} {layout}: our import of Megatron's save, max |Δlogits| = {diff:.2e}")
            assert diff <= TOLERANCE


def test_megatron_core_runs_our_tp2_and_pp2_exports_and_we_import_its_checkpoints(tmp_path):
    _check(tmp_path, ["tp2", "pp2"])


@pytest.mark.slow
def test_megatron_core_at_tp2_pp2(tmp_path):
    """4 ranks: each pipeline stage's two tensor-parallel ranks."""
    _check(tmp_path, ["tp2pp2"])
