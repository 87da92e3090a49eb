"""The OpenAI endpoints through the `openai` package (plain and streamed) and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from mg.generate_server.chat import ChatTemplate

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@torch.no_grad()
def greedy_ids(model, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(steps):
        ids = torch.cat([ids, model(ids)[0, -1, :50257].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_greedy_completion_equals_full_forward_greedy(client, loaded) -> None:
    tok = loaded.tokenizer
    out = client.completions.create(
        model="tiny-gpt2", prompt="The school was", max_tokens=10, temperature=0
    )
    expected = greedy_ids(loaded.model, tok.tokenize("The school was"), 10)
    assert tok.eod not in expected
    assert out.choices[0].text == tok.detokenize(expected)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 10
    assert out.object == "text_completion"


def test_streaming_concatenates_to_the_plain_text(client) -> None:
    args = dict(model="m", prompt="I said", max_tokens=12, temperature=0.8, seed=7)
    plain = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_seed_n_and_several_prompts(client) -> None:
    args = dict(model="m", prompt=["Hello", "Good"], max_tokens=8, n=2, seed=3, temperature=1.0)
    first, second = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_stop_string_cuts_the_text(client) -> None:
    base = client.completions.create(model="m", prompt="The", max_tokens=20, temperature=0)
    text = base.choices[0].text
    stop = text[4:7]
    assert stop and stop in text
    out = client.completions.create(
        model="m", prompt="The", max_tokens=20, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="m", prompt="The", max_tokens=20, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_and_echo(client, loaded) -> None:
    tok = loaded.tokenizer
    out = client.completions.create(
        model="m", prompt="It was", max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = out.choices[0]
    lp = choice.logprobs
    prompt = tok.tokenize("It was")
    sequence = prompt + greedy_ids(loaded.model, prompt, 3)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([sequence]))[0, :-1, :50257]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
    assert choice.text.startswith("It was")
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-4)
    assert all(len(t) == 2 for t in lp.top_logprobs[len(prompt) :])
    assert lp.text_offset[1] == len(lp.tokens[0])


def test_logprobs_zero_reports_the_chosen_tokens(client, loaded) -> None:
    """OpenAI's logprobs=0: each token's log-probability, no alternatives."""
    prompt = loaded.tokenizer.tokenize("It was")
    sequence = prompt + greedy_ids(loaded.model, prompt, 3)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([sequence]))[0, len(prompt) - 1 : -1, :50257]
    expected = torch.log_softmax(logits, -1).gather(
        1, torch.tensor(sequence[len(prompt) :])[:, None]
    )
    args = dict(model="m", prompt="It was", max_tokens=3, temperature=0, logprobs=0)
    lp = client.completions.create(**args).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected[:, 0].tolist(), abs=1e-4)
    assert lp.top_logprobs == [{}, {}, {}]
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs.token_logprobs[0] for c in chunks if c.choices[0].logprobs]
    # one entry per token: the closing chunk (finish reason, no token) repeats none
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_token_id_prompt(client, loaded) -> None:
    ids = loaded.tokenizer.tokenize("The school was")
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(
        model="m", prompt="The school was", max_tokens=5, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (dict(max_tokens=100), "maximum context length is 64 tokens"),
        (dict(temperature=3.0), "temperature"),
        (dict(logprobs=9), "logprobs"),
        (dict(n=0), "n"),
        (dict(stop=["a", "b", "c", "d", "e"]), "at most 4 stop strings"),
        (dict(suffix="tail"), "suffix"),
        (dict(extra_body={"top_k": -1}), "top_k"),
    ],
)
def test_bad_requests_are_400(client, args, fragment) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="m", prompt="Hi", **args)
    assert caught.value.status_code == 400
    assert fragment in caught.value.message


def test_out_of_vocabulary_token_ids(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 99999]}, timeout=10)
    assert r.status_code == 400
    assert "outside the vocabulary" in r.json()["error"]["message"]


def test_no_chat_without_template(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_chat_with_a_template(loaded, start_server) -> None:
    template = ChatTemplate(TEMPLATE, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    with start_server(loaded, chat_template=template) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Who are you?"}]
        out = client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
        )
        rendered = template.render(messages)
        assert rendered == "<|endoftext|><user>Who are you?\n<assistant>"
        completion = client.completions.create(
            model="m", prompt=loaded.tokenizer.tokenize(rendered), max_tokens=6, temperature=0
        )
        assert out.choices[0].message.content == completion.choices[0].text
        assert out.choices[0].message.role == "assistant"
        assert len(out.choices[0].logprobs.content[0].top_logprobs) == 2
        plain = client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, temperature=0, logprobs=True
        )
        assert [c.logprob for c in plain.choices[0].logprobs.content] == pytest.approx(
            [c.logprob for c in out.choices[0].logprobs.content], abs=1e-5
        )
        assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
        stream = client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == out.choices[0].message.content


def test_raw_sse_format(server) -> None:
    body = {
        "prompt": "Hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 3
