"""Per-architecture parity (LitGPT's test_against_hf_*): HF → import → our logits; export
→ transformers loads it without warnings and gives the same logits; round trip bit-exact."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from mg.ckpt_convert.export_hf import export_hf  # noqa: E402
from mg.ckpt_convert.import_hf import import_hf  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402

pytestmark = pytest.mark.compat

KINDS = ("gpt2", "llama3", "mistral")
TOL = 1e-4


def _ids(vocab: int = 100, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def _hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.fixture
def capture_transformers_warnings():
    """Records what transformers logs at WARNING or above while loading."""
    from transformers.utils import logging as hf_logging

    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Handler(logging.WARNING)
    hf_logging.get_logger().addHandler(handler)
    yield records
    hf_logging.get_logger().removeHandler(handler)


@pytest.mark.parametrize("kind", KINDS)
def test_import_export_parity(kind, tmp_path, make_hf, capture_transformers_warnings):
    from transformers import AutoModelForCausalLM

    hf_model = make_hf(kind, tmp_path / "hf")
    ids = _ids()
    with torch.no_grad():
        expected = hf_model(ids).logits

    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    model, config, tokenizer_config, info = load_model(tmp_path / "ckpt")
    assert config.vocab_size == 128 and config.extra["hf_vocab_size"] == 100
    assert info.iteration == "release"
    assert tokenizer_config.tokenizer_type == "HuggingFaceTokenizer"
    assert (tmp_path / "ckpt" / "tokenizer" / "tokenizer.json").is_file()
    with torch.no_grad():
        ours = model.eval()(ids)[..., :100]
    diff = (ours - expected).abs().max().item()
    print(f"{kind}: import max |Δlogits| = {diff:.2e}")
    assert diff <= TOL

    export_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
    capture_transformers_warnings.clear()
    reloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert not capture_transformers_warnings, capture_transformers_warnings
    with torch.no_grad():
        again = reloaded(ids).logits
    diff = (again - expected).abs().max().item()
    print(f"{kind}: export max |Δlogits| = {diff:.2e}")
    assert diff <= TOL

    # Round trip: the exact tensors save_pretrained wrote.
    original, exported = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).is_file()
    source_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_config["model_type"] == source_config["model_type"]
    assert out_config["eos_token_id"] == 2


def test_sharded_input_and_output(tmp_path, make_hf):
    hf_model = make_hf("llama3", tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ids = _ids()
    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    model, *_ = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        assert (model(ids)[..., :100] - hf_model(ids).logits).abs().max() <= TOL

    export_hf(tmp_path / "ckpt", tmp_path / "out", shard_size="40KB", progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    original, exported = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "out")
    assert all(torch.equal(t, exported[n]) for n, t in original.items())


def test_pytorch_bin_input(tmp_path, make_hf):
    hf_model = make_hf("gpt2", tmp_path / "hf")
    # Old-style weights file, written as older transformers did (tied lm_head included).
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save(hf_model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    model, *_ = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        assert (model(_ids())[..., :100] - hf_model(_ids()).logits).abs().max() <= TOL


def test_dtype_bf16(tmp_path, make_hf):
    make_hf("mistral", tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", dtype="bf16", progress=False)
    model, *_ = load_model(tmp_path / "ckpt")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    export_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"


def test_import_streams_layer_by_layer(tmp_path, make_hf, monkeypatch):
    """Source tensors are read per layer through handles closed after it: at most one
    layer's tensors are open at a time, and every tensor is read exactly once."""
    from mg.ckpt_convert.hf_source import HFWeights

    make_hf("llama3", tmp_path / "hf", max_shard_size="50KB")
    groups: list[list[str]] = []
    real = HFWeights.open_group

    def recording(self, names):
        names = list(names)
        groups.append(names)
        return real(self, names)

    monkeypatch.setattr(HFWeights, "open_group", recording)
    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    read = [n for g in groups for n in g]
    assert len(read) == len(set(read)) == len(_hf_tensors(tmp_path / "hf"))
    assert len(groups) == 3  # embeddings/norm/head, layer 0, layer 1
    assert max(len(g) for g in groups) <= 9
