"""NemotronHForCausalLM (Mamba-2 + attention + MLP hybrid) through mg-convert: a tiny
random model → import-hf → our logits and greedy decoding; export-hf → transformers loads it, same
logits, the exact tensors save_pretrained wrote; a hybrid trained here exports too;
what MambaModel cannot express is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from mg.ckpt_convert.errors import ConvertError  # noqa: E402
from mg.ckpt_convert.export_hf import export_hf  # noqa: E402
from mg.ckpt_convert.import_hf import import_hf  # noqa: E402
from mg.ckpt_convert.inspect_checkpoint import format_summary, summarize  # noqa: E402
from mg.core.checkpoint.model_io import load_model, save_model  # noqa: E402
from mg.core.models.mamba import MambaConfig, MambaModel  # noqa: E402
from mg.core.models.mamba.hf import nemotron_h_config_from_hf  # noqa: E402

pytestmark = pytest.mark.compat

VOCAB = 100  # not a multiple of 128: import pads, export slices
PATTERN = "M*M-"


def _hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@torch.no_grad()
def _greedy(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding through HybridCache: Mamba states and attention keys/values."""
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


def _hf_config(**changes):
    from transformers import NemotronHConfig

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        hybrid_override_pattern=PATTERN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden_size / heads: attention's width is its own
        intermediate_size=96,
        mamba_num_heads=6,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        chunk_size=8,
        time_step_min=0.01,  # the dt clamp bites on some tokens (dt_bias init reaches 1e-3)
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    return NemotronHConfig(**{**fields, **changes})


def test_nemotron_h_import_export_parity(tmp_path):
    from transformers import AutoModelForCausalLM, NemotronHForCausalLM

    torch.manual_seed(0)
    hf_model = NemotronHForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # norms, skips and conv biases off their init values
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_model.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits

    import_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False)
    model, ours, _, _ = load_model(tmp_path / "ckpt")
    assert isinstance(model, MambaModel) and ours.layer_pattern == PATTERN
    assert ours.activation == "squared_relu" and ours.kv_channels == 24
    assert ours.position_embedding_type == "none" and ours.mamba_dt_clamp_min == 0.01
    with torch.no_grad():
        diff = (model(ids)[..., :VOCAB] - expected).abs().max().item()
    assert diff <= 1e-4
    prompt = ids[:1, :9]  # decodes as transformers does, with the model's caches
    with torch.no_grad():
        theirs = hf_model.generate(
            prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt)
        )[0, 9:].tolist()
    assert _greedy(model, prompt, 12) == theirs
    assert "NemotronHForCausalLM" in format_summary(summarize(tmp_path / "ckpt"))

    export_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (reloaded(ids).logits - expected).abs().max().item() <= 1e-4
    original, exported = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(t, exported[n]) for n, t in original.items())
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_config["model_type"] == "nemotron_h" and out_config["eos_token_id"] == 2


def test_hybrid_trained_here_exports_as_nemotron_h(tmp_path):
    """A MambaModel with no HF origin (no dt clamp, Megatron's), saved at TP=2 x PP=2
    → export-hf → transformers' logits are ours."""
    from transformers import AutoModelForCausalLM

    from mg.ckpt_convert.reshard import reshard

    torch.manual_seed(0)
    config = MambaConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=48,
        vocab_size=64,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=8,
        mamba_chunk_size=8,
        hybrid_override_pattern="M-*M",
        normalization="RMSNorm",
        activation="squared_relu",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )
    model = MambaModel(config).eval()
    save_model(tmp_path / "ckpt", model, config, None, iteration="release")
    reshard(tmp_path / "ckpt", tmp_path / "tp2pp2", tp=2, pp=2, report=lambda *_: None)
    export_hf(tmp_path / "tp2pp2", tmp_path / "out", progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 64, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(hybrid_override_pattern="M*E-"), "moe"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
    ],
)
def test_unsupported_nemotron_h_is_refused_by_name(changes, named):
    with pytest.raises(ValueError, match=named):
        nemotron_h_config_from_hf(_hf_config(**changes).to_dict())


def test_gelu_hybrid_export_names_the_field(tmp_path):
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
        untie_embeddings_and_output_weights=True,
        activation="swiglu",
    )
    save_model(tmp_path / "ckpt", MambaModel(config), config, None, iteration="release")
    with pytest.raises(ConvertError, match="activation='swiglu'"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)


def test_moe_nemotron_h_import_exits_2_in_one_line(tmp_path, capsys):
    from mg.ckpt_convert.cli import main

    _hf_config(hybrid_override_pattern="M*E-").save_pretrained(tmp_path / "hf")
    with pytest.raises(SystemExit) as exit_info:
        main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'moe' layers" in err
    assert not (tmp_path / "ckpt").exists()


def test_older_config_spelling():
    """Hub configs written before transformers' NemotronH: hybrid_override_pattern,
    attention_head_dim, mamba_* aliases."""
    config = nemotron_h_config_from_hf(
        dict(
            model_type="nemotron_h",
            vocab_size=VOCAB,
            hidden_size=64,
            hybrid_override_pattern="M-M*",
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            attention_head_dim=32,
            intermediate_size=96,
            mamba_num_heads=8,
            mamba_head_dim=16,
            mamba_n_groups=4,
            mamba_d_conv=3,
            ssm_state_size=16,
            mamba_chunk_size=32,
            time_step_min=0.001,
            mlp_hidden_act="relu2",
            residual_in_fp32=True,
        )
    )
    assert config.layer_pattern == "M-M*" and config.kv_channels == 32
    assert (config.mamba_num_groups, config.mamba_conv_kernel) == (4, 3)
    assert config.mamba_chunk_size == 32 and config.num_query_groups == 1
