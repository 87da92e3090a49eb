"""Mamba2ForCausalLM through mg-convert: HF → import-hf → our logits; export-hf → transformers
loads it without warnings, same logits, the exact tensors save_pretrained wrote."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from mg.ckpt_convert.errors import ConvertError  # noqa: E402
from mg.ckpt_convert.export_hf import export_hf  # noqa: E402
from mg.ckpt_convert.import_hf import import_hf  # noqa: E402
from mg.core.checkpoint.model_io import load_model, save_model  # noqa: E402
from mg.core.models.mamba import MambaConfig, MambaModel  # noqa: E402

pytestmark = pytest.mark.compat

VOCAB = 100  # not a multiple of 128: import pads, export slices


def _hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@torch.no_grad()
def _greedy(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding with the model's recurrent state (HybridCache), over the HF vocab."""
    from mg.core.models.mamba import HybridCache

    cache = HybridCache.for_model(model, num_slots=1, max_length=64)
    n = prompt.shape[1]
    cache.bind(torch.tensor([0]), torch.tensor([0]))
    logits = model(prompt, torch.arange(n)[None], inference_cache=cache)[:, -1, :VOCAB]
    tokens = []
    for i in range(steps):
        tokens.append(int(logits.argmax(-1)))
        cache.bind(torch.tensor([0]), torch.tensor([n + i]))
        step = model(torch.tensor([[tokens[-1]]]), torch.tensor([[n + i]]), inference_cache=cache)
        logits = step[:, -1, :VOCAB]
    return tokens


@pytest.mark.parametrize("tied", [False, True])
def test_mamba2_import_export_parity(tmp_path, tied):
    from transformers import AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM
    from transformers.utils import logging as hf_logging

    torch.manual_seed(0)
    config = Mamba2Config(
        num_heads=8,
        head_dim=16,
        hidden_size=64,
        state_size=16,
        n_groups=2,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        chunk_size=16,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf_model = Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # norms, skips and conv biases off their init values
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_model.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits

    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    model, ours, _, _ = load_model(tmp_path / "ckpt")
    assert isinstance(model, MambaModel) and ours.vocab_size == 128
    assert ours.layer_pattern == "MM" and ours.mamba_num_groups == 2
    with torch.no_grad():
        diff = (model(ids)[..., :VOCAB] - expected).abs().max().item()
    assert diff <= 1e-4
    if not tied:  # the imported model decodes as transformers does, with its recurrent state
        prompt = ids[:1, :9]
        with torch.no_grad():
            theirs = hf_model.generate(
                prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt)
            )[0, 9:].tolist()
        assert _greedy(model, prompt, 12) == theirs

    export_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Handler(logging.WARNING)
    hf_logging.get_logger().addHandler(handler)
    try:
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    finally:
        hf_logging.get_logger().removeHandler(handler)
    assert not [r for r in records if "fall" not in r], records  # kernel fallback notes only
    with torch.no_grad():
        assert (reloaded(ids).logits - expected).abs().max().item() <= 1e-4
    original, exported = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(t, exported[n]) for n, t in original.items())
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_config["model_type"] == "mamba2" and out_config["eos_token_id"] == 2


def test_tied_hybrid_export_is_refused_by_name(tmp_path):
    """A hybrid exports as NemotronHForCausalLM, which never ties lm_head."""
    config = MambaConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        vocab_size=64,
        mamba_head_dim=16,
        mamba_num_groups=1,
        mamba_state_dim=8,
        hybrid_override_pattern="M*",
        normalization="RMSNorm",
        add_bias_linear=False,
    )
    save_model(tmp_path / "ckpt", MambaModel(config), config, None, iteration="release")
    with pytest.raises(ConvertError, match="untie_embeddings_and_output_weights=False"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
