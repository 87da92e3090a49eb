"""Transformer Engine's FP8 scaling state (`_extra_state`) through a torch_dist save and resume.

TE 2.x (TransformerEngineBaseModule.get_extra_state) gives an empty uint8 tensor before the
first FP8 forward and a uint8 tensor of a pickled dict (recipe, scales, amax histories)
after, and its set_extra_state refuses a pickled delayed-scaling state unless
NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1. The CPU stand-in (mg.core.testing.te_standin)
keeps that contract. mg-train stores each state as Megatron-Core does, a ShardedObject per
layer (`<key>._extra_state/shard_<layer>_<layers>`, a pickled object: no tensor size to
check, so a save from before FP8 started loads into an FP8 run and back); a resume hands
every module the state it saved; without the opt-in a resume (torch_dist or torch) stops in
one line naming it.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from mg.core.checkpoint import CheckpointError
from mg.core.checkpoint.dist_format import load_dist_checkpoint, stored_keys
from mg.core.testing import te_standin

TE = ["--transformer-impl", "transformer_engine", "--distributed-backend", "gloo"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4"]
QKV = "decoder.layers.self_attention.linear_qkv._extra_state/shard_{}_2"


def _stored_states(folder) -> dict[str, torch.Tensor]:
    """Each `_extra_state` ShardedObject of a checkpoint folder: its data."""
    keys = [k for k in stored_keys(folder) if "._extra_state/" in k]
    request = dict.fromkeys(keys, b"")
    load_dist_checkpoint(folder, request, allow_pickle=True)
    return {key: request[key][0] for key in keys}


def test_fp8_state_saved_per_layer_and_handed_back(tmp_path, mock_argv, train, monkeypatch) -> None:
    te_standin.install(monkeypatch)
    monkeypatch.setenv(te_standin.UNSAFE_PICKLE_ENV, "1")
    restored: list[tuple[torch.Tensor, dict]] = []
    set_extra_state = te_standin._Extra.set_extra_state

    def recorded(self, state):
        set_extra_state(self, state)
        if isinstance(state, torch.Tensor) and state.numel():
            restored.append((state, dict(self.fp8_meta)))

    monkeypatch.setattr(te_standin._Extra, "set_extra_state", recorded)
    ckpt = str(tmp_path / "ckpt")
    save = ["--save", ckpt, "--save-interval", "2"]
    base = [*TE, *NO_DROPOUT, *save]
    # no FP8 for 2 iterations: the states saved empty
    train(mock_argv(tmp_path, *base, "--exit-interval", "2", mbs=2, gbs=2, iters=6))
    before = _stored_states(tmp_path / "ckpt" / "iter_0000002")
    assert QKV.format("0") in before and QKV.format("1") in before
    assert all(s.dtype == torch.uint8 and s.numel() == 0 for s in before.values())
    # FP8 from the no-FP8 save (empty states load, nothing to restore), saved at 4
    resume = [*base, *FP8, "--load", ckpt]
    train(mock_argv(tmp_path, *resume, "--exit-interval", "4", mbs=2, gbs=2, iters=6))
    assert restored == []
    after = _stored_states(tmp_path / "ckpt" / "iter_0000004")
    assert after.keys() == before.keys()
    for key, state in after.items():  # the linears' and the attention's
        assert state.dtype == torch.uint8 and state.numel() > 0, key
        unpickled = pickle.loads(state.numpy().tobytes())
        assert unpickled["recipe"].kind == "DelayedScaling"
        assert unpickled["amax_history_fwd"].shape == (4, 1)
        assert (unpickled["amax_history_fwd"][:2] > 0).all(), key  # two FP8 forwards
    # the FP8 save resumed: every module handed back exactly the state it saved
    train(mock_argv(tmp_path, *resume, "--exit-interval", "5", mbs=2, gbs=2, iters=6))
    assert len(restored) == len(after)
    saved = sorted(bytes(s.numpy()) for s in after.values())
    assert sorted(bytes(s.numpy()) for s, _ in restored) == saved
    for state, meta in restored:
        unpickled = pickle.loads(state.numpy().tobytes())
        assert torch.equal(meta["amax_history_fwd"], unpickled["amax_history_fwd"])
        assert torch.equal(meta["scale_fwd"], unpickled["scale_fwd"])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_without_the_pickle_opt_in_is_one_line(
    tmp_path, mock_argv, train, monkeypatch, fmt
) -> None:
    """TE refuses the pickled state: one line naming the variable and the checkpoint (the
    torch format's `load_state_dict` error is not taken for a shape mismatch)."""
    te_standin.install(monkeypatch)
    ckpt = str(tmp_path / "ckpt")
    argv = [*TE, *NO_DROPOUT, *FP8, "--ckpt-format", fmt, "--save", ckpt, "--save-interval", "2"]
    train(mock_argv(tmp_path, *argv, "--exit-interval", "2", mbs=2, gbs=2, iters=4))
    with pytest.raises(CheckpointError, match=te_standin.UNSAFE_PICKLE_ENV) as refused:
        train(mock_argv(tmp_path, *argv, "--load", ckpt, mbs=2, gbs=2, iters=4))
    message = str(refused.value)
    assert "\n" not in message and ckpt in message and "shape" not in message
