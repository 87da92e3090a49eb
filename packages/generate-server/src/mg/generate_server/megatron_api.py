"""Megatron's `PUT /api`: its fields, defaults, validation messages and response shape.

Request and response follow `tools/run_text_generation_server.py` (REFERENCE §5):

    PUT /api {"prompts": ["Hello"], "tokens_to_generate": 16, "top_k": 1}
    → {"text": ["Hello, world…"], "segments": [["Hello", ",", " world", …]], "logprobs": null}

`text` is each prompt followed by its completion, `segments` the token
strings of the whole sequence, `logprobs` (with "logprobs": true) the
log-probability of every token after the first. Validation messages are
Megatron's own strings. Two deliberate differences: a bad request is always
status 400 with `{"message": …}` (Megatron answers some of them with 200 and
a bare string, which its own client cannot tell from a result), and each
prompt gets exactly `tokens_to_generate` tokens (Megatron pads the batch so
shorter prompts get more).

Images (a vision-language checkpoint): Megatron's text generation server takes
none (its multimodal example, `examples/multimodal/run_text_generation.py`,
reads image files from a folder), so mg adds one field: `images`, a list beside
`prompts`, each entry the base64 text of one image (PNG, JPEG, ...), a list of
them, or null for a text-only prompt. A prompt's `<image>` tags say where its
images go; a prompt without tags gets them at its start (`vision_prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mg.core.tokenizers import BaseTokenizer
from mg.generate_server.async_bridge import Completion
from mg.generate_server.errors import ApiError
from mg.generate_server.sampling import MAX_SEED, SamplingParams, choice_seed
from mg.generate_server.vision_prefill import (
    ImageInputError,
    ImagePrompt,
    VisionPrefill,
    decode_base64_image,
)

MAX_PROMPTS = 128


@dataclass
class MegatronRequest:
    prompts: list[str]
    tokens_to_generate: int = 64
    logprobs: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    add_BOS: bool = False  # noqa: N815 - Megatron's field name
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False
    random_seed: int = -1
    no_log: bool = False
    stop_token: int | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean value")
    return value


def parse_megatron_request(body: Any) -> MegatronRequest:
    """Check a decoded JSON body field by field, in Megatron's order and words."""
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object with a prompts field")
    if "prompts" not in body:
        raise ApiError("prompts argument required")
    if "max_len" in body:
        raise ApiError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in body:
        raise ApiError("sentences is no longer used.  Replace with prompts")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ApiError("prompts is not a list of strings")
    if len(prompts) == 0:
        raise ApiError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(f"Maximum number of prompts is {MAX_PROMPTS}")
    req = MegatronRequest(prompts=prompts)

    if "tokens_to_generate" in body:
        value = body["tokens_to_generate"]
        if not _is_int(value):
            raise ApiError("tokens_to_generate must be an integer greater than 0")
        if value < 0:
            raise ApiError("tokens_to_generate must be an integer greater than or equal to 0")
        req.tokens_to_generate = value
    req.logprobs = _bool_field(body, "logprobs")
    if req.tokens_to_generate == 0 and not req.logprobs:
        raise ApiError("tokens_to_generate=0 implies logprobs should be True")

    if "temperature" in body:
        value = body["temperature"]
        if not _is_number(value) or not 0.0 < value <= 100.0:
            raise ApiError("temperature must be a positive number less than or equal to 100.0")
        req.temperature = float(value)
    if "top_k" in body:
        value = body["top_k"]
        if not _is_int(value):
            raise ApiError(
                "top_k must be an integer equal to or greater than 0 and less than or equal to 1000"
            )
        if not 0 <= value <= 1000:
            raise ApiError(
                "top_k must be equal to or greater than 0 and less than or equal to 1000"
            )
        req.top_k = value
    if "top_p" in body:
        value = body["top_p"]
        if not _is_number(value):
            raise ApiError("top_p must be a positive float less than or equal to 1.0")
        if value > 0.0 and req.top_k > 0:
            raise ApiError("cannot set both top-k and top-p samplings.")
        if not 0.0 <= value <= 1.0:
            raise ApiError("top_p must be less than or equal to 1.0")
        req.top_p = float(value)
    if "top_p_decay" in body:
        value = body["top_p_decay"]
        if not _is_number(value):
            raise ApiError("top_p_decay must be a positive float less than or equal to 1.0")
        if req.top_p == 0.0:
            raise ApiError("top_p_decay cannot be set without top_p")
        if not 0.0 <= value <= 1.0:
            raise ApiError("top_p_decay must be less than or equal to 1.0")
        req.top_p_decay = float(value)
    if "top_p_bound" in body:
        value = body["top_p_bound"]
        if not _is_number(value):
            raise ApiError("top_p_bound must be a positive float less than or equal to top_p")
        if req.top_p == 0.0:
            raise ApiError("top_p_bound cannot be set without top_p")
        if not 0.0 < value <= req.top_p:
            raise ApiError("top_p_bound must be greater than 0 and less than top_p")
        req.top_p_bound = float(value)

    req.add_BOS = _bool_field(body, "add_BOS")
    if any(len(p) == 0 for p in prompts) and not req.add_BOS:
        raise ApiError("Empty prompts require add_BOS=true")
    req.stop_on_double_eol = _bool_field(body, "stop_on_double_eol")
    req.stop_on_eol = _bool_field(body, "stop_on_eol")
    req.prevent_newline_after_colon = _bool_field(body, "prevent_newline_after_colon")
    if "random_seed" in body:
        value = body["random_seed"]
        if not _is_int(value):
            raise ApiError("random_seed must be integer")
        if value < 0:
            raise ApiError("random_seed must be a positive integer")
        if value > MAX_SEED:  # torch.Generator's seeds are 64-bit
            raise ApiError(f"random_seed must be at most 2**64 - 1 ({MAX_SEED})")
        req.random_seed = value
    req.no_log = _bool_field(body, "no_log")
    if "beam_width" in body:
        raise ApiError("beam_width: beam search is not supported by mg-serve; sample instead")
    if "stop_token" in body:
        value = body["stop_token"]
        if not _is_int(value):
            raise ApiError("stop_token must be an integer")
        req.stop_token = value
    if "length_penalty" in body and not isinstance(body["length_penalty"], float):
        raise ApiError("length_penalty must be a float")
    return req


@dataclass
class Limits:
    """What one request may ask of the server."""

    max_positions: int
    """Prompt + generation per sequence (the model's positions, or less)."""
    max_tokens_to_oom: int = 12000
    """Megatron's --max-tokens-to-oom: prompts × (longest prompt + tokens to generate)."""
    max_tokens_to_generate: int | None = None


def _last_id(tokenizer: BaseTokenizer, text: str) -> int | None:
    ids = tokenizer.tokenize(text)
    return ids[-1] if ids else None


def image_prompts(
    body: dict[str, Any],
    req: MegatronRequest,
    tokenizer: BaseTokenizer,
    vision: VisionPrefill | None,
) -> list[ImagePrompt | None] | None:
    """The `images` field (see the module docstring): each prompt with images tokenized
    around them and its images embedded; None when the request has no images."""
    images = body.get("images")
    if images is None:
        if vision is None:
            return None
        images = [None] * len(req.prompts)  # tags without images are still refused
    if not isinstance(images, list) or len(images) != len(req.prompts):
        raise ApiError(
            f"images must be a list with one entry per prompt ({len(req.prompts)}): a base64 "
            "image, a list of them, or null"
        )
    if vision is None and any(entry not in (None, []) for entry in images):
        raise ApiError("images: this model is text-only and takes no images")
    if req.logprobs and any(entry not in (None, []) for entry in images):
        raise ApiError("logprobs: not available for prompts with images")
    out: list[ImagePrompt | None] = []
    for i, (prompt, entry) in enumerate(zip(req.prompts, images, strict=True)):
        entries = [entry] if isinstance(entry, str) else entry or []
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ApiError(f"images[{i}] must be a base64 string, a list of them, or null")
        if not entries and vision is None:
            out.append(None)
            continue
        assert vision is not None
        try:
            decoded = [
                decode_base64_image(data, f"images[{i}][{j}]", vision.max_image_pixels)
                for j, data in enumerate(entries)
            ]
            out.append(vision.prompt(prompt, decoded, tokenizer.tokenize, f"prompts[{i}]"))
        except ImageInputError as err:
            raise ApiError(str(err)) from None
    return out


def build_jobs(
    req: MegatronRequest,
    tokenizer: BaseTokenizer,
    limits: Limits,
    with_images: list[ImagePrompt | None] | None = None,
) -> list[tuple[list[int], SamplingParams]]:
    """Tokenize the prompts and turn the fields into one engine request per prompt
    (`with_images`: prompts already tokenized around their images)."""
    eod = tokenizer.eod
    if req.add_BOS and (eod is None or eod < 0):
        raise ApiError("add_BOS: this tokenizer has no end-of-document token to use as BOS")
    with_images = with_images or [None] * len(req.prompts)
    prompts = [
        ([eod] if req.add_BOS else []) + (tokenizer.tokenize(p) if m is None else m.ids)
        for p, m in zip(req.prompts, with_images, strict=True)
    ]
    if limits.max_tokens_to_generate is not None and (
        req.tokens_to_generate > limits.max_tokens_to_generate
    ):
        raise ApiError(
            f"tokens_to_generate must be at most {limits.max_tokens_to_generate} on this server"
        )
    max_len = max(len(p) for p in prompts) + req.tokens_to_generate
    if max_len > limits.max_positions:
        raise ApiError("Length of prompt + tokens_to_generate longer than allowed")
    if max_len * len(prompts) > limits.max_tokens_to_oom:
        raise ApiError(
            f"Too many tokens.  {max_len * len(prompts)} is greater than {limits.max_tokens_to_oom}"
        )
    if req.stop_token is not None and not 0 <= req.stop_token < tokenizer.vocab_size:
        raise ApiError(
            f"stop_token must be a token id of this tokenizer (0..{tokenizer.vocab_size - 1}), "
            f"not {req.stop_token}"
        )
    stop_ids = {req.stop_token} if req.stop_token is not None else set()
    if eod is not None and eod >= 0 and req.stop_token is None:
        stop_ids.add(eod)
    stop_strings: tuple[str, ...] = ()
    if req.stop_on_double_eol:
        stop_strings = ("\n\n",)
    elif req.stop_on_eol:
        stop_strings = ("\n",)
    banned: tuple[tuple[int, int], ...] = ()
    if req.prevent_newline_after_colon:
        colon, newline = _last_id(tokenizer, ":"), _last_id(tokenizer, "\n")
        if colon is not None and newline is not None:
            banned = ((colon, newline),)
    jobs = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_new_tokens=req.tokens_to_generate,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            top_p_decay=req.top_p_decay,
            top_p_bound=req.top_p_bound,
            seed=choice_seed(req.random_seed, i) if req.random_seed >= 0 else None,
            stop_token_ids=frozenset(stop_ids),
            stop_strings=stop_strings,
            banned_after=banned,
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs,
        )
        jobs.append((prompt, params))
    return jobs


def megatron_response(
    completions: list[Completion],
    tokenizer: BaseTokenizer,
    logprobs: bool,
    with_images: list[ImagePrompt | None] | None = None,
) -> dict[str, Any]:
    """Megatron's response: whole texts, their token strings, and optional log-probs (a
    prompt with images is shown with `<image>` where its image rows were)."""
    with_images = with_images or [None] * len(completions)
    sequences = [
        (c.prompt if m is None or m.rows is None else _shown(c.prompt, m)) + c.tokens
        for c, m in zip(completions, with_images, strict=True)
    ]
    return {
        "text": [tokenizer.detokenize(s) for s in sequences],
        "segments": [[tokenizer.id_to_token(t) for t in s] for s in sequences],
        "logprobs": [(c.prompt_logprobs or []) + c.logprobs for c in completions]
        if logprobs
        else None,
    }


def _shown(prompt: list[int], image_prompt: ImagePrompt) -> list[int]:
    """The prompt's ids with its image rows shown as the `<image>` text (a BOS in front kept)."""
    extra = len(prompt) - len(image_prompt.ids)
    return prompt[:extra] + image_prompt.display_ids
