"""Megatron-LM MoE checkpoints (--num-experts) against megatron-core 0.16.1 on CPU.

megatron-core builds an MoE GPTModel (a dense layer and an MoE layer with four routed
experts, top-2, shared experts with their gate; local spec); its state dict is written
in Megatron-LM's `torch` layout at TP=1/EP=1 and at EP=2 (`mp_rank_00_EEE`, each
rank's two experts numbered from 0, split here independently of the converter), with
the experts as SequentialMLP (`local_experts.N`) or as grouped GEMM under the
Transformer Engine spec (TEGroupedMLP's `linear_fc1.weightN`, the dense layers' norms
fused into their linears: the same tensors under Megatron's TE names). import-megatron
gives megatron-core's logits (1e-5); export-megatron writes files megatron-core loads
strictly, with the same logits; the round trip is bit-exact; inspect shows the MoE
fields. megatron-core's own TP=2 and EP=2 ranks run in test_megatron_moe_parallel.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.ckpt_convert.errors import ConvertError  # noqa: E402
from mg.ckpt_convert.megatron_lm import (  # noqa: E402
    export_megatron,
    import_megatron,
    megatron_args_from_config,
)
from mg.core.checkpoint import load_checkpoint, load_model  # noqa: E402
from mg.core.models import TransformerConfig  # noqa: E402
from mg.core.testing.megatron_reference import (  # noqa: E402
    megatron_gpt_model,
    megatron_on_cpu,
)

pytestmark = pytest.mark.compat
WORKER = Path(__file__).parent / "megatron_parallel_worker.py"
QUIET = {"report": lambda _: None}
TOLERANCE = 1e-5
ITERATION = 10
MOE = TransformerConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    vocab_size=128,
    seq_length=16,
    max_position_embeddings=32,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    num_moe_experts=4,
    moe_ffn_hidden_size=16,
    moe_router_topk=2,
    moe_layer_freq=[0, 1],
    moe_aux_loss_coeff=0.01,
    moe_shared_expert_intermediate_size=24,
    moe_shared_expert_gate=True,
)
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
# the TE spec's names of a dense layer's norms, fused into the next linear
TE_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """megatron.core at TP = PP = EP = 1 on CPU, and its MoE GPTModel with noise added."""
    with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
        torch.manual_seed(0)
        model = megatron_gpt_model(MOE)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        yield model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(16).expand(2, 16), None)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _expert(name: str) -> tuple[str, int, str] | None:
    """(head, expert number, tail) of a SequentialMLP expert tensor's name."""
    head, sep, rest = name.partition(".mlp.experts.local_experts.")
    if not sep:
        return None
    number, _, tail = rest.partition(".")
    return head + ".mlp.experts.", int(number), tail


def _ep_rank_states(weights: dict, ep: int, grouped: bool) -> list[dict]:
    """Each expert-parallel rank's model state, as Megatron-LM saves it: the dense tensors,
    and experts e·E/ep … numbered from 0 (grouped: linear_fc1.weightN, TE norm names)."""
    local = MOE.num_moe_experts // ep
    states: list[dict] = [{} for _ in range(ep)]
    for name, tensor in weights.items():
        if grouped:
            for local_name, te_name in TE_NAMES.items():
                if name.endswith(local_name) and "layers.0." in name:  # layer 0 is dense
                    name = name.removesuffix(local_name) + te_name
        parts = _expert(name)
        if parts is None:
            for state in states:
                state[name] = tensor
            continue
        head, number, tail = parts
        rank, index = divmod(number, local)
        key = f"{head}{tail}{index}" if grouped else f"{head}local_experts.{index}.{tail}"
        states[rank][key] = tensor
    return states


def _write_megatron(folder, weights: dict, ep: int = 1, grouped: bool = False) -> None:
    args = megatron_args_from_config(MOE, None, ep=ep)
    args.lr, args.micro_batch_size = 3e-4, 4  # unrelated flags, as Megatron saves them all
    args.moe_grouped_gemm = grouped
    args.transformer_impl = "transformer_engine" if grouped else "local"
    for rank, model in enumerate(_ep_rank_states(weights, ep, grouped)):
        rank_dir = (
            folder / f"iter_{ITERATION:07d}" / ("mp_rank_00" + (f"_{rank:03d}" if ep > 1 else ""))
        )
        rank_dir.mkdir(parents=True)
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": ITERATION,
            "model": model,
            "rng_state": [],
        }
        torch.save(state, rank_dir / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def _ours(folder) -> torch.Tensor:
    model, config, _, info = load_model(folder)
    assert info.iteration == ITERATION and config.num_moe_experts == 4
    with torch.no_grad():
        return model(IDS)


def test_import_and_export_match_megatron_core(megatron, tmp_path):
    """TP=1/EP=1, SequentialMLP: megatron-core's logits after import, after export (its
    strict load), and the files bit-exact both ways."""
    expected = _logits(megatron)
    weights = _weights(megatron)
    _write_megatron(tmp_path / "megatron", weights)

    import_megatron(tmp_path / "megatron", tmp_path / "ours", **QUIET)
    diff = (_ours(tmp_path / "ours") - expected).abs().max().item()
    print(f"import-megatron max |Δlogits| = {diff:.2e}")
    assert diff <= TOLERANCE
    _, config, _, _ = load_model(tmp_path / "ours")
    for field in ("moe_layer_freq", "moe_shared_expert_gate", "moe_aux_loss_coeff"):
        assert getattr(config, field) == getattr(MOE, field)

    export_megatron(tmp_path / "ours", tmp_path / "back", **QUIET)
    state, _ = load_checkpoint(tmp_path / "back", allow_pickle=True)
    args = state["args"]
    assert isinstance(args, argparse.Namespace) and args.num_experts == 4
    assert (args.moe_router_topk, args.moe_ffn_hidden_size, args.moe_layer_freq) == (2, 16, [0, 1])
    assert args.moe_shared_expert_intermediate_size == 24 and not args.moe_grouped_gemm
    assert state["model"].keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(state["model"][name], tensor), name
    again = megatron_gpt_model(MOE)
    result = again.load_state_dict(state["model"], strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys)
    assert torch.equal(_logits(again), expected)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_expert_parallel_files_import_and_export(megatron, tmp_path, grouped, capsys):
    """EP=2 (mp_rank_00_000, mp_rank_00_001): import gives megatron-core's logits; export at
    EP=2 writes back the very files; at EP=1 megatron-core loads them; inspect shows MoE."""
    expected = _logits(megatron)
    weights = _weights(megatron)
    _write_megatron(tmp_path / "megatron", weights, ep=2, grouped=grouped)

    main(["inspect", str(tmp_path / "megatron")])
    text = capsys.readouterr().out
    assert "EP=2" in text and "num_experts = 4" in text and "num_moe_experts = 4" in text
    assert "moe_router_topk = 2" in text and "moe_shared_expert_intermediate_size = 24" in text

    import_megatron(tmp_path / "megatron", tmp_path / "ours", ep=1, **QUIET)
    diff = (_ours(tmp_path / "ours") - expected).abs().max().item()
    print(f"EP=2 {'grouped' if grouped else 'sequential'}: max |Δlogits| = {diff:.2e}")
    assert diff <= TOLERANCE
    _, config, _, _ = load_model(tmp_path / "ours")
    assert config.moe_grouped_gemm == grouped

    # back at EP=2: sequential names (our model has the local spec's), bit-exact
    export_megatron(tmp_path / "ours", tmp_path / "back", ep=2, **QUIET)
    written = _ep_rank_states(weights, 2, grouped=False)
    for rank in range(2):
        state, _ = load_checkpoint(tmp_path / "back", ep_rank=rank, allow_pickle=True)
        assert state["args"].expert_model_parallel_size == 2
        assert state["model"].keys() == written[rank].keys()
        for name, tensor in written[rank].items():
            assert torch.equal(state["model"][name], tensor), name

    export_megatron(tmp_path / "ours", tmp_path / "whole", ep=1, **QUIET)
    again = megatron_gpt_model(MOE)
    result = again.load_state_dict(load_checkpoint(tmp_path / "whole")[0]["model"], strict=False)
    assert not result.unexpected_keys
    assert torch.equal(_logits(again), expected)


def test_expert_tensor_parallel_one_files_import(megatron, tmp_path):
    """TP = 2 × EP = 2 with --expert-tensor-parallel-size 1, as Megatron-LM's legacy save
    writes it on two ranks: mp_rank_00_000 (TP rank 0's dense shards, experts 0-1 whole)
    and mp_rank_01_001 (TP rank 1's, experts 2-3) only; import gives megatron-core's
    logits (1e-5) and the experts bit-exactly."""
    from mg.core.checkpoint.ep_merge import is_routed_expert
    from mg.core.checkpoint.tp_split import split_tensor_parallel

    expected = _logits(megatron)
    weights = _weights(megatron)
    dense = {k: v for k, v in weights.items() if not is_routed_expert(k)}
    shards = split_tensor_parallel(dense, 2, gated=True, config=MOE)
    experts = _ep_rank_states(weights, 2, grouped=False)
    args = megatron_args_from_config(MOE, None, tp=2, ep=2)
    args.expert_tensor_parallel_size, args.sequence_parallel = 1, True
    for rank in range(2):  # (tp, ep) = (0, 0) and (1, 1)
        model = {**shards[rank], **{k: v for k, v in experts[rank].items() if k not in dense}}
        folder = tmp_path / "megatron" / f"iter_{ITERATION:07d}" / f"mp_rank_0{rank}_00{rank}"
        folder.mkdir(parents=True)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
        torch.save({**state, "model": model}, folder / "model_optim_rng.pt")
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))

    import_megatron(tmp_path / "megatron", tmp_path / "ours", tp=1, ep=1, **QUIET)
    diff = (_ours(tmp_path / "ours") - expected).abs().max().item()
    assert diff <= TOLERANCE
    ours = load_model(tmp_path / "ours")[0].state_dict()
    assert all(torch.equal(ours[k], v) for k, v in weights.items() if is_routed_expert(k))


@pytest.mark.parametrize("freq", ["list", "every"], ids=["layer-keys", "stacked"])
def test_export_megatron_torch_dist_moe(megatron, tmp_path, freq, monkeypatch):
    """export-megatron --ckpt-format torch_dist of an MoE, in megatron-core's keys: a first
    dense layer (moe_layer_freq [0, 1]: each layer keyed by number, routed experts on an
    expert axis, `decoder.layers.1.mlp.experts.experts.linear_fc1.weight` [4, 32, 32]) or
    every layer MoE (stacked: [2, 4, 32, 32]); the keys, global shapes and `_extra_state`
    objects are megatron-core's `sharded_state_dict()`'s, its `dist_checkpointing.load`
    fills its GPTModel with the same logits (args with TP = 2 x EP = 2), mg reads it as it
    is, and import-megatron of megatron-core's own save of it gives our weights bit-exactly."""
    import dataclasses

    from mg.core.checkpoint.reader_guard import read_dcp_metadata
    from mg.core.testing.megatron_dist_checkpoint import (
        dist_checkpointing_cpu_patches,
        load_into_megatron,
        megatron_sharded_keys,
        save_like_megatron_lm,
    )

    config = MOE if freq == "list" else dataclasses.replace(MOE, moe_layer_freq=1)
    model = megatron if freq == "list" else megatron_gpt_model(config)
    if freq != "list":
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    expected = _logits(model)
    args = megatron_args_from_config(config, None)
    args.lr, args.micro_batch_size = 3e-4, 4
    for rank_dir in ("mp_rank_00",):
        folder = tmp_path / "megatron" / f"iter_{ITERATION:07d}" / rank_dir
        folder.mkdir(parents=True)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
        torch.save({**state, "model": _weights(model)}, folder / "model_optim_rng.pt")
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    import_megatron(tmp_path / "megatron", tmp_path / "ours", **QUIET)

    export_megatron(
        tmp_path / "ours", tmp_path / "dist", ckpt_format="torch_dist", tp=2, ep=2, **QUIET
    )
    folder = tmp_path / "dist" / f"iter_{ITERATION:07d}"
    stored = read_dcp_metadata(folder).state_dict_metadata
    tensors, objects = megatron_sharded_keys(megatron_gpt_model(config))
    ours = {k: tuple(v.size) for k, v in stored.items() if "/" not in k and hasattr(v, "size")}
    assert {k: v for k, v in ours.items() if not k.startswith("rng")} == tensors
    assert objects <= set(stored)
    key = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    if freq == "every":
        key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert ours[key] == ((4, 32, 32) if freq == "list" else (2, 4, 32, 32))

    fresh = megatron_gpt_model(config)
    load_into_megatron(folder, fresh)
    assert torch.equal(_logits(fresh), expected)

    before = load_model(tmp_path / "ours")[0].state_dict()
    as_is = load_model(tmp_path / "dist")[0].state_dict()  # mg-eval reads it as it is
    assert before.keys() == as_is.keys() and all(torch.equal(before[k], as_is[k]) for k in before)
    # megatron-core saves what it loaded (Megatron-LM's torch_dist); import-megatron reads it
    dist_checkpointing_cpu_patches(monkeypatch)
    args.ckpt_format = "torch_dist"
    save_like_megatron_lm(tmp_path / "resaved", fresh, args, ITERATION)
    import_megatron(tmp_path / "resaved", tmp_path / "back", **QUIET)
    after = load_model(tmp_path / "back")[0].state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_moe_refusals(megatron, tmp_path, capsys):
    """What import/export cannot do is one line naming the flag (exit 2 from the command)."""
    weights = _weights(megatron)
    args = megatron_args_from_config(MOE, None)
    for name, value, message in (
        ("expert_tensor_parallel_size", 2, "--expert-tensor-parallel-size 2 differs"),
        ("moe_use_legacy_grouped_gemm", True, "--moe-use-legacy-grouped-gemm is not supported"),
        ("moe_latent_size", 8, "--moe-latent-size is not supported"),
    ):
        folder = tmp_path / name
        _write_megatron(folder, weights)
        state = torch.load(
            folder / "iter_0000010/mp_rank_00/model_optim_rng.pt", weights_only=False
        )
        state["args"] = argparse.Namespace(**{**vars(args), name: value})
        torch.save(state, folder / "iter_0000010/mp_rank_00/model_optim_rng.pt")
        with pytest.raises(ConvertError, match=message):
            import_megatron(folder, tmp_path / "x", **QUIET)
    legacy = tmp_path / "legacy"  # the local spec's grouped GEMM: weight1 / weight2
    renamed = {
        (k.split(".local_experts.")[0] + ".weight1" if ".local_experts.0.linear_fc1" in k else k): v
        for k, v in weights.items()
        if ".local_experts." not in k or ".local_experts.0.linear_fc1" in k
    }
    _write_megatron(legacy, renamed)
    with pytest.raises(ConvertError, match="legacy GroupedMLP"):
        import_megatron(legacy, tmp_path / "x", **QUIET)

    _write_megatron(tmp_path / "megatron", weights)
    import_megatron(tmp_path / "megatron", tmp_path / "ours", **QUIET)
    y = tmp_path / "y"
    for flags, message in (
        (["--target-expert-parallel-size", "3"], "--target-expert-parallel-size 3 does not divide"),
        (["--expert-layout", "grouped"], "--expert-layout grouped: Megatron-LM builds"),
        (["--target-tensor-parallel-size", "3"], "--target-tensor-parallel-size 3 does not divide"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["export-megatron", "--load", str(tmp_path / "ours"), "--save", str(y), *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not y.exists()


# megatron-core's own expert- and tensor-parallel ranks (megatron_parallel_worker.py) ----

PARALLEL = {"ep2": (1, 1, 2), "tp2": (2, 1, 1), "tp2ep2": (2, 1, 2)}


def _megatron_logits(folder: Path, layout: str, which: str) -> torch.Tensor:
    """What a layout's last-stage ranks saved: their vocabulary shards, joined."""
    tp = PARALLEL[layout][0]
    return torch.cat([torch.load(folder / f"{layout}-{which}-tp{r}.pt") for r in range(tp)], -1)


def _check_parallel(tmp_path: Path, layouts: list[str]) -> None:
    """Export our MoE model to each layout and import what megatron-core's ranks save there:
    megatron-core's logits on our files, ours on its files (1e-5)."""
    from reshard_helpers import logits, save_source

    from mg.core.models import GPTModel
    from mg.core.testing.launch import launch_workers

    torch.save(IDS, tmp_path / "ids.pt")
    (tmp_path / "configs.json").write_text(json.dumps({"moe": MOE.to_dict()}))
    torch.manual_seed(0)
    model = GPTModel(MOE).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "moe"
    save_source(folder / "ours", model)
    for layout in layouts:
        tp, pp, ep = PARALLEL[layout]
        export_megatron(
            folder / "ours", folder / f"exported-{layout}", tp=tp, pp=pp, ep=ep, **QUIET
        )

    world = max(tp * pp * ep for tp, pp, ep in (PARALLEL[layout] for layout in layouts))
    launch_workers(str(WORKER), world, [str(tmp_path), *layouts], timeout=500)

    ours = logits(folder / "ours", IDS)
    for layout in layouts:
        theirs = _megatron_logits(folder, layout, "exported")
        diff = (theirs - ours).abs().max().item()
        print(f"{layout}: megatron-core on our export, max |Δlogits| = {diff:.2e}")
        assert theirs.shape == ours.shape and diff <= TOLERANCE

        import_megatron(folder / f"written-{layout}", folder / f"imported-{layout}", **QUIET)
        theirs = _megatron_logits(folder, layout, "written")
        diff = (logits(folder / f"imported-{layout}", IDS) - theirs).abs().max().item()
        print(f"{layout}: our import of megatron-core's save, max |Δlogits| = {diff:.2e}")
        assert diff <= TOLERANCE


@pytest.mark.slow  # two gloo ranks of megatron-core per layout
def test_megatron_core_at_ep2_and_tp2(tmp_path):
    _check_parallel(tmp_path, ["ep2", "tp2"])


@pytest.mark.slow  # four gloo ranks
def test_megatron_core_at_tp2_ep2(tmp_path):
    _check_parallel(tmp_path, ["tp2ep2"])
