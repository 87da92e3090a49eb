"""mg-train saves an MoE GPT's `torch_dist` checkpoint in Megatron-Core's layout, as it
saves a dense one: routed experts on an expert axis under their global numbers, layers
keyed by number where they differ (`--moe-layer-freq [0]+[1]`), shared experts with
their gate. The stored tensor keys and global shapes are megatron-core 0.16.1's own
`sharded_state_dict()`'s, its `dist_checkpointing.load` fills its GPTModel from
mg-train's checkpoint with logits equal to ours (1e-5) — saved in one process and at
expert parallelism 2 (each rank writing its two experts) — and the checkpoint of two
ranks equals the one of one process tensor for tensor.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import load_model
from mg.core.checkpoint.dist_format import load_full_state, stored_keys
from mg.core.checkpoint.reader_guard import read_dcp_metadata
from mg.core.testing.launch import run_ranks

pytestmark = pytest.mark.compat
MG_TRAIN = str(Path(sys.executable).with_name("mg-train"))
MOE = [
    *("--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm"),
    *("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
    *("--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2"),
    *("--moe-layer-freq", "[0]+[1]", "--moe-aux-loss-coeff", "1e-2"),
    *("--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate"),
    *("--attention-dropout", "0", "--hidden-dropout", "0", "--ckpt-format", "torch_dist"),
]
TOL = 1e-5


def _megatron_logits(folder: Path, config, ids: torch.Tensor, tmp_path: Path, patches):
    from mg.core.testing.megatron_dist_checkpoint import (
        dist_checkpointing_cpu_patches,
        load_into_megatron,
        megatron_sharded_keys,
    )
    from mg.core.testing.megatron_reference import megatron_gpt_model, megatron_on_cpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
        with megatron_on_cpu(tmp_path), patches.context() as patch:
            dist_checkpointing_cpu_patches(patch)
            theirs = megatron_gpt_model(config)
            tensors, objects = megatron_sharded_keys(theirs)
            load_into_megatron(folder, theirs)
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            with torch.no_grad():
                logits = theirs(ids, positions, None)[..., :127]
    return logits, tensors, objects


def test_moe_gpt_saves_megatron_layout_megatron_core_loads(
    tmp_path, mock_argv, train, monkeypatch
) -> None:
    pytest.importorskip("megatron.core")
    ckpt = tmp_path / "ckpt"
    argv = mock_argv(tmp_path, *MOE, "--save", str(ckpt), mbs=2, gbs=4, iters=3)
    train(argv)
    folder = ckpt / "iter_0000003"
    stored = {
        key: tuple(meta.size)
        for key, meta in read_dcp_metadata(folder).state_dict_metadata.items()
        if _is_model_key(key) and hasattr(meta, "size")
    }
    assert not any(k.startswith("model.") for k in stored)  # not mg's per-parameter layout
    assert stored["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == (4, 32, 32)

    ours, config, _, _ = load_model(ckpt)
    ids = torch.randint(0, 127, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ours(ids)[..., :127]
    logits, tensors, objects = _megatron_logits(folder, config, ids, tmp_path, monkeypatch)
    assert stored == tensors
    assert objects <= stored_keys(folder)
    assert (logits - expected).abs().max().item() <= TOL


def _is_model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng")) and "/" not in key


@pytest.mark.slow  # two gloo ranks of mg-train and a one-process run
def test_expert_parallel_save_is_the_one_process_save(tmp_path, mock_argv, train) -> None:
    """At EP = 2 each rank writes its experts under their global numbers: the checkpoint
    holds the same tensors as one process's (same seed, three iterations; 1e-6), in
    Megatron-Core's keys."""
    pytest.importorskip("megatron.core")
    argv = mock_argv(tmp_path, *MOE, mbs=2, gbs=4, iters=3)
    one, two = tmp_path / "one", tmp_path / "two"
    train([*argv, "--save", str(one)])
    ep2 = [*argv[1:], "--save", str(two), "--expert-model-parallel-size", "2"]
    outcomes = run_ranks(MG_TRAIN, 2, ["gpt", *ep2], timeout=600)
    assert all(o.returncode == 0 for o in outcomes), outcomes[0].log[-3000:]
    assert "decoder.layers.1.mlp.experts.experts.linear_fc2.weight" in stored_keys(
        two / "iter_0000003"
    )
    single = load_full_state(one / "iter_0000003")  # our names, whole tensors
    parallel = load_full_state(two / "iter_0000003")
    assert sorted(single) == sorted(parallel)
    for name in single:
        torch.testing.assert_close(parallel[name], single[name], rtol=0, atol=1e-6)
