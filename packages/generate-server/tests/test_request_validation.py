"""Every numeric field of every endpoint: true/false is no number, integers are range-checked
(seeds within torch.Generator's 64 bits), and each refusal is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from mg.generate_server.chat import ChatTemplate

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]

COMPLETION_NUMBERS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "best_of",
]
CHAT_NUMBERS = [
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "seed",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
]
MEGATRON_NUMBERS = [
    "tokens_to_generate",
    "temperature",
    "top_k",
    "top_p",
    "top_p_decay",
    "top_p_bound",
    "random_seed",
    "stop_token",
]


@pytest.fixture(scope="module")
def chat_server(loaded, start_server):
    template = ChatTemplate(TEMPLATE, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    with start_server(loaded, chat_template=template) as running:
        yield running


def _openai_error(response: httpx.Response) -> tuple[str, str | None]:
    assert response.status_code == 400, (response.status_code, response.text)
    error = response.json()["error"]
    return error["message"], error["param"]


@pytest.mark.parametrize("field", COMPLETION_NUMBERS)
@pytest.mark.parametrize("value", [True, False])
def test_completions_refuse_booleans_as_numbers(server, field, value) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, field: value}
    message, param = _openai_error(httpx.post(server.url + "/v1/completions", json=body))
    assert param == field and message.startswith(f"{field}: must be")
    assert ("true" if value else "false") in message


@pytest.mark.parametrize("field", CHAT_NUMBERS)
def test_chat_refuses_booleans_as_numbers(chat_server, field) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2, field: True}
    response = httpx.post(chat_server.url + "/v1/chat/completions", json=body)
    message, param = _openai_error(response)
    assert param == field and message.startswith(f"{field}: must be")


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        ({"prompt": [True, 5]}, "prompt", "token ids are integers"),
        ({"prompt": [[1, 2], [False]]}, "prompt", "lists of token ids"),
        ({"prompt": "Hi", "logit_bias": {"5": True}}, "logit_bias.5", "must be a number"),
        ({"prompt": "Hi", "max_tokens": "16"}, "max_tokens", "valid integer"),
        ({"prompt": "Hi", "max_tokens": 16.0}, "max_tokens", "valid integer"),
        ({"prompt": "Hi", "stream": 1}, "stream", "valid boolean"),
        ({"prompt": "Hi", "echo": "yes"}, "echo", "valid boolean"),
        ({"prompt": "Hi", "seed": 2**64}, "seed", "less than or equal to 18446744073709551615"),
        ({"prompt": "Hi", "seed": 2**80}, "seed", "less than or equal to"),
        ({"prompt": "Hi", "seed": -1}, "seed", "greater than or equal to 0"),
        ({"prompt": "Hi", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"prompt": "Hi", "stream_options": {"include_usage": 1}}, "stream_options", "boolean"),
    ],
)
def test_completions_field_errors(server, body, field, fragment) -> None:
    message, param = _openai_error(httpx.post(server.url + "/v1/completions", json=body))
    assert param is not None and param.startswith(field.split(".")[0])
    assert message.startswith(field) and fragment in message, message


def test_the_largest_seed_works_with_several_choices(server) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "n": 2, "seed": 2**64 - 1}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    second = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    texts = [c["text"] for c in first.json()["choices"]]
    assert texts == [c["text"] for c in second.json()["choices"]]


def test_integers_still_count_as_floats(server) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_p": 1, "logit_bias": {"5": 1}}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("field", MEGATRON_NUMBERS)
def test_megatron_api_refuses_booleans_as_numbers(server, field) -> None:
    body = {"prompts": ["Hi"], "tokens_to_generate": 2, "top_p": 0.5, field: True}
    if field == "top_k":
        body.pop("top_p")
    r = httpx.put(server.url + "/api", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["message"].startswith(field)


SEED_RANGE = "random_seed must be at most 2**64 - 1 (18446744073709551615)"
STOP_RANGE = "stop_token must be a token id of this tokenizer (0..50256), not "


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"random_seed": 2**80}, SEED_RANGE),
        ({"random_seed": 2**64}, SEED_RANGE),
        ({"random_seed": 1.5}, "random_seed must be integer"),
        ({"stop_token": 2**80}, STOP_RANGE + str(2**80)),
        ({"stop_token": -3}, STOP_RANGE + "-3"),
    ],
)
def test_megatron_api_ranges(server, body, message) -> None:
    r = httpx.put(server.url + "/api", json={"prompts": ["Hi"], "tokens_to_generate": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json() == {"message": message}


def test_megatron_api_largest_seed_over_several_prompts(server) -> None:
    body = {"prompts": ["Hi", "Good"], "tokens_to_generate": 3, "random_seed": 2**64 - 1}
    first = httpx.put(server.url + "/api", json=body, timeout=60)
    assert first.status_code == 200, first.text
    second = httpx.put(server.url + "/api", json=body, timeout=60)
    assert first.json()["text"] == second.json()["text"]
