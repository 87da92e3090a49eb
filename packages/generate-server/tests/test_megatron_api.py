"""PUT /api over real HTTP: Megatron's fields, defaults, validation messages and response shape."""

from __future__ import annotations

import math

import httpx
import pytest
import torch


def put(server, body, **kwargs) -> httpx.Response:
    return httpx.put(server.url + "/api", json=body, timeout=60, **kwargs)


@torch.no_grad()
def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding with full forwards (no cache), the reference for the engine."""
    ids = torch.tensor([prompt])
    for _ in range(steps):
        logits = model(ids)[0, -1, :50257]
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0].tolist()


def test_greedy_response_shape_and_tokens(server, loaded) -> None:
    tok = loaded.tokenizer
    r = put(server, {"prompts": ["The school", "I went"], "tokens_to_generate": 6, "top_k": 1})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"text", "segments", "logprobs"}
    assert body["logprobs"] is None
    prompts = ["The school", "I went"]
    for prompt, text, segments in zip(prompts, body["text"], body["segments"], strict=True):
        expected = greedy_reference(loaded.model, tok.tokenize(prompt), 6)
        assert tok.eod not in expected  # no early stop in this short greedy run
        assert text == tok.detokenize(expected)
        assert segments == [tok.id_to_token(t) for t in expected]
        assert text.startswith(prompt)


def test_logprobs_equal_log_softmax_of_the_model(server, loaded) -> None:
    tok = loaded.tokenizer
    r = put(
        server,
        {"prompts": ["It was a fine day"], "tokens_to_generate": 3, "top_k": 1, "logprobs": True},
    )
    body = r.json()
    sequence = greedy_reference(loaded.model, tok.tokenize("It was a fine day"), 3)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([sequence]))[0, :-1, :50257]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(sequence[1:])[:, None])[
        :, 0
    ]
    assert len(body["logprobs"][0]) == len(body["segments"][0]) - 1 == len(sequence) - 1
    assert body["logprobs"][0] == pytest.approx(expected.tolist(), abs=1e-4)


def test_tokens_to_generate_zero_scores_the_prompt(server) -> None:
    r = put(server, {"prompts": ["Scoring only"], "tokens_to_generate": 0, "logprobs": True})
    body = r.json()
    assert body["text"] == ["Scoring only"]
    assert len(body["logprobs"][0]) == len(body["segments"][0]) - 1
    assert all(lp <= 0 and math.isfinite(lp) for lp in body["logprobs"][0])


def test_defaults_sample_and_seed_repeats(server) -> None:
    body = {"prompts": ["Once upon a time"], "tokens_to_generate": 12, "random_seed": 42}
    first, second = put(server, body).json(), put(server, body).json()
    assert first["text"] == second["text"]
    others = {put(server, {**body, "random_seed": s}).json()["text"][0] for s in range(1, 6)}
    assert len(others | {first["text"][0]}) > 1  # sampling (default top_k=0) is not greedy


def test_add_bos_and_empty_prompt(server, loaded) -> None:
    r = put(server, {"prompts": [""], "tokens_to_generate": 2, "add_BOS": True, "top_k": 1})
    assert r.status_code == 200
    assert r.json()["segments"][0][0] == loaded.tokenizer.id_to_token(loaded.tokenizer.eod)


def test_stop_on_eol(server) -> None:
    r = put(
        server,
        {"prompts": ["The school"], "tokens_to_generate": 20, "top_k": 1, "stop_on_eol": True},
    )
    text = r.json()["text"][0]
    assert text.endswith("\n") and text.count("\n") == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "prompts argument required"),
        (
            {"prompts": ["a"], "max_len": 3},
            "max_len is no longer used.  Replace with tokens_to_generate",
        ),
        (
            {"sentences": ["a"], "prompts": ["a"]},
            "sentences is no longer used.  Replace with prompts",
        ),
        ({"prompts": "a"}, "prompts is not a list of strings"),
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": ["a"] * 129}, "Maximum number of prompts is 128"),
        (
            {"prompts": ["a"], "tokens_to_generate": "5"},
            "tokens_to_generate must be an integer greater than 0",
        ),
        (
            {"prompts": ["a"], "tokens_to_generate": -1},
            "tokens_to_generate must be an integer greater than or equal to 0",
        ),
        (
            {"prompts": ["a"], "tokens_to_generate": 0},
            "tokens_to_generate=0 implies logprobs should be True",
        ),
        ({"prompts": ["a"], "logprobs": "yes"}, "logprobs must be a boolean value"),
        (
            {"prompts": ["a"], "temperature": 0},
            "temperature must be a positive number less than or equal to 100.0",
        ),
        (
            {"prompts": ["a"], "temperature": 101.0},
            "temperature must be a positive number less than or equal to 100.0",
        ),
        (
            {"prompts": ["a"], "top_k": 1.5},
            "top_k must be an integer equal to or greater than 0 and less than or equal to 1000",
        ),
        (
            {"prompts": ["a"], "top_k": 1001},
            "top_k must be equal to or greater than 0 and less than or equal to 1000",
        ),
        (
            {"prompts": ["a"], "top_k": 5, "top_p": 0.5},
            "cannot set both top-k and top-p samplings.",
        ),
        ({"prompts": ["a"], "top_p": 1.5}, "top_p must be less than or equal to 1.0"),
        ({"prompts": ["a"], "top_p_decay": 0.5}, "top_p_decay cannot be set without top_p"),
        ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
        ({"prompts": ["a"], "add_BOS": 1}, "add_BOS must be a boolean value"),
        ({"prompts": ["a"], "stop_on_eol": "no"}, "stop_on_eol must be a boolean value"),
        ({"prompts": ["a"], "random_seed": -3}, "random_seed must be a positive integer"),
        ({"prompts": ["a"], "random_seed": "x"}, "random_seed must be integer"),
        (
            {"prompts": ["a"], "tokens_to_generate": 64},
            "Length of prompt + tokens_to_generate longer than allowed",
        ),
        (
            {"prompts": ["a"], "beam_width": 2},
            "beam_width: beam search is not supported by mg-serve; sample instead",
        ),
        ([1, 2], "request body must be a JSON object with a prompts field"),
    ],
)
def test_validation_messages(server, body, message) -> None:
    r = put(server, body)
    assert r.status_code == 400
    assert r.json() == {"message": message}


def test_bad_json_is_400_and_server_lives_on(server) -> None:
    r = httpx.put(server.url + "/api", content=b'{"prompts": [', timeout=10)
    assert r.status_code == 400
    assert r.json()["message"].startswith("request body is not valid JSON")
    r = httpx.put(server.url + "/api", content=b"\xff\xfe", timeout=10)
    assert r.status_code == 400
    r = httpx.put(server.url + "/api", content=b"[" * 5000 + b"]" * 5000, timeout=10)
    assert r.status_code == 400 and "nested too deeply" in r.json()["message"]
    assert put(server, {"prompts": ["ok"], "tokens_to_generate": 1}).status_code == 200


def test_health_metrics_openapi(server) -> None:
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny-gpt2"
    put(server, {"prompts": ["count me"], "tokens_to_generate": 2})
    metrics = httpx.get(server.url + "/metrics").text
    assert 'mg_serve_requests_total{endpoint="/api",status="200"}' in metrics
    assert "mg_serve_generated_tokens_total" in metrics
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/api", "/v1/completions", "/health", "/metrics"} <= set(spec["paths"])
    assert "put" in spec["paths"]["/api"]
