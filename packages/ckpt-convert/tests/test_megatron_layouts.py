"""import-megatron / export-megatron at TP2, PP2 and TP2 x PP2: Megatron-LM's file layout
(checked against an independent split), bit-exact round trips, TE names and virtual
stages on import, vocabulary re-padding on export, refusals. megatron-core runs these
layouts in test_megatron_parallel_compat.py."""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from reshard_helpers import (  # noqa: E402
    CONFIGS,
    GPT2,
    assert_same_tensors,
    build,
    logits,
    megatron_tp_split,
    model_tensors,
    save_source,
)

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.ckpt_convert.errors import ConvertError  # noqa: E402
from mg.ckpt_convert.format_convert import convert_format  # noqa: E402
from mg.ckpt_convert.megatron_lm import (  # noqa: E402
    export_megatron,
    import_megatron,
    megatron_args_from_config,
)
from mg.core.checkpoint import load_checkpoint, load_model  # noqa: E402
from mg.core.models import TransformerConfig  # noqa: E402
from mg.core.parallel.pipeline import split_model  # noqa: E402

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
QUIET = {"report": lambda _: None}


def _megatron_files(folder: Path, tp: int, pp: int) -> dict[tuple[int, int], dict]:
    """Every rank file's whole state, read as Megatron-LM reads it (pickled args)."""
    return {
        (t, p): load_checkpoint(folder, tp_rank=t, pp_rank=p, pp_size=pp, allow_pickle=True)[0]
        for t in range(tp)
        for p in range(pp)
    }


def _expected_rank_files(model, tp: int, pp: int, virtual: int = 1) -> dict:
    """(tp rank, pp rank) → [model chunk state dicts] as Megatron lays them out."""
    gated = model.config.gated_linear_unit
    out = {}
    for stage in range(pp):
        chunks = [c.state_dict() for c in split_model(model, stage, pp, virtual)]
        per_rank = [megatron_tp_split(chunk, tp, gated) for chunk in chunks]
        for rank in range(tp):
            out[(rank, stage)] = [shards[rank] for shards in per_rank]
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_export_then_import_is_bit_exact(tmp_path, kind, tp, pp):
    model = build(CONFIGS[kind])
    save_source(tmp_path / "ours", model)
    export_megatron(tmp_path / "ours", tmp_path / "megatron", tp=tp, pp=pp, **QUIET)

    files = _megatron_files(tmp_path / "megatron", tp, pp)
    expected = _expected_rank_files(model, tp, pp)
    for key, state in files.items():
        (chunk,) = expected[key]
        assert_same_tensors(state["model"], chunk)
        args = state["args"]
        assert isinstance(args, argparse.Namespace)
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
        assert args.padded_vocab_size == 128 and args.transformer_impl == "local"
        assert state["iteration"] == 7 and state["checkpoint_version"] == 3.0
    # untied: the output layer; tied: the last stage's own copy of the embedding (PP > 1)
    has_output = kind == "llama" or pp > 1
    assert has_output == ("output_layer.weight" in files[(0, pp - 1)]["model"])

    # back into mg: the layout is kept unless asked otherwise
    import_megatron(tmp_path / "megatron", tmp_path / "kept", **QUIET)
    kept = model_tensors(tmp_path / "kept", tp, pp)
    for key, state in files.items():
        assert_same_tensors(kept[key], state["model"])
    import_megatron(tmp_path / "megatron", tmp_path / "whole", tp=1, pp=1, **QUIET)
    assert_same_tensors(model_tensors(tmp_path / "whole", 1, 1)[(0, 0)], model.state_dict())
    assert torch.equal(logits(tmp_path / "kept", IDS), logits(tmp_path / "ours", IDS))
    _, config, _, info = load_model(tmp_path / "whole")
    # Megatron's args set add_qkv_bias whenever add_bias_linear: the same model
    assert dataclasses.replace(config, add_qkv_bias=False) == CONFIGS[kind]
    assert info.iteration == 7


def test_export_from_torch_dist_and_a_sharded_source(tmp_path):
    """The source may be torch_dist or another torch layout: same Megatron files."""
    model = build(CONFIGS["llama"])
    save_source(tmp_path / "ours", model)
    convert_format(tmp_path / "ours", tmp_path / "dist", "torch_dist", **QUIET)
    export_megatron(tmp_path / "ours", tmp_path / "a", tp=2, pp=2, **QUIET)
    export_megatron(tmp_path / "dist", tmp_path / "b", tp=2, pp=2, **QUIET)
    export_megatron(tmp_path / "a", tmp_path / "c", **QUIET)  # an mg-readable TP2 x PP2 source
    a, b, c = (_megatron_files(tmp_path / n, 2, 2) for n in "abc")
    for key in a:
        assert_same_tensors(b[key]["model"], a[key]["model"])
        assert_same_tensors(c[key]["model"], a[key]["model"])


def _megatron_args(config: TransformerConfig, tp: int, pp: int, **extra) -> argparse.Namespace:
    args = megatron_args_from_config(config, None, tp=tp, pp=pp)
    args.lr, args.micro_batch_size = 3e-4, 4  # unrelated flags, as Megatron saves them all
    for key, value in extra.items():
        setattr(args, key, value)
    return args


def _write_megatron(folder: Path, shards: dict, args: argparse.Namespace, pp: int) -> None:
    """A checkpoint as Megatron-LM's save_checkpoint writes it (torch.save, Namespace args,
    optimizer and RNG state)."""
    for (t, p), chunks in shards.items():
        rank_dir = folder / "iter_0000020" / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
        rank_dir.mkdir(parents=True)
        models = (
            {"model": chunks[0]}
            if len(chunks) == 1
            else {f"model{i}": c for i, c in enumerate(chunks)}
        )
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": 20,
            **models,
            "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}},
            "opt_param_scheduler": {"num_steps": 80},
            "rng_state": [{"random_rng_state": (3, (1, 2), None)}],
            "num_floating_point_operations_so_far": 1.0,
        }
        torch.save(state, rank_dir / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text("20")


def _te_names(chunk: dict) -> dict:
    """The Transformer Engine spec's names: norms fused into the next linear, _extra_state."""
    out = {}
    for name, tensor in chunk.items():
        for local, te in (
            (".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),
            (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),
        ):
            if local in name:
                name = name.replace(local, te)
        out[name] = tensor
        if name.endswith("linear_qkv.weight"):
            out[name.replace(".weight", "._extra_state")] = io.BytesIO(b"fp8 meta")
        if name.endswith("linear_proj.weight"):
            out[name.replace(".weight", "._extra_state")] = None
    return out


def test_import_of_a_te_spec_tp2_pp2_checkpoint(tmp_path, capsys):
    model = build(CONFIGS["llama"])
    shards = {k: [_te_names(c) for c in v] for k, v in _expected_rank_files(model, 2, 2).items()}
    assert any("layer_norm_weight" in n for n in shards[(0, 0)][0])
    args = _megatron_args(model.config, 2, 2, tokenizer_type="GPT2BPETokenizer")
    _write_megatron(tmp_path / "megatron", shards, args, pp=2)

    import_megatron(tmp_path / "megatron", tmp_path / "ours", tp=1, pp=1)
    assert_same_tensors(model_tensors(tmp_path / "ours", 1, 1)[(0, 0)], model.state_dict())
    out = capsys.readouterr().out
    assert "Megatron-LM TP=2, PP=2 → mg TP=1, PP=1" in out
    assert "optimizer and RNG state not carried over" in out
    state = load_checkpoint(tmp_path / "ours")[0]  # plain data: loads without pickle
    assert state["args"]["lr"] == 3e-4 and state["args"]["tensor_model_parallel_size"] == 1
    assert "optimizer" not in state and state["iteration"] == 20
    assert state["mg"]["tokenizer_config"]["tokenizer_type"] == "GPT2BPETokenizer"


def test_import_of_virtual_pipeline_stages(tmp_path):
    """PP=2 with two model chunks per rank (model0, model1; Megatron's interleaved layers)."""
    model = build(GPT2)
    shards = _expected_rank_files(model, 1, 2, virtual=2)
    assert len(shards[(0, 0)]) == 2
    args = _megatron_args(GPT2, 1, 2, virtual_pipeline_model_parallel_size=2)
    _write_megatron(tmp_path / "megatron", shards, args, pp=2)
    import_megatron(tmp_path / "megatron", tmp_path / "ours", pp=1, **QUIET)
    assert_same_tensors(model_tensors(tmp_path / "ours", 1, 1)[(0, 0)], model.state_dict())


def test_export_repads_the_vocabulary_for_the_target_tp(tmp_path, capsys):
    """101 rows do not split in two: Megatron pads to a multiple of 128 x TP."""
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=101, seq_length=16
    )
    model = build(config)
    save_source(tmp_path / "ours", model)
    main(
        [
            "export-megatron",
            "--load",
            str(tmp_path / "ours"),
            "--save",
            str(tmp_path / "megatron"),
            "--target-tensor-model-parallel-size",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert "vocabulary re-padded from 101 to 256 rows" in out and "wrote" in out
    files = _megatron_files(tmp_path / "megatron", 2, 1)
    assert files[(0, 0)]["args"].padded_vocab_size == 256
    embedding = [files[(r, 0)]["model"]["embedding.word_embeddings.weight"] for r in range(2)]
    assert [e.shape[0] for e in embedding] == [128, 128]
    whole = torch.cat(embedding)
    assert torch.equal(whole[:101], model.state_dict()["embedding.word_embeddings.weight"])
    assert torch.equal(whole[101:], whole[100:101].expand(155, -1))  # Megatron's saver copies

    import_megatron(tmp_path / "megatron", tmp_path / "back", tp=1, **QUIET)
    ids = IDS % 101
    assert torch.equal(logits(tmp_path / "back", ids)[..., :101], logits(tmp_path / "ours", ids))


def test_refusals(tmp_path, capsys):
    model = build(CONFIGS["llama"])
    shards = _expected_rank_files(model, 2, 1)
    _write_megatron(tmp_path / "tp-mismatch", shards, _megatron_args(model.config, 1, 1), pp=1)
    with pytest.raises(ConvertError, match="the args say TP=1 PP=1, the mp_rank_\\* folders TP=2"):
        import_megatron(tmp_path / "tp-mismatch", tmp_path / "x", **QUIET)

    uneven = _megatron_args(GPT2, 1, 2, decoder_first_pipeline_num_layers=1)
    _write_megatron(tmp_path / "uneven", _expected_rank_files(build(GPT2), 1, 2), uneven, pp=2)
    with pytest.raises(ConvertError, match="uneven pipeline split \\(decoder_first_pipeline"):
        import_megatron(tmp_path / "uneven", tmp_path / "x", **QUIET)

    save_source(tmp_path / "ours", model)
    convert_format(tmp_path / "ours", tmp_path / "dist", "torch_dist", **QUIET)
    with pytest.raises(ConvertError, match="is an mg torch_dist checkpoint already"):
        import_megatron(tmp_path / "dist", tmp_path / "x", **QUIET)
    with pytest.raises(ConvertError, match="is an mg checkpoint already"):
        import_megatron(tmp_path / "ours", tmp_path / "x", **QUIET)
    (tmp_path / "no-args" / "release" / "mp_rank_00").mkdir(parents=True)
    torch.save(
        {"model": model.state_dict()}, tmp_path / "no-args/release/mp_rank_00/model_optim_rng.pt"
    )
    (tmp_path / "no-args" / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ConvertError, match="has no 'args'; not written by Megatron-LM"):
        import_megatron(tmp_path / "no-args", tmp_path / "x", **QUIET)

    with pytest.raises(SystemExit):
        main(
            ["export-megatron", "--load", str(tmp_path / "ours"), "--save", str(tmp_path / "x")]
            + ["--target-tensor-parallel-size", "3"]
        )
    err = capsys.readouterr().err
    assert (
        "mg-convert export-megatron: error: --target-tensor-parallel-size 3 does not divide" in err
    )
    assert not (tmp_path / "x").exists()
