"""What Transformer Engine 2.x's modules require of the code that drives them, checked on the
CPU with the stand-in package (mg.core.testing.te_standin), which keeps TE's rules:

- `LayerNormLinear`/`Linear` (TransformerEngineBaseModule.prepare_forward, then
  `inp.view(-1, in_features)`): a strided input is copied contiguous before the view; under
  sequence parallelism our [b, s, h] activations reach them transposed to [s, b, h].
  Two ranks, TP=2 with sequence parallelism, two micro-batches under FP8 (delayed
  scaling): the losses and accumulated gradients are the one-process model's.
- `_extra_state` (get_extra_state/set_extra_state): an empty uint8 tensor before the first
  FP8 forward, a uint8 tensor of a pickled dict after; its size changes, so it is no tensor
  for the distributed checkpoint: it is stored as Megatron-Core stores it, one ShardedObject
  per layer (TP ranks' states agree: amaxes are reduced over the group, and Megatron keeps
  tensor rank 0's), and the two ranks' modules get their FP8 state back from torch_dist.
- the parameters TE marks `sequence_parallel` (its reset_parameters) are the ones whose
  gradients are partial sums under sequence parallelism (`te_parallel` lends them so).
- selective recompute: the core attention stays recomputed when TE's attention replaces it.

This file is also the rank worker (`python test_te_contract.py OUT_DIR`).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mg.core.checkpoint.dist_format import load_dist_checkpoint, save_dist_checkpoint, stored_keys
from mg.core.checkpoint.megatron_dist import megatron_model_state
from mg.core.checkpoint.megatron_sharded_keys import key_layout
from mg.core.checkpoint.te_extra_state import restore_extra_state
from mg.core.models import GPTModel, presets
from mg.core.models.recompute import apply_recompute_modules
from mg.core.models.recompute_state import recomputing
from mg.core.models.te_parallel import TEParallelism
from mg.core.models.te_spec import FP8Options, apply_transformer_engine, fp8_autocast, te_spec_names
from mg.core.parallel.mesh import ParallelDims
from mg.core.parallel.tensor_parallel import apply_tensor_parallel, sync_tensor_parallel_grads
from mg.core.testing import te_standin
from mg.core.testing.launch import launch_workers

WORLD = 2
FP8 = FP8Options(recipe="delayed", amax_history_len=4)
LOSS_RTOL = 1e-6
GRAD_TOL = 1e-5


def _config(**fields):
    return presets.tiny_llama(
        hidden_size=32, seq_length=16, attention_dropout=0.0, hidden_dropout=0.0, **fields
    )


def _te_model(config) -> GPTModel:
    return GPTModel(dataclasses.replace(config, transformer_impl="transformer_engine"))


# --- one process ----------------------------------------------------------------------------


def test_extra_state_is_empty_until_an_fp8_forward_then_a_pickled_buffer(monkeypatch) -> None:
    te = te_standin.install(monkeypatch)
    del te
    linear = te_standin.Linear(8, 4, device="cpu")
    empty = linear.get_extra_state()
    assert empty.dtype == torch.uint8 and empty.numel() == 0
    linear(torch.randn(2, 3, 8))  # outside fp8_autocast: still nothing
    assert linear.get_extra_state().numel() == 0
    with fp8_autocast(FP8):
        linear(torch.randn(2, 3, 8))
    state = linear.get_extra_state()
    assert state.dtype == torch.uint8 and state.numel() > 0
    assert set(pickle.loads(state.numpy().tobytes())) >= {"recipe", "amax_history_fwd"}
    with fp8_autocast(dataclasses.replace(FP8, recipe="tensorwise")):  # stateless: nothing
        fresh = te_standin.Linear(8, 4, device="cpu")
        fresh(torch.randn(2, 8))
    assert fresh.get_extra_state().numel() == 0
    other = te_standin.Linear(8, 4, device="cpu")
    other.set_extra_state(empty)  # an empty state: nothing, no pickle involved
    with pytest.raises(RuntimeError, match=te_standin.UNSAFE_PICKLE_ENV):
        other.set_extra_state(state)
    monkeypatch.setenv(te_standin.UNSAFE_PICKLE_ENV, "1")
    other.set_extra_state(state)
    assert torch.equal(other.fp8_meta["amax_history_fwd"], linear.fp8_meta["amax_history_fwd"])
    with pytest.raises(RuntimeError, match="Unsupported checkpoint format"):
        other.set_extra_state({"scale_fwd": 1.0})


def test_strided_input_is_viewed_after_a_contiguous_copy(monkeypatch) -> None:
    """TE's prepare_forward copies a strided input before `view(-1, in_features)`: the
    transposed [s, b, h] input gives the contiguous one's result."""
    te_standin.install(monkeypatch)
    for module in (
        te_standin.Linear(8, 4, device="cpu"),
        te_standin.LayerNormLinear(8, 4, device="cpu"),
    ):
        x = torch.randn(3, 2, 8)
        strided = x.transpose(0, 1)
        assert not strided.is_contiguous()
        torch.testing.assert_close(module(strided), module(strided.contiguous()))


def test_sequence_parallel_marks_are_tes(monkeypatch) -> None:
    """TE's reset_parameters: a column LayerNormLinear's norms and a row Linear's bias are
    marked `sequence_parallel` under it (and only with more than one tensor rank)."""
    te_standin.install(monkeypatch)
    kw = dict(device="cpu", tp_size=2, sequence_parallel=True)
    column = te_standin.LayerNormLinear(8, 4, parallel_mode="column", **kw)
    row = te_standin.Linear(8, 4, parallel_mode="row", **kw)
    assert column.layer_norm_weight.sequence_parallel and column.layer_norm_bias.sequence_parallel
    assert not getattr(column.bias, "sequence_parallel", False) and column.bias.shape == (2,)
    assert row.bias.sequence_parallel and row.weight.partition_dim == 1
    alone = te_standin.Linear(8, 4, parallel_mode="row", device="cpu", sequence_parallel=True)
    assert not alone.sequence_parallel and not alone.bias.sequence_parallel


def test_selective_recompute_survives_the_swap_to_tes_attention(monkeypatch) -> None:
    """Recompute applied before Transformer Engine's swap: TE's attention is still run
    again in the backward pass (Megatron's checkpoint_core_attention)."""
    te_standin.install(monkeypatch)
    calls: list[bool] = []
    forward = te_standin.DotProductAttention.forward

    def counted(self, *args, **kwargs):
        calls.append(recomputing())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(te_standin.DotProductAttention, "forward", counted)
    torch.manual_seed(0)
    model = _te_model(_config())
    apply_recompute_modules(model, ["core_attn"])
    apply_transformer_engine(model)
    attention = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(attention, te_standin.DotProductAttention)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens).sum().backward()
    layers = len(model.decoder.layers)
    assert calls == [False] * layers + [True] * layers


# --- two ranks: TP=2 + SP, two FP8 micro-batches, a torch_dist round trip ----------------


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _fp8_states(model) -> dict[str, list]:
    return {
        name: module.fp8_meta["amax_history_fwd"].flatten().tolist()
        for name, module in model.named_modules()
        if isinstance(module, te_standin._Extra)
        and "amax_history_fwd" in vars(module).get("fp8_meta", {})
    }


def _parallel_te_model(config, reference: GPTModel) -> tuple[GPTModel, TEParallelism]:
    model = _te_model(config)
    model.load_state_dict(te_spec_names(reference.state_dict(), config))
    mesh = ParallelDims.from_world(WORLD, tp=WORLD).build_mesh()["tp"]
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    parallel = TEParallelism(mesh.get_group(), sequence_parallel=True)
    apply_transformer_engine(model, parallel=parallel)
    return model, parallel


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict = {}
    with pytest.MonkeyPatch.context() as patch:
        te_standin.install(patch)
        patch.setenv(te_standin.UNSAFE_PICKLE_ENV, "1")
        config = _config()
        torch.manual_seed(0)
        reference = GPTModel(config)
        model, _ = _parallel_te_model(config, reference)
        tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(7))
        losses = []
        for micro in tokens.chunk(2):  # two micro-batches, gradients accumulated
            with fp8_autocast(FP8):
                loss = model(micro[:, :-1], labels=micro[:, 1:]).sum()
            loss.backward()
            loss_ref = reference(micro[:, :-1], labels=micro[:, 1:]).sum()
            loss_ref.backward()
            losses.append([float(loss.detach()), float(loss_ref.detach())])
        sync_tensor_parallel_grads(model)
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        worst = 0.0
        for name, p_ref in te_spec_names(dict(reference.named_parameters()), config).items():
            scale = float(p_ref.grad.abs().max()) or 1.0
            worst = max(worst, float((grads[name] - p_ref.grad).abs().max()) / scale)
        report.update(losses=losses, grad_rel=worst, saved=_fp8_states(model))
        # torch_dist, Megatron-Core's layout: the TE modules' FP8 state saved and restored
        folder = Path(out_dir, "ckpt")
        layout = key_layout(model.config)
        state = megatron_model_state(model.state_dict(), layout, extra_state=True)
        save_dist_checkpoint(folder, 1, {**state.tensors, **state.objects}, {"iteration": 1})
        torch.manual_seed(1)
        fresh, _ = _parallel_te_model(config, GPTModel(config))
        named = fresh.state_dict()
        loading = megatron_model_state(named, layout)
        request = dict(loading.tensors)
        request.update(dict.fromkeys(loading.extra_states, b""))
        load_dist_checkpoint(folder / "iter_0000001", request, allow_pickle=True)
        modules = dict(fresh.named_modules())
        for key, name in loading.extra_states.items():
            (data,) = request[key]
            restore_extra_state(modules[name.removesuffix("._extra_state")], data, str(folder))
        report["restored"] = _fp8_states(fresh)
        report["same_weights"] = all(
            torch.equal(_full(a), _full(b))
            for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
        )
        if rank == 0:
            report["keys"] = sorted(k for k in stored_keys(folder / "iter_0000001") if "/" in k)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("te_contract")
    launch_workers(__file__, WORLD, [str(out)], timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow  # one 2-rank launch for both, ~16 s
def test_two_fp8_micro_batches_under_sequence_parallelism(reports) -> None:
    for rank, report in enumerate(reports):
        for loss, loss_ref in report["losses"]:
            assert loss == pytest.approx(loss_ref, rel=LOSS_RTOL), rank
        assert report["grad_rel"] < GRAD_TOL, (rank, report["grad_rel"])
        assert report["saved"], rank  # every TE linear ran FP8 and holds a state


@pytest.mark.slow
def test_fp8_state_round_trips_through_torch_dist_on_each_rank(reports) -> None:
    keys = reports[0]["keys"]
    layer_objects = [k for k in keys if k.startswith("decoder.layers.") and "_extra_state" in k]
    # one object per layer (`shard_<layer>_<layers>`), as Megatron-Core keys them
    assert "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2" in layer_objects
    assert not [k for k in layer_objects if k.rsplit("/", 1)[1] not in ("shard_0_2", "shard_1_2")]
    for rank, report in enumerate(reports):
        assert report["same_weights"], rank
        assert report["restored"] == report["saved"], rank
    assert reports[0]["saved"] == reports[1]["saved"]  # amaxes reduced over the TP group


if __name__ == "__main__":
    _worker(sys.argv[1])
