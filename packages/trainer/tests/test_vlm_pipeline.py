"""`mg-train vlm` with pipeline parallelism on 2 gloo ranks matches one process.

PP=2: the vision tower and the projector on the first stage with the language model's
first layer, where the image embeddings are spliced into the text's; the second layer,
the final norm and the (tied) output layer on the second stage. Towers frozen as in
projector pretraining (`--freeze-ViT --freeze-LM`), and all trained. Tolerance: 10
iterations (fp32, dropout off), losses and gradient norms equal to 1e-6 relative: the
split changes no arithmetic but the sum of the tied embedding's two gradients and the
gradient norm's sum over stages.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _sibling(name: str):
    """A module beside this file (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_vlmpp_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_ranks = _sibling("test_ddp.py").run_ranks
VLM = _sibling("test_vlm_training.py").VLM
ITERS = 10
RTOL = 1e-6


@pytest.mark.slow  # two gloo ranks (two runs), then one process each
def test_vlm_pipeline_parallel_matches_one_process(tmp_path: Path, train) -> None:
    argv = [*VLM, "--train-iters", str(ITERS), "--data-cache-path", str(tmp_path)]
    frozen = [*argv, "--freeze-ViT", "--freeze-LM"]
    pp = ["--pipeline-model-parallel-size", "2"]
    two = run_ranks([[*frozen, *pp], [*argv, *pp]], 2, tmp_path / "two.json")
    for pp2, plain in zip(two, (frozen, argv), strict=True):
        one = train(plain)
        assert len(one.losses) == len(pp2["losses"]) == ITERS
        assert pp2["losses"] == pytest.approx(one.losses, rel=RTOL)
        assert pp2["grad_norms"] == pytest.approx(one.grad_norms, rel=RTOL)


@pytest.mark.slow  # four gloo ranks, then one process
def test_vlm_tensor_and_pipeline_parallel_together_match_one_process(tmp_path: Path, train) -> None:
    """TP=2 x PP=2, without and with sequence parallelism, every tower trained: the vision tower
    sharded on the first stage's two ranks, the language model over both stages.
    Tensor parallelism reorders sums: 1e-5 relative, as test_vlm_parallel.py."""
    argv = [*VLM, "--train-iters", str(ITERS), "--data-cache-path", str(tmp_path)]
    layout = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    # 64·tp vocabulary padding: the 100 ids give 128 rows at TP=2 and at one process
    layout += ["--make-vocab-size-divisible-by", "64"]
    sp = ["--sequence-parallel"]  # the language model's layers on sequence slices
    four = run_ranks([[*argv, *layout], [*argv, *layout, *sp]], 4, tmp_path / "four.json")
    one = train(argv)
    for run in four:
        assert len(run["losses"]) == ITERS
        assert run["losses"] == pytest.approx(one.losses, rel=1e-5)
        assert run["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-5)
