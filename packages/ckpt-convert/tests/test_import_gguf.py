"""import-gguf on small GGUF files written here with gguf.GGUFWriter.

Dequantization is checked against ggml's own formulas (a reference decoder of each
block layout, written from ggml-quants.c, plus blocks worked out by hand); the q/k
permutation against llama.cpp's converter (and small hand-permuted row orders); each
architecture end to end against transformers' logits for the model the file was
written from; the vocabulary against llama.cpp's own reference tokenizations.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize

from mg.ckpt_convert.gguf_file import metadata, open_reader, unpermute
from mg.ckpt_convert.gguf_tokenizer import build_tokenizer, write_tokenizer
from mg.ckpt_convert.import_gguf import import_gguf
from mg.core.checkpoint.model_io import load_model
from mg.core.tokenizers.build import build_tokenizer as mg_tokenizer
from mg.core.tokenizers.config import TokenizerConfig

pytest.importorskip("transformers")

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 256, 4, 2, 512, 2, 300
# bytes per block and values per block of each quantized type
BLOCKS = {
    "Q8_0": (34, 32),
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q4_K": (144, 256),
    "Q6_K": (210, 256),
}


# --- ggml's dequantize_row_* (ggml-quants.c), one block at a time, in float32 -------------


def _f16(raw: np.ndarray) -> np.float32:
    return np.float32(raw[:2].view(np.float16)[0])


def ref_q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b) * b[2:34].view(np.int8).astype(np.float32)


def ref_q4_0(b: np.ndarray) -> np.ndarray:
    d, qs = _f16(b), b[2:18]
    low, high = (qs & 0xF).astype(np.float32) - 8, (qs >> 4).astype(np.float32) - 8
    return np.concatenate([low * d, high * d])


def ref_q4_1(b: np.ndarray) -> np.ndarray:
    d, m, qs = _f16(b), _f16(b[2:]), b[4:20]
    return np.concatenate([(qs & 0xF).astype(np.float32) * d + m, (qs >> 4) * d + m])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
    return int(sc), int(mn)


def ref_q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _f16(b), _f16(b[2:]), b[4:16], b[16:144]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32]
        for shift, j in ((0, 2 * chunk), (4, 2 * chunk + 1)):
            sc, mn = _scale_min_k4(j, scales)
            out.append((d * np.float32(sc)) * ((q >> shift) & 0xF).astype(np.float32) - dmin * mn)
    return np.concatenate(out)


def ref_q6_k(b: np.ndarray) -> np.ndarray:
    ql, qh, sc, d = b[:128], b[128:192], b[192:208].view(np.int8), _f16(b[208:])
    y = np.zeros(256, np.float32)
    for half in range(2):
        l_, h_, s_, y_ = ql[64 * half :], qh[32 * half :], sc[8 * half :], 128 * half
        for i in range(32):
            k = i // 16
            q1 = int((l_[i] & 0xF) | (((h_[i] >> 0) & 3) << 4)) - 32
            q2 = int((l_[i + 32] & 0xF) | (((h_[i] >> 2) & 3) << 4)) - 32
            q3 = int((l_[i] >> 4) | (((h_[i] >> 4) & 3) << 4)) - 32
            q4 = int((l_[i + 32] >> 4) | (((h_[i] >> 6) & 3) << 4)) - 32
            for offset, q, s in ((0, q1, 0), (32, q2, 2), (64, q3, 4), (96, q4, 6)):
                y[y_ + i + offset] = d * np.float32(s_[k + s]) * np.float32(q)
    return y


REFERENCE = {
    "Q8_0": ref_q8_0,
    "Q4_0": ref_q4_0,
    "Q4_1": ref_q4_1,
    "Q4_K": ref_q4_k,
    "Q6_K": ref_q6_k,
}
# where each block keeps its float16 scales (d, then dmin / m)
SCALE_BYTES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes laid out as `rows` rows of `kind` blocks, with sane float16 scales."""
    size, per = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for offset in SCALE_BYTES[kind]:
        scales = rng.uniform(0.001, 0.02, (rows, cols // per)).astype(np.float16)
        data[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_dequantize_matches_ggml(kind: str) -> None:
    size, per = BLOCKS[kind]
    data = random_blocks(kind, 3, 2 * per)
    ours = dequantize(data, GGMLQuantizationType[kind])
    blocks = data.reshape(-1, size)
    expected = np.concatenate([REFERENCE[kind](b) for b in blocks]).reshape(3, 2 * per)
    assert ours.dtype == np.float32 and ours.shape == (3, 2 * per)
    assert np.array_equal(ours, expected)  # bit for bit


def test_dequantize_by_hand() -> None:
    # Q8_0: d = 0.25, q = -16..15 → q / 4
    block = np.zeros(34, np.uint8)
    block[:2] = np.array([0.25], np.float16).view(np.uint8)
    block[2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    got = dequantize(block[None], GGMLQuantizationType.Q8_0)[0]
    assert got.tolist() == [q / 4 for q in range(-16, 16)]
    # Q4_1: d = 0.5, m = -2; byte j holds j in its low nibble (value j) and 15 - j in its
    # high nibble (value 16 + j)
    block = np.zeros(20, np.uint8)
    block[:4] = np.array([0.5, -2.0], np.float16).view(np.uint8)
    block[4:] = np.arange(16, dtype=np.uint8) | ((15 - np.arange(16, dtype=np.uint8)) << 4)
    got = dequantize(block[None], GGMLQuantizationType.Q4_1)[0]
    assert got.tolist() == [0.5 * j - 2 for j in range(16)] + [
        0.5 * (15 - j) - 2 for j in range(16)
    ]
    # Q4_0: d = 2, every nibble 3 → (3 - 8) · 2
    block = np.full(18, 0x33, np.uint8)
    block[:2] = np.array([2.0], np.float16).view(np.uint8)
    assert dequantize(block[None], GGMLQuantizationType.Q4_0)[0].tolist() == [-10.0] * 32
    # BF16 / F16: the stored value
    bf16 = torch.tensor([[1.5, -0.125, 3e38]], dtype=torch.bfloat16)
    raw = bf16.view(torch.int16).numpy().view(np.uint8)
    got = dequantize(raw, GGMLQuantizationType.BF16)
    assert torch.equal(torch.from_numpy(got), bf16.float())


# --- llama.cpp's q/k permutation -----------------------------------------------------


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (heads = n_head_kv for k_proj)."""
    shape = weights.shape
    return (
        weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def test_unpermute_inverts_llama_cpp() -> None:
    # by hand: in each head, HF's rows [first half | second half] are interleaved
    assert llama_cpp_permute(np.arange(4), 1).tolist() == [0, 2, 1, 3]
    assert llama_cpp_permute(np.arange(8), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert llama_cpp_permute(np.arange(8), 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpermute(torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]), 1).tolist() == list(range(8))
    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    for heads in (1, 2, 3, 6):
        back = unpermute(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))


# --- GGUF files of tiny transformers models ------------------------------------------


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: the 256 byte-level token characters."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = [*_byte_chars(), "Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS += [f"[PAD{i}]" for i in range(VOCAB - len(TOKENS))]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
EOS = TOKENS.index("<|endoftext|>")


def hf_model(arch: str, tied: bool = False, rope_scaling: dict | None = None):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_class, model_class = classes[arch]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=20000.0,
        tie_word_embeddings=tied,
        attn_implementation="eager",
        **({"rope_scaling": dict(rope_scaling)} if rope_scaling else {}),  # it adds keys
    )
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{x}_proj.{p}": f"attn_{x}.{p}" for x in "qkv" for p in ("weight", "bias")},
}


def gguf_name(name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if name in top:
        return top[name]
    if name == "lm_head.weight":
        return "output.weight"
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def llama3_rope_freqs(head_dim: int, base: float, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs.weight for a llama3 `rope_scaling`."""
    factor, low = scaling["factor"], scaling["low_freq_factor"]
    high, old = scaling["high_freq_factor"], scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    path: Path, arch: str, model, kind: str = "F32", seed: int = 0, rope: dict | None = None
) -> dict:
    """The file llama.cpp's converter writes for `model` (q/k permuted for llama),
    with its 2-D tensors in `kind`; quantized types get random blocks instead of the
    model's weights. Returns the HF tensors the file holds (dequantized, unpermuted)."""
    config = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(20000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    writer.add_token_list(TOKENS)
    types = [TokenType.NORMAL] * len(TOKENS)
    for i, token in enumerate(TOKENS):
        if token.startswith("<|"):
            types[i] = TokenType.CONTROL
        elif token.startswith("[PAD"):
            types[i] = TokenType.UNUSED
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(EOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(EOS)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    if rope:
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config.head_dim, 20000.0, rope))
    expected = {}
    for i, (name, tensor) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        permuted = next((h for k, h in heads.items() if f".{k}." in name), None)
        if arch == "llama" and permuted:
            w = llama_cpp_permute(w, permuted)
        if w.ndim == 1 or kind == "F32":
            data, raw = w, None
        elif kind == "F16":
            data, raw = w.astype(np.float16), None
        elif kind == "BF16":
            bf16 = torch.from_numpy(w).to(torch.bfloat16)
            data, raw = bf16.view(torch.int16).numpy(), GGMLQuantizationType.BF16
        else:
            data = random_blocks(kind, w.shape[0], w.shape[1], seed + i)
            raw = GGMLQuantizationType[kind]
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(data), raw_dtype=raw)
        stored = dequantize(data.view(np.uint8) if raw else data, raw or _np_type(data))
        stored = torch.from_numpy(np.array(stored, np.float32).reshape(w.shape))
        expected[name] = unpermute(stored, permuted) if arch == "llama" and permuted else stored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _np_type(data: np.ndarray) -> GGMLQuantizationType:
    return GGMLQuantizationType.F16 if data.dtype == np.float16 else GGMLQuantizationType.F32


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB - 10, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False)]
)
def test_architecture_logits_equal_transformers(arch: str, tied: bool, tmp_path: Path) -> None:
    model = hf_model(arch, tied)
    write_gguf(tmp_path / "m.gguf", arch, model)
    import_gguf(tmp_path / "m.gguf", tmp_path / "ckpt", progress=False)
    ours, config, tokenizer_config, _ = load_model(tmp_path / "ckpt")
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (LAYERS, HIDDEN, FFN)
    assert (config.num_attention_heads, config.num_query_groups) == (HEADS, KV_HEADS)
    assert config.rotary_base == 20000.0 and config.layernorm_epsilon == pytest.approx(1e-5)
    assert config.untie_embeddings_and_output_weights is not tied
    assert config.add_qkv_bias is (arch == "qwen2") and config.qk_layernorm is (arch == "qwen3")
    assert config.vocab_size == 384 and config.extra["hf_vocab_size"] == VOCAB
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
        got = ours(ids)[..., :VOCAB]
    diff = (got - expected).abs().max().item()
    print(f"{arch} tied={tied}: max |Δlogits| = {diff:.2e}")
    assert diff <= 1e-4


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    model = hf_model("llama", rope_scaling=LLAMA3_ROPE)
    write_gguf(tmp_path / "m.gguf", "llama", model, rope=LLAMA3_ROPE)
    import_gguf(tmp_path / "m.gguf", tmp_path / "ckpt", progress=False)
    ours, config, _, _ = load_model(tmp_path / "ckpt")
    scaling = config.rope_scaling
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == (8, 1, 4)
    assert scaling.original_max_position_embeddings == 16
    ids = torch.randint(0, VOCAB - 10, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids)[..., :VOCAB] - model(ids).logits).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize(
    ("head_dim", "base", "factor", "high", "original"),
    [
        (128, 500000.0, 8.0, 4.0, 8192),  # Llama 3.1 8B
        (64, 500000.0, 32.0, 4.0, 8192),  # Llama 3.2 1B
        (128, 500000.0, 4.0, 2.5, 1000),  # unusual numbers: fitted, not looked up
    ],
)
def test_llama3_parameters_recovered(head_dim, base, factor, high, original) -> None:
    from mg.ckpt_convert.gguf_rope import llama3_scaling

    scaling = dict(
        LLAMA3_ROPE, factor=factor, high_freq_factor=high, original_max_position_embeddings=original
    )
    got = llama3_scaling(llama3_rope_freqs(head_dim, base, scaling), head_dim, base)
    assert got == scaling
    assert llama3_scaling(np.ones(head_dim // 2, np.float32), head_dim, base) == {}
    noise = np.random.default_rng(0).uniform(1, 3, head_dim // 2)
    assert llama3_scaling(noise, head_dim, base) is None


@pytest.mark.parametrize("kind", ["F16", "BF16", *BLOCKS])
def test_each_tensor_type_imports_exactly(kind: str, tmp_path: Path) -> None:
    """Every weight in the checkpoint is the file's block dequantized (and un-permuted),
    bit for bit: exported back to Hugging Face names, each tensor is compared."""
    from safetensors.torch import load_file

    from mg.ckpt_convert.export_hf import export_hf

    model = hf_model("llama")
    expected = write_gguf(tmp_path / "m.gguf", "llama", model, kind)
    import_gguf(tmp_path / "m.gguf", tmp_path / "ckpt", progress=False)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], tensor), name


def test_tokenizer_and_chat_template(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", "qwen2", hf_model("qwen2", tied=True))
    import_gguf(tmp_path / "m.gguf", tmp_path / "ckpt", progress=False)
    _, _, tokenizer_config, _ = load_model(tmp_path / "ckpt")
    tokenizer = mg_tokenizer(tokenizer_config)
    assert tokenizer.tokenize(" the") == [TOKENS.index("Ġthe")]
    assert tokenizer.tokenize("<|im_start|>he") == [TOKENS.index("<|im_start|>"), 257]
    assert (tokenizer.eod, tokenizer.bos, tokenizer.pad) == (EOS, EOS, EOS)
    assert tokenizer.detokenize(tokenizer.tokenize("hi there!")) == "hi there!"
    settings = json.loads((tmp_path / "ckpt" / "tokenizer" / "tokenizer_config.json").read_text())
    assert settings["chat_template"] == TEMPLATE
    assert settings["eos_token"] == "<|endoftext|>" and settings["add_bos_token"] is False


# llama-bpe's 128k tokens take gguf's reader some 20 s to parse: slow
@pytest.mark.parametrize(
    "name", ["gpt-2", pytest.param("llama-bpe", marks=pytest.mark.slow), "llama-spm"]
)
def test_vocabularies_tokenize_as_llama_cpp(name: str, tmp_path: Path) -> None:
    """llama.cpp's vocab-only GGUFs and their expected token ids (test-tokenizer-0):
    GPT-2 and Llama 3 byte-level BPE, Llama 2 SentencePiece; written out, mg's
    HuggingFaceTokenizer adds BOS where llama.cpp does (Llama 2, Llama 3)."""
    from mg.core.fixtures import FixtureError, fixture_dir

    try:
        folder = fixture_dir("llama-cpp-vocabs")
    except FixtureError as exc:
        pytest.skip(str(exc))
    path = folder / f"{name}.gguf"
    tokenizer = build_tokenizer(metadata(open_reader(path)), path)
    texts = (
        (folder / f"{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    )
    outs = (folder / f"{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) == len(outs) > 40
    for text, out in zip(texts, outs, strict=True):
        assert tokenizer.encode(text, add_special_tokens=False).ids == [int(i) for i in out.split()]

    meta = metadata(open_reader(path))
    assert write_tokenizer(meta, path, tmp_path / "tok", 4096)
    ours = mg_tokenizer(
        TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"))
    )
    bos = {"gpt-2": [], "llama-bpe": [128000], "llama-spm": [1]}[name]
    assert ours.tokenize(texts[-2]) == bos + [int(i) for i in outs[-2].split()]
    assert ours.eod == meta["tokenizer.ggml.eos_token_id"]


def _cli(capsys, *args: str) -> tuple[int, str]:
    """Run `mg-convert import-gguf ARGS` in this process: (exit status, stderr)."""
    from mg.ckpt_convert.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["import-gguf", *args])
    return exit_info.value.code, capsys.readouterr().err


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path, capsys) -> None:
    writer = GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, err = _cli(capsys, str(tmp_path / "phi.gguf"), "--save", str(tmp_path / "ckpt"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "general.architecture 'phi3' is not supported" in lines[0]
    assert not (tmp_path / "ckpt").exists()


def test_unsupported_tensor_type_is_refused_by_name(tmp_path: Path, capsys) -> None:
    model = hf_model("llama")
    write_gguf(tmp_path / "m.gguf", "llama", model)  # then one tensor as Q5_0
    reader = open_reader(tmp_path / "m.gguf")
    writer = GGUFWriter(str(tmp_path / "q5.gguf"), "llama")
    for key, value in metadata(reader).items():
        if key.startswith("llama.") or key == "tokenizer.ggml.model":
            writer.add_key_value(key, value, reader.fields[key].types[0])
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name == "blk.1.ffn_up.weight":
            blocks = np.zeros((FFN, HIDDEN // 32 * 22), np.uint8)
            writer.add_tensor(tensor.name, blocks, raw_dtype=GGMLQuantizationType.Q5_0)
        else:
            writer.add_tensor(tensor.name, data.reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, err = _cli(capsys, str(tmp_path / "q5.gguf"), "--save", str(tmp_path / "ckpt"))
    assert code == 2, err
    assert "blk.1.ffn_up.weight is Q5_0, a type import-gguf does not read" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_not_a_gguf_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    code, err = _cli(capsys, str(tmp_path / "x.gguf"), "--save", str(tmp_path / "ckpt"))
    assert code == 2 and "not a readable GGUF file" in err
    code, err = _cli(capsys, str(tmp_path / "none.gguf"), "--save", str(tmp_path / "ckpt"))
    assert code == 2 and "none.gguf does not exist or is not a file" in err


def test_cli_writes_and_overwrites(tmp_path: Path, capsys) -> None:
    from mg.ckpt_convert.cli import main

    write_gguf(tmp_path / "m.gguf", "qwen3", hf_model("qwen3"))
    main(["import-gguf", str(tmp_path / "m.gguf"), "--save", str(tmp_path / "ckpt")])
    assert f"wrote {tmp_path / 'ckpt'}" in capsys.readouterr().out
    code, err = _cli(capsys, str(tmp_path / "m.gguf"), "--save", str(tmp_path / "ckpt"))
    assert code == 2 and "--save" in err and "--overwrite" in err
    main(["import-gguf", str(tmp_path / "m.gguf"), "--save", str(tmp_path / "ckpt"), "--overwrite",
          "--dtype", "bf16"])  # fmt: skip
    _, config, _, _ = load_model(tmp_path / "ckpt")
    assert config.extra["hf_config"]["model_type"] == "qwen3"
    state = torch.load(
        tmp_path / "ckpt" / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False
    )
    assert {t.dtype for t in state["model"].values() if torch.is_tensor(t)} == {torch.bfloat16}
    code, err = _cli(capsys, str(tmp_path / "m.gguf"), "--save", str(tmp_path / "m.gguf"))
    assert code == 2 and "GGUF_FILE" in err
