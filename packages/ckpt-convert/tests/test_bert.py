"""BERT import/export: transformers BertModel / BertForMaskedLM / BertForPreTraining →
our post-LN BertModel with the same hidden states and logits, back to the same files;
the real MiniLM weights (FIXTURES.md)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from mg.ckpt_convert.export_hf import export_hf  # noqa: E402
from mg.ckpt_convert.import_hf import import_hf  # noqa: E402
from mg.core.checkpoint import load_checkpoint  # noqa: E402
from mg.core.models import TransformerConfig  # noqa: E402
from mg.core.models.bert import BertModel, bert_from_state_dict  # noqa: E402
from mg.core.tokenizers import TokenizerConfig  # noqa: E402

pytestmark = pytest.mark.compat

VOCAB = 100
TOL = 1e-4
CLASSES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")


def load_bert(folder) -> tuple[BertModel, TransformerConfig, dict]:
    state, _ = load_checkpoint(folder)
    config = TransformerConfig.from_dict(dict(state["mg"]["model_config"]))
    config.hidden_dropout = config.attention_dropout = 0.0
    return bert_from_state_dict(state["model"], config).eval(), config, state["mg"]


def make_hf_bert(hf_class: str, folder) -> torch.nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=40,
        type_vocab_size=2,
        attn_implementation="eager",
    )
    model = getattr(transformers, hf_class)(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    return model.eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (2, 16), generator=g)
    types = torch.cat([torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)], 1)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    return ids, types, mask


def _hf_outputs(model, hf_class: str) -> dict[str, torch.Tensor]:
    ids, types, mask = _inputs()
    with torch.no_grad():
        out = model(ids, token_type_ids=types, attention_mask=mask, output_hidden_states=True)
    result = {"hidden": out.hidden_states[-1]}
    if hf_class == "BertModel":
        result["pooled"] = out.pooler_output
    if hf_class == "BertForMaskedLM":
        result["mlm"] = out.logits
    if hf_class == "BertForPreTraining":
        result["mlm"], result["nsp"] = out.prediction_logits, out.seq_relationship_logits
    return result


def _our_outputs(model: BertModel) -> dict[str, torch.Tensor]:
    ids, types, mask = _inputs()
    with torch.no_grad():
        hidden = model.encode(ids, mask, types)
        mlm, nsp = model(ids, mask, types)
    out = {"hidden": hidden, "mlm": mlm[..., :VOCAB], "nsp": nsp}
    if model.pooler is not None:
        out["pooled"] = model.pooler(hidden)
    return out


def _close(expected: dict, ours: dict, mask: torch.Tensor) -> None:
    for key, value in expected.items():
        got = ours[key]
        if value.dim() == 3:  # padded query rows are never used (see padding_attention_mask)
            value, got = value[mask.bool()], got[mask.bool()]
        diff = (got - value).abs().max().item()
        print(f"{key}: max |Δ| = {diff:.2e}")
        assert diff <= TOL, key


@pytest.fixture
def transformers_warnings():
    from transformers.utils import logging as hf_logging

    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Handler(logging.WARNING)
    hf_logging.get_logger().addHandler(handler)
    yield records
    hf_logging.get_logger().removeHandler(handler)


@pytest.mark.parametrize("hf_class", CLASSES)
def test_bert_import_export_parity(hf_class, tmp_path, transformers_warnings):
    import transformers

    hf_model = make_hf_bert(hf_class, tmp_path / "hf")
    expected = _hf_outputs(hf_model, hf_class)
    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    model, config, meta = load_bert(tmp_path / "ckpt")
    assert config.transformer_layer_order == "post_ln"
    assert config.vocab_size == 128 and config.extra["hf_vocab_size"] == VOCAB
    assert (model.pooler is not None) == (hf_class != "BertForMaskedLM")
    assert meta["tokenizer_config"]["tokenizer_type"] == "BertWordPieceLowerCase"
    initialised = set(config.extra.get("hf_initialized", []))
    if hf_class == "BertModel":  # no MLM head, no NSP head in the source
        assert {"lm_head.dense.weight", "output_layer.bias", "binary_head.weight"} <= initialised
    else:
        assert not initialised
    _close(expected, _our_outputs(model), _inputs()[2])

    export_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
    transformers_warnings.clear()
    reloaded = getattr(transformers, hf_class).from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert not transformers_warnings, transformers_warnings
    again = _hf_outputs(reloaded.eval(), hf_class)
    for key, value in expected.items():
        assert torch.equal(again[key], value), key

    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_config["architectures"] == [hf_class] and out_config["model_type"] == "bert"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tokenizer("w7 w8 w9")["input_ids"] == [2, 12, 13, 14, 3]  # [CLS] ... [SEP]


def test_real_minilm_hidden_states(tmp_path):
    """The MiniLM-L6 BertModel of FIXTURES.md: import, then the hidden states of a real
    sentence, tokenized by the recorded WordPiece tokenizer, equal transformers'."""
    from transformers import BertModel as HFBertModel

    from mg.core.fixtures import fixture_dir
    from mg.core.tokenizers import build_tokenizer

    source = fixture_dir("minilm-bert")
    import_hf(str(source), tmp_path / "ckpt", progress=False)
    model, config, meta = load_bert(tmp_path / "ckpt")
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (6, 384, 30592)
    tok_config = TokenizerConfig.from_dict(meta["tokenizer_config"])
    tok_config.vocab_file = str(tmp_path / "ckpt" / tok_config.vocab_file)
    tokenizer = build_tokenizer(tok_config)
    text = "The quick brown fox jumps over the lazy dog near the riverbank."
    ids = torch.tensor([[tokenizer.cls, *tokenizer.tokenize(text), tokenizer.sep]])
    hf = HFBertModel.from_pretrained(source, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(ids).last_hidden_state
        ours = model.encode(ids)
    diff = (ours - expected).abs().max().item()
    print(f"MiniLM max |Δhidden| = {diff:.2e}")
    assert diff <= TOL


def test_pre_ln_bert_export_is_refused(tmp_path, capsys):
    """Megatron-Core's BERT is pre-LN, which transformers' post-LN BertModel cannot express."""
    from mg.ckpt_convert.cli import main
    from mg.core.checkpoint.model_io import save_model

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=128)
    save_model(tmp_path / "ckpt", BertModel(config), config, None)
    with pytest.raises(SystemExit):
        main(["export-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "pre-LN" in err and "post-LN" in err, err
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "ckpt")
