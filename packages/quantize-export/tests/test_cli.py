"""mg-quantize end to end: every recipe writes an mg checkpoint that core's loader (what
mg-eval and mg-serve call) reads back into the same quantized model; bad input fails
in one line with status 2; the output is written atomically."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import load_model
from mg.core.quantization import (
    RECIPES,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    QuantizedLinear,
)
from mg.quantize_export import cli
from mg.quantize_export.evaluation import perplexity

HEAVY = {"int4_gptq", "int4_awq"}


def quantize(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        cli.main(["--no-progress", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_recipe_names_match_core() -> None:
    assert tuple(cli.RECIPES) == RECIPES


def test_help_lists_every_recipe_without_importing_torch() -> None:
    code = (
        "import sys; from mg.quantize_export import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported for --help'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for name in RECIPES:
        assert name in result.stdout


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("int8_wo", []),
        ("int4_wo", ["--group-size", "32"]),
        ("int4_wo", ["--group-size", "64", "--asymmetric"]),
        ("int8_sq", ["--calib"]),
        ("fp8", ["--calib"]),
        ("fp8", ["--calib", "--fp8-per-channel"]),
        ("int4_gptq", ["--group-size", "32", "--act-order", "--calib"]),
        ("int4_awq", ["--group-size", "32", "--calib"]),
        ("int4_awq", ["--group-size", "32", "--awq-clip", "--calib"]),
    ],
)
def test_recipe_round_trip(recipe, extra, trained_llama, datasets, tmp_path, capsys) -> None:
    model, ckpt = trained_llama
    calib, heldout = datasets
    if "--calib" in extra:
        extra = [a for a in extra if a != "--calib"]
        extra += ["--calib-data-path", calib, "--calib-samples", "8", "--calib-seq-length", "32"]
    save, report = tmp_path / "q", tmp_path / "report.json"
    code, out, err = quantize(
        capsys, "--load", str(ckpt), "--save", str(save), "--recipe", recipe, *extra,
        "--eval-data-path", heldout, "--eval-samples", "8", "--report", str(report),
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["quantized_linears"] == 8  # 2 layers x (qkv, proj, fc1, fc2); output layer kept
    assert data["size_after_bytes"] < data["size_before_bytes"]
    limit = {"int8_wo": 1, "int8_sq": 3, "fp8": 3}.get(recipe, 10)
    assert abs(data["ppl_change_pct"]) < limit, data
    assert 0 <= data["kl_divergence"] < 1 and 0 <= data["kl_divergence_p99"] < 5, data
    assert data["same_top_token_pct"] > 80, data
    loaded, config, tok, _ = load_model(save)
    assert tok is not None and Path(tok.vocab_file).is_file()  # copied beside the weights
    layer = loaded.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, QuantizedLinear)
    assert isinstance(loaded.output_layer, torch.nn.Linear)
    if recipe == "int8_wo":
        assert isinstance(layer.mlp.linear_fc2, Int8WeightOnlyLinear)
        assert layer.mlp.linear_fc2.qweight.dtype == torch.int8
    if recipe.startswith("int4"):
        assert isinstance(layer.mlp.linear_fc2, Int4WeightOnlyLinear)
    ids = torch.arange(100, 120)[None]
    # the reloaded model is the one that was evaluated
    from mg.quantize_export.calibration import calibration_samples

    samples = calibration_samples([heldout], 8, 32, 50257)
    assert perplexity(loaded, samples) == pytest.approx(data["ppl_after"], rel=1e-5)
    assert loaded(ids).shape == (1, 20, config.vocab_size)
    assert "mg-quantize" not in err or code == 0


def _fails(capsys, *argv: str) -> str:
    code, out, err = quantize(capsys, *argv)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_bad_input_is_one_line_status_2(trained_llama, datasets, tmp_path, capsys) -> None:
    _, ckpt = trained_llama
    calib, _ = datasets
    base = ["--load", str(ckpt), "--save", str(tmp_path / "q")]
    assert "'int3'" in _fails(capsys, *base, "--recipe", "int3")
    err = _fails(capsys, *base, "--recipe", "int4_wo", "--awq-clip")
    assert "--awq-clip applies to --recipe int4_awq only" in err
    assert "--group-size 48" in _fails(capsys, *base, "--recipe", "int4_wo", "--group-size", "48")
    # 128 is a valid group size, but not for this model's 64 hidden features
    err = _fails(capsys, *base, "--recipe", "int4_wo", "--group-size", "128")
    assert "does not divide" in err and "linear_qkv" in err
    err = _fails(capsys, *base, "--recipe", "int4_gptq", "--group-size", "32")
    assert "needs calibration data: give --calib-data-path" in err
    err = _fails(capsys, *base, "--recipe", "fp8", "--calib-data-path", calib,
                 "--calib-seq-length", "4096")  # fmt: skip
    assert "longer than the model's 32 positions" in err
    assert "no such folder" in _fails(capsys, "--load", str(tmp_path / "none"), "--save",
                                      str(tmp_path / "q"), "--recipe", "int8_wo")  # fmt: skip
    (tmp_path / "exists").mkdir()
    assert "--overwrite" in _fails(
        capsys, "--load", str(ckpt), "--save", str(tmp_path / "exists"), "--recipe", "int8_wo"
    )
    # already quantized
    done = tmp_path / "done"
    assert quantize(capsys, "--load", str(ckpt), "--save", str(done), "--recipe", "int8_wo")[0] == 0
    err = _fails(capsys, "--load", str(done), "--save", str(tmp_path / "q2"), "--recipe", "int8_wo")
    assert "already quantized (int8_wo)" in err
    # calibration data made with a bigger vocabulary than the checkpoint's tokenizer
    import numpy as np

    from mg.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "other_vocab"
    with IndexedDatasetBuilder(f"{prefix}.bin", np.int32) as builder:
        builder.add_document(np.arange(60000, 60000 + 4096) % 100000, [4096])
        builder.finalize(f"{prefix}.idx")
    err = _fails(
        capsys, *base, "--recipe", "fp8", "--calib-data-path", str(prefix),
        "--calib-samples", "4", "--calib-seq-length", "32",
    )  # fmt: skip
    assert "another tokenizer" in err and "50257" in err
    assert not (tmp_path / "q").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q.partial")]


def test_unsupported_architecture_is_refused(tmp_path, capsys) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    (folder / "model.safetensors").write_bytes(b"")
    err = _fails(
        capsys, "--load", str(folder), "--save", str(tmp_path / "q"), "--recipe", "int8_wo"
    )
    assert "unsupported architecture 'falcon'" in err


def test_interrupted_run_leaves_no_output(trained_llama, tmp_path, monkeypatch, capsys) -> None:
    from mg.quantize_export import output

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(output, "save_checkpoint_shards", boom)
    _, ckpt = trained_llama
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--load", str(ckpt), "--save", str(tmp_path / "q"), "--recipe", "int8_wo"])
    assert list(tmp_path.iterdir()) == []


def test_any_saved_layout_quantizes_to_the_same_checkpoint(trained_llama, tmp_path, capsys):
    """torch TP=2 shards and a torch_dist checkpoint of the same model (merged on the fly
    by core's loader) quantize to exactly the tensors of the single-file checkpoint."""
    from mg.core.checkpoint import RELEASE, load_checkpoint, mg_metadata, save_checkpoint_shards
    from mg.core.checkpoint.dist_format import save_dist_checkpoint
    from mg.core.checkpoint.tp_split import split_tensor_parallel

    model, ckpt = trained_llama
    config = model.config
    meta = load_checkpoint(ckpt)[0]["mg"]
    shards = split_tensor_parallel(model.state_dict(), 2, config.gated_linear_unit)
    tp_meta = mg_metadata(meta["model_config"], meta["tokenizer_config"], tp=2)
    save_checkpoint_shards(
        tmp_path / "tp2",
        RELEASE,
        {(tp, 0): {"model": s, "iteration": 0, "mg": tp_meta} for tp, s in enumerate(shards)},
    )
    save_dist_checkpoint(
        tmp_path / "dist", RELEASE, {"model": dict(model.state_dict())}, {"mg": meta}
    )
    outputs = {}
    for name, source in (("single", ckpt), ("tp2", tmp_path / "tp2"), ("dist", tmp_path / "dist")):
        save = tmp_path / f"q-{name}"
        code, _, err = quantize(
            capsys, "--load", str(source), "--save", str(save), "--recipe", "int4_wo",
            "--group-size", "32",
        )  # fmt: skip
        assert code == 0, err
        outputs[name] = load_checkpoint(save)[0]["model"]
    for name in ("tp2", "dist"):
        assert outputs[name].keys() == outputs["single"].keys()
        for key, tensor in outputs["single"].items():
            assert torch.equal(outputs[name][key], tensor), (name, key)
