"""`mg-train retro` at TP=2 on 2 gloo ranks equals one process (fp32, 10 iterations).

The decoder's GPT layers are sharded as GPT's, the Retro layers' chunked
cross-attention and the neighbour encoder's cross-attention by heads
(mg.core.parallel.tensor_parallel_retro). The padded vocabulary is 128 in both runs
(`--make-vocab-size-divisible-by` scaled with TP, as Megatron pads to divisor x TP).
Tensor parallelism only changes the order of floating-point sums, so losses and grad
norms agree to 1e-5 relative. Dropout is off.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer

pytestmark = pytest.mark.slow


def _sibling(name: str):
    """A module beside this file (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_rp_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_ranks = _sibling("test_ddp.py").run_ranks
_retro = _sibling("test_retro_training.py")
RTOL = 1e-5


def test_retro_tensor_parallel_matches_one_process(tmp_path: Path) -> None:
    prefix = _retro.write_corpus(tmp_path / "data" / "corpus")
    project = {"prefix": prefix, "dir": str(_retro.write_project(tmp_path / "project", prefix))}
    argv = _retro.retro_argv(project, tmp_path, "--train-iters", "10", "--num-layers", "9")
    one = Trainer(parse_args([*argv, "--make-vocab-size-divisible-by", "128"])).train()
    tp2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
    [two] = run_ranks([[*argv, *tp2]], 2, tmp_path / "two.json")
    assert len(one.losses) == 10
    for name in ("losses", "grad_norms"):
        for a, b in zip(two[name], getattr(one, name), strict=True):
            assert a == pytest.approx(b, rel=RTOL), (name, two[name], getattr(one, name))
    print("one process:", one.losses, "\nTP=2:", two["losses"])
