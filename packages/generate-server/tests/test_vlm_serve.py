"""A tiny random LLaVA model served by mg-serve: images through Megatron's PUT /api
(`images`) and OpenAI chat (`image_url` data: URLs), greedy tokens equal to greedy
decoding with the model's own full-sequence forward, in a batch with a text-only
prompt; bad images refused with one line naming the field."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path

import httpx
import pytest
import torch

from mg.core.checkpoint import save_model
from mg.core.models.presets import tiny_gpt2
from mg.core.models.vision import LLaVAConfig, LLaVAModel
from mg.core.models.vision.image_processing import open_rgb, preprocess
from mg.core.models.vision.vit import VisionConfig
from mg.generate_server.chat import ChatTemplate
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.loading import LoadedModel, load_for_serving
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams
from mg.generate_server.vision_prefill import VisionPrefill

from .conftest import gpt2_tokenizer_config

VOCAB = 50257  # GPT-2's real vocabulary (the model's rows are padded to 50304)
NEW_TOKENS = 16
STOP = 50255  # a stop token in place of <|endoftext|>, so every run makes 16 tokens
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _png(seed: int, size: tuple[int, int] = (24, 20)) -> bytes:
    from PIL import Image

    pixels = torch.randint(
        0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed)
    )
    out = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(out, format="PNG")
    return out.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory) -> Path:
    language = tiny_gpt2(
        vocab_size=50304,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=64,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    vision = VisionConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        img_h=16,
        img_w=16,
        patch_dim=8,
    )
    config = LLaVAConfig(language, vision)  # 5 image rows (4 patches and the class token)
    torch.manual_seed(0)
    model = LLaVAModel(config)
    model.init_weights()
    with torch.no_grad():  # larger weights than a fresh init: varied greedy tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(10.0)
    folder = tmp_path_factory.mktemp("vlm") / "tiny-llava"
    save_model(folder, model, config, gpt2_tokenizer_config(), iteration=1)
    return folder


@pytest.fixture(scope="module")
def vlm_loaded(vlm_checkpoint) -> LoadedModel:
    loaded = load_for_serving(vlm_checkpoint)
    assert loaded.vlm is not None
    return loaded


@pytest.fixture(scope="module")
def vision(vlm_loaded) -> VisionPrefill:
    return VisionPrefill(vlm_loaded.vlm, max_image_pixels=10_000)


@pytest.fixture(scope="module")
def vlm_server(vlm_loaded, vision, start_server):
    template = ChatTemplate(TEMPLATE, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    with start_server(vlm_loaded, chat_template=template, vision=vision) as running:
        yield running


@torch.no_grad()
def greedy_llava(model: LLaVAModel, ids: list[int], images: list[bytes]) -> list[int]:
    """Greedy decoding with LLaVAModel's full-sequence forward (no cache), argmax each step."""
    transform = VisionPrefill(model, None).transform
    pixels = (
        torch.stack([preprocess(open_rgb(io.BytesIO(b)), transform) for b in images])
        if images
        else None
    )
    ids = list(ids)
    out = []
    for _ in range(NEW_TOKENS):
        logits = model(pixels, torch.tensor([ids]))[0, -1, :VOCAB]
        token = int(logits.argmax())
        ids.append(token)
        out.append(token)
    return out


def put(server, body) -> httpx.Response:
    return httpx.put(server.url + "/api", json=body, timeout=120)


def _generated(body: dict, index: int) -> list[str]:
    return body["segments"][index][-NEW_TOKENS:]


def test_image_and_text_prompts_in_one_batch_equal_the_model(vlm_server, vlm_loaded) -> None:
    tok, model = vlm_loaded.tokenizer, vlm_loaded.vlm
    image = _png(1)
    text_prompt = "The school"
    fields = {"tokens_to_generate": NEW_TOKENS, "top_k": 1, "stop_token": STOP}
    r = put(
        vlm_server,
        {
            "prompts": ["<image>\nA picture of", text_prompt],
            "images": [_b64(image), None],
            **fields,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    image_ids = [model.config.image_token_index] + tok.tokenize("\nA picture of")
    expected = greedy_llava(model, image_ids, [image])
    assert len(set(expected)) > 3  # not one repeated token
    assert STOP not in expected
    assert _generated(body, 0) == [tok.id_to_token(t) for t in expected]
    assert body["text"][0].startswith("<image>\nA picture of")
    text_expected = greedy_llava(model, tok.tokenize(text_prompt), [])
    assert _generated(body, 1) == [tok.id_to_token(t) for t in text_expected]
    alone = put(vlm_server, {"prompts": [text_prompt], **fields}).json()
    assert alone["segments"][0] == body["segments"][1]
    assert expected != text_expected  # the image changed the answer
    # no tag: the image goes at the prompt's start (LLaVA's rule), so the same tokens
    untagged = put(vlm_server, {"prompts": ["A picture of"], "images": [[_b64(image)]], **fields})
    assert _generated(untagged.json(), 0) == _generated(body, 0)


def test_add_bos_moves_the_image_rows(vlm_server, vlm_loaded) -> None:
    tok, model = vlm_loaded.tokenizer, vlm_loaded.vlm
    image = _png(7)
    fields = {"tokens_to_generate": NEW_TOKENS, "top_k": 1, "stop_token": STOP, "add_BOS": True}
    r = put(vlm_server, {"prompts": ["<image> Hi"], "images": [_b64(image)]} | fields)
    assert r.status_code == 200, r.text
    ids = [tok.eod, model.config.image_token_index] + tok.tokenize(" Hi")
    expected = greedy_llava(model, ids, [image])
    assert _generated(r.json(), 0) == [tok.id_to_token(t) for t in expected]
    assert r.json()["text"][0].startswith("<|endoftext|><image> Hi")


def test_chat_image_url_equals_the_model(vlm_server, vlm_loaded) -> None:
    tok, model = vlm_loaded.tokenizer, vlm_loaded.vlm
    image = _png(2)
    content = [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(image)}},
        {"type": "text", "text": " What is it?"},
    ]
    r = httpx.post(
        vlm_server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": content}],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "stop": [tok.detokenize([STOP])],
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    before, after = "<|endoftext|><user>Look: ", " What is it?\n<assistant>"
    ids = tok.tokenize(before) + [model.config.image_token_index] + tok.tokenize(after)
    expected = greedy_llava(model, ids, [image])
    assert r.json()["choices"][0]["message"]["content"] == tok.detokenize(expected)


def test_prefill_in_chunks_across_the_image_rows(vlm_loaded, vision) -> None:
    """A budget of 3 tokens a step: the image's 5 rows are spliced over several chunks."""
    tok, model = vlm_loaded.tokenizer, vlm_loaded.vlm
    image = _png(3)
    prompt = vision.prompt("Hi <image> there", [open_rgb(io.BytesIO(image))], tok.tokenize, "p")
    engine = GenerationEngine(
        ModelRunner(vlm_loaded.model, 2, 64, block_size=4),
        tok.detokenize,
        VOCAB,
        max_num_batched_tokens=3,
    )
    try:
        events = []
        done = threading.Event()

        def emit(event) -> None:
            events.append(event)
            if event.finish_reason is not None:
                done.set()

        params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
        engine.submit_many([(prompt.ids, params, emit)], [prompt.rows])
        assert done.wait(120)
    finally:
        engine.shutdown()
    got = [e.choice.token for e in events if e.choice is not None]
    ids = tok.tokenize("Hi ") + [model.config.image_token_index] + tok.tokenize(" there")
    assert got == greedy_llava(model, ids, [image])


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (
            {"prompts": ["x"], "images": [_b64(b"hello, not a picture")]},
            "images[0][0]: not an image",
        ),
        ({"prompts": ["x"], "images": [_b64(_png(4)[:60])]}, "images[0][0]: cannot be decoded"),
        ({"prompts": ["x"], "images": ["@@@"]}, "images[0][0]: not valid base64"),
        ({"prompts": ["x"], "images": [_b64(_png(4, (200, 100)))]}, "more than the limit of 10000"),
        ({"prompts": ["<image><image>x"], "images": [_b64(_png(4))]}, "prompts[0]: 2 <image> tag"),
        ({"prompts": ["<image> x"]}, "prompts[0]: 1 <image> tag(s) but 0 image(s)"),
        ({"prompts": ["x", "y"], "images": [None]}, "one entry per prompt"),
    ],
)
def test_megatron_api_refusals(vlm_server, body, fragment) -> None:
    r = put(vlm_server, {"tokens_to_generate": 2, **body})
    assert r.status_code == 400
    message = r.json()["message"]
    assert fragment in message and "\n" not in message


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        ("data:image/png;base64," + _b64(b"GIF89a"), "not an image"),
        ("file:///etc/passwd", "must be a data:image/...;base64,... URL"),
    ],
)
def test_chat_refusals(vlm_server, url, fragment) -> None:
    content = [{"type": "image_url", "image_url": {"url": url}}]
    r = httpx.post(
        vlm_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert fragment in message and "messages[0].content[0].image_url.url" in message


def test_text_only_model_refuses_images(server, loaded, start_server) -> None:
    r = put(server, {"prompts": ["x"], "images": [_b64(_png(5))], "tokens_to_generate": 2})
    assert r.status_code == 400
    assert r.json()["message"] == "images: this model is text-only and takes no images"
    template = ChatTemplate(TEMPLATE, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    with start_server(loaded, chat_template=template) as running:
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        r = httpx.post(
            running.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
            timeout=60,
        )
    assert r.status_code == 400
    assert "messages[0].content[0]: this model is text-only" in r.json()["error"]["message"]


def test_a_torch_dist_checkpoint_serves_the_same_model(vlm_loaded, tmp_path: Path) -> None:
    """Megatron-Core's keys (`vision_model.*`, `vision_projection.*`, `language_model.*`)
    in a torch_dist save load into the same weights as the torch save."""
    from mg.core.checkpoint.dist_format import save_dist_checkpoint
    from mg.core.checkpoint.megatron_dist import megatron_model_state
    from mg.core.checkpoint.megatron_sharded_keys import key_layout
    from mg.core.checkpoint.torch_format import mg_metadata

    model = vlm_loaded.vlm
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = megatron_model_state(weights, key_layout(model.config), extra_state=True)
    common = {"mg": mg_metadata(model.config.to_dict(), gpt2_tokenizer_config().to_dict())}
    save_dist_checkpoint(tmp_path / "dist", 1, {**state.tensors, **state.objects}, common)
    loaded = load_for_serving(tmp_path / "dist")
    assert loaded.vlm is not None
    for name, tensor in loaded.vlm.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


@pytest.mark.slow  # a server process: ~55 s on a loaded 2-CPU box
def test_mg_serve_command_on_a_vlm_checkpoint(vlm_checkpoint, vlm_loaded) -> None:
    """The command itself: a VLM checkpoint served (CPU kernels as chosen at start-up,
    prompts prefilled 4 tokens a step); --max-image-pixels refuses a larger image."""
    from .test_cli import _served

    tok, model = vlm_loaded.tokenizer, vlm_loaded.vlm
    image = _png(6)  # 24 x 20 = 480 pixels
    flags = ["--num-threads", "1", "--max-num-batched-tokens", "4", "--max-image-pixels", "480"]
    fields = {"tokens_to_generate": NEW_TOKENS, "top_k": 1, "stop_token": STOP}
    with _served(vlm_checkpoint, *flags) as (url, _):
        r = httpx.put(
            url + "/api",
            json={"prompts": ["Say <image> now"], "images": [_b64(image)]} | fields,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        ids = tok.tokenize("Say ") + [model.config.image_token_index] + tok.tokenize(" now")
        expected = greedy_llava(model, ids, [image])
        assert r.json()["segments"][0][-NEW_TOKENS:] == [tok.id_to_token(t) for t in expected]
        big = _b64(_png(6, (25, 20)))
        r = httpx.put(url + "/api", json={"prompts": ["x"], "images": [big]}, timeout=60)
        assert r.status_code == 400
        assert r.json()["message"] == (
            "images[0][0]: 25 × 20 = 500 pixels is more than the limit of 480"
        )
