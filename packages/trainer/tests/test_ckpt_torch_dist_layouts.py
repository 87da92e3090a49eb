"""torch_dist key layouts: a GPT is saved in Megatron-Core's (layer-stacked keys, Megatron's
`rng_state` object), and checkpoints in mg's earlier per-parameter layout (`model.<name>`,
generators under `rng.tp<T>_pp<P>.` and in common.pt) still resume, bitwise equal to an
uninterrupted run; so does the new layout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mg.core.checkpoint.dist_format import stored_keys

sys.path.insert(0, str(Path(__file__).parent))
from earlier_layout import rewrite_as_earlier_layout  # noqa: E402

EVAL = ("--eval-interval", "5", "--eval-iters", "1")


@pytest.mark.parametrize("layout", ["megatron", "earlier"])
def test_both_layouts_resume_bitwise(tmp_path, mock_argv, train, layout) -> None:
    straight = train(mock_argv(tmp_path, *EVAL, "--hidden-dropout", "0.2", iters=8))
    ckpt = str(tmp_path / "ckpt")
    argv = mock_argv(tmp_path, *EVAL, "--hidden-dropout", "0.2", "--save", ckpt, iters=8)
    first = train([*argv, "--exit-interval", "4"])
    if layout == "earlier":  # how mg saved a GPT before
        rewrite_as_earlier_layout(tmp_path / "ckpt", 4)
    keys = stored_keys(tmp_path / "ckpt" / "iter_0000004")
    if layout == "earlier":
        assert "model.decoder.layers.0.mlp.linear_fc1.weight" in keys
        assert "rng.tp0_pp0.rng_state" in keys
    else:
        assert "decoder.layers.mlp.linear_fc1.weight" in keys
        assert "rng_state/shard_0.0_1.1" in keys
        assert not any(k.startswith("model.") for k in keys)
    second = train(mock_argv(tmp_path, *EVAL, "--hidden-dropout", "0.2", "--load", ckpt, iters=8))
    assert second.state.iteration == 8
    assert first.losses + second.losses == straight.losses  # bitwise: weights, Adam, RNG


def test_another_model_is_named_not_called_corrupt(tmp_path, mock_argv, train) -> None:
    from mg.core.checkpoint import CheckpointError

    ckpt = str(tmp_path / "ckpt")
    train(mock_argv(tmp_path, "--save", ckpt, iters=3))
    deeper = mock_argv(tmp_path, "--load", ckpt, "--no-load-optim", iters=4)
    deeper[deeper.index("--num-layers") + 1] = "3"
    with pytest.raises(CheckpointError, match=r"stored with shape \(2, .*model's is \(3, "):
        train(deeper)
