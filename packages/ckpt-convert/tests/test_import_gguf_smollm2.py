"""A real pretrained model through import-gguf: SmolLM2-135M-Instruct, Q4_1 (fixture
``smollm2-gguf``), against transformers' own GGUF loader, which dequantizes the same
blocks (its `load_gguf_checkpoint`; `from_pretrained(gguf_file=...)` runs it too, but
needs accelerate).

Checked: logits on three prompts, the greedy continuation of "The capital of France is"
through our model and the imported tokenizer, and perplexity on the first tokens of
Botchan.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from mg.ckpt_convert.import_gguf import import_gguf  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402
from mg.core.fixtures import FixtureError, fixture_path  # noqa: E402
from mg.core.tokenizers.build import build_tokenizer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compat]

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    return 12345 + 678",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
)


def _fixture(name: str, file: str) -> Path:
    try:
        return fixture_path(name, file)
    except FixtureError as exc:
        pytest.skip(f"fixture {name} cannot be fetched: {exc}")


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return _fixture("smollm2-gguf", GGUF)


@pytest.fixture(scope="module")
def ours(gguf_file, tmp_path_factory):
    save = tmp_path_factory.mktemp("smollm2") / "ckpt"
    import_gguf(gguf_file, save, progress=False)
    model, config, tokenizer_config, _ = load_model(save)
    return model.eval(), config, build_tokenizer(tokenizer_config), save


@pytest.fixture(scope="module")
def reference(gguf_file):
    """transformers' LlamaForCausalLM with the weights its GGUF loader dequantizes."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = gguf_file.parent, gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied: lm_head is the embedding
    model.tie_weights()
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_config(ours) -> None:
    _, config, tokenizer, _ = ours
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_query_groups) == (9, 3)
    assert config.rotary_base == 100000.0 and not config.untie_embeddings_and_output_weights
    assert config.extra["hf_vocab_size"] == VOCAB
    assert (tokenizer.bos, tokenizer.eod, tokenizer.pad) == (1, 2, 2)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_equal_transformers(prompt, ours, reference) -> None:
    model, _, tokenizer, _ = ours
    hf_model, hf_tokenizer = reference
    ids = tokenizer.tokenize(prompt)
    assert ids == hf_tokenizer(prompt).input_ids
    x = torch.tensor([ids])
    with torch.no_grad():
        diff = (model(x)[..., :VOCAB] - hf_model(x).logits).abs().max().item()
    print(f"{prompt[:24]!r}: {len(ids)} tokens, max |Δlogits| = {diff:.2e}")
    assert diff <= 1e-4


def test_greedy_continuation_names_paris(ours) -> None:
    model, _, tokenizer, _ = ours
    ids = tokenizer.tokenize("The capital of France is")
    for _ in range(4):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1, :VOCAB].argmax()))
    continuation = tokenizer.detokenize(ids[-4:])
    print(f"continuation: {continuation!r}")
    assert continuation.startswith(" Paris")


def _perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:])
    return math.exp(loss.item())


def test_botchan_perplexity_equals_transformers(ours, reference) -> None:
    model, _, tokenizer, _ = ours
    hf_model, _ = reference
    text = _fixture("botchan", "botchan.txt").read_text(encoding="utf-8-sig")
    ids = torch.tensor([tokenizer.tokenize(text[:4000])[:512]])
    assert ids.shape[1] == 512
    with torch.no_grad():
        mine = _perplexity(model(ids)[..., :VOCAB], ids)
        theirs = _perplexity(hf_model(ids).logits, ids)
    print(f"botchan, 512 tokens: perplexity {mine:.4f} (transformers {theirs:.4f})")
    assert abs(mine - theirs) / theirs <= 1e-3
    assert 5 < mine < 100  # a trained model on English prose


def test_export_hf_gives_the_model_and_chat_template_back(ours, reference, tmp_path) -> None:
    """export-hf of the imported checkpoint: transformers loads the folder (weights,
    tokenizer, chat template) and computes the reference logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mg.ckpt_convert.export_hf import export_hf

    _, _, tokenizer, save = ours
    hf_model, _ = reference
    export_hf(save, tmp_path / "hf", progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    chat = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    ids = hf_tokenizer(chat).input_ids
    assert ids == tokenizer.tokenize(chat)
    x = torch.tensor([ids])
    with torch.no_grad():
        diff = (loaded(x).logits - hf_model(x).logits).abs().max().item()
    print(f"export-hf → transformers: max |Δlogits| = {diff:.2e}")
    assert diff <= 1e-4
