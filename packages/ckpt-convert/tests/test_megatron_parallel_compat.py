"""Against megatron-core 0.16.1 at TP=2 and at PP=2 (2 gloo ranks on CPU): the
checkpoints export-megatron writes load strictly into Megatron's own tensor- and
pipeline-parallel GPTModel and give our logits, and checkpoints Megatron's model saves
at those layouts import to a model with its logits.

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


def _megatron_logits(folder: Path, layout: str, which: str) -> torch.Tensor:
    if layout == "pp2":  # only the last stage has logits
        return torch.load(folder / f"pp2-{which}-rank1.pt")
    return torch.cat([torch.load(folder / f"tp2-{which}-rank{r}.pt") for r in range(2)], dim=-1)


def test_megatron_core_runs_our_tp2_and_pp2_exports_and_we_import_its_checkpoints(tmp_path):
    configs = CONFIGS  # both sides run in eval mode: dropout off
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "configs.json").write_text(json.dumps({k: c.to_dict() for k, c in configs.items()}))
    for name, config in configs.items():
        save_source(tmp_path / name / "ours", build(config))
        for layout, (tp, pp) in (("tp2", (2, 1)), ("pp2", (1, 2))):
            target = tmp_path / name / f"exported-{layout}"
            export_megatron(tmp_path / name / "ours", target, tp=tp, pp=pp, **QUIET)

    launch_workers(str(WORKER), 2, [str(tmp_path)], timeout=400)

    for name in configs:
        folder = tmp_path / name
        ours = logits(folder / "ours", ids)
        for layout in ("tp2", "pp2"):
            theirs = _megatron_logits(folder, layout, "exported")
            diff = (theirs - ours).abs().max().item()
            print(f"{name} {layout}: Megatron on our export, max |Δlogits| = {diff:.2e}")
            assert theirs.shape == ours.shape and diff <= TOLERANCE

            import_megatron(folder / f"written-{layout}", folder / f"imported-{layout}", **QUIET)
            theirs = _megatron_logits(folder, layout, "written")
            diff = (logits(folder / f"imported-{layout}", ids) - theirs).abs().max().item()
            print(f"{name} {layout}: our import of Megatron's save, max |Δlogits| = {diff:.2e}")
            assert diff <= TOLERANCE
