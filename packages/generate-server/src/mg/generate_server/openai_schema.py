"""Request bodies of the OpenAI-compatible endpoints (what the `openai` package sends).

Field names, ranges and defaults are OpenAI's; `top_k` is an extension (as in
vLLM and Megatron's own `/completions`), sent with `extra_body={"top_k": 40}`.
Unknown fields are ignored, as OpenAI-compatible servers do. Types are strict
(pydantic's strict mode): `true` is no number, `"16"` and `16.0` are no token
count, `1` is no boolean, so a mistyped field is a 400 naming it, never a
silent 1 (Python's bool is an int); an integer is still a valid float.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4
MAX_SEED = 2**64 - 1  # torch.Generator's seeds are unsigned 64-bit (sampling.MAX_SEED)
PROMPT_SHAPES = "text, a list of texts, a list of token ids, or a list of lists of token ids"


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1000, description="extension: sample from the k most likely")
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check_stop(self) -> SamplingFields:
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias: keys are token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key}]: bias must be within [-100, 100]")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, texts, token ids, or lists of token ids"
    )
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=16)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: object) -> object:
        """One message for every wrong shape (the union's own names one error per member)."""
        if isinstance(value, str) or value == []:
            return value
        if isinstance(value, list) and (
            all(isinstance(p, str) for p in value)
            or all(_is_token_id(p) for p in value)
            or all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in value)
        ):
            return value
        raise ValueError(f"must be {PROMPT_SHAPES} (token ids are integers, not true/false)")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: insertion (suffix) is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of equal to n is supported (no reranking)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be an empty list")
        return self


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    """One part of a message's content: `text`, or an `image_url` (a data: URL)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
