"""Bad input gives one clear line naming the problem, and nothing under the target name."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from mg.ckpt_convert import import_hf as import_hf_module  # noqa: E402
from mg.ckpt_convert.cli import main  # noqa: E402
from mg.ckpt_convert.errors import ConvertError  # noqa: E402
from mg.ckpt_convert.import_hf import import_hf  # noqa: E402


def _run(*argv: str) -> subprocess.CompletedProcess:
    code = "from mg.ckpt_convert.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
    )


def _leftovers(tmp_path, name="ckpt"):
    return sorted(p.name for p in tmp_path.iterdir() if name in p.name)


def test_unsupported_architecture_one_line_no_traceback(tmp_path):
    from transformers import BloomConfig

    BloomConfig(n_layer=1, hidden_size=32, n_head=4).save_pretrained(tmp_path / "bloom")
    result = _run("import-hf", str(tmp_path / "bloom"), "--save", str(tmp_path / "ckpt"))
    assert result.returncode == 2
    assert "mg-convert import-hf: error:" in result.stderr
    assert "unsupported architecture 'bloom'; supported: bert, " in result.stderr
    for model_type in ("gemma3_text", "gpt2", "gpt_oss", "llama"):  # sorted, one line
        assert f" {model_type}," in result.stderr.splitlines()[-1], model_type
    assert "Traceback" not in result.stderr
    assert _leftovers(tmp_path) == []


def test_missing_shard(tmp_path, make_hf):
    make_hf("llama3", tmp_path / "hf", max_shard_size="50KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "hf" / gone).unlink()
    with pytest.raises(ConvertError, match=f"not in .*{gone}"):
        import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    assert _leftovers(tmp_path) == []


def test_mismatched_shape(tmp_path, make_hf):
    make_hf("mistral", tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.zeros(64, 80)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConvertError, match=r"shape mismatch for decoder\.layers\.1\.mlp\.linear_fc2"
    ):
        import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    assert _leftovers(tmp_path) == []


def test_unknown_rope_scaling(tmp_path, make_hf):
    make_hf("llama3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    scaling = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    config["rope_scaling"] = config["rope_parameters"] = scaling
    path.write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="'yarn' is not supported"):
        import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)


def test_missing_tensor_and_extra_layer(tmp_path, make_hf):
    make_hf("gpt2", tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors.pop("transformer.ln_f.weight")
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="no weights in the source.*final_layernorm"):
        import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)


def test_exception_mid_write_leaves_no_target(tmp_path, make_hf, monkeypatch):
    make_hf("gpt2", tmp_path / "hf")

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    # after every tensor went into the checkpoint file, before its data.pkl
    monkeypatch.setattr(import_hf_module.StreamingTorchFile, "finish", crash)
    with pytest.raises(OSError, match="simulated"):
        import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    assert _leftovers(tmp_path) == []


def test_existing_target_is_refused(tmp_path, make_hf):
    make_hf("gpt2", tmp_path / "hf")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match="already exists"):
        import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    assert (tmp_path / "ckpt" / "keep.txt").read_text() == "mine"


def test_repo_id_not_cached_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["import-hf", "nobody/no-such-model", "--save", str(tmp_path / "ckpt")])
    assert exit_info.value.code == 2
    assert "not in the local cache and no network" in capsys.readouterr().err


def test_reshard_of_a_missing_folder_says_so(capsys):
    with pytest.raises(SystemExit):
        main(["reshard", "--load", "a", "--save", "b", "--target-tensor-parallel-size", "2"])
    assert "checkpoint folder a does not exist" in capsys.readouterr().err


def test_inspect(tmp_path, make_hf, capsys):
    make_hf("llama3", tmp_path / "hf")
    main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    main(["inspect", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert "iteration    release" in out and "TP=1" in out and "float32" in out
    assert "num_query_groups = 2" in out and "extra.hf_vocab_size = 100" in out
    main(["inspect", str(tmp_path / "ckpt"), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["parameters"] > 0 and summary["size_on_disk_bytes"] > 0
