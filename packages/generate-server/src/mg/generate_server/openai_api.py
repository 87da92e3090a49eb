"""`POST /v1/completions` and `POST /v1/chat/completions`, plain and streamed (SSE).

OpenAI semantics: temperature 0 is greedy, top_p 1 is no filtering, the
end-of-document token and stop strings end a choice with finish_reason
"stop" and are not part of its text, `n` choices per prompt (choice index
= prompt index · n + j), `seed` (+ the choice index, modulo 2**64) makes
sampling repeatable, `echo` puts the prompt in front, `logprobs` reports each token's
log-probability and the most likely alternatives.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mg.core.tokenizers import BaseTokenizer
from mg.generate_server.async_bridge import (
    AsyncGeneration,
    Completion,
    GenerationFailed,
    GenerationTimeout,
    collect,
    submit_all,
)
from mg.generate_server.chat import ChatTemplate
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.errors import ApiError
from mg.generate_server.megatron_api import Limits
from mg.generate_server.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from mg.generate_server.sampling import SamplingParams, choice_seed
from mg.generate_server.text_stream import TextStream
from mg.generate_server.vision_prefill import (
    IMAGE_TAG,
    ImageInputError,
    ImageRows,
    VisionPrefill,
    decode_image_url,
)

log = logging.getLogger("mg.generate_server")


@dataclass
class _Job:
    index: int
    prompt: list[int]
    params: SamplingParams
    images: ImageRows | None = None


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class OpenAIService:
    """Turns OpenAI requests into engine requests and engine output into OpenAI responses."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: BaseTokenizer,
        limits: Limits,
        model_name: str,
        timeout: float | None,
        chat_template: ChatTemplate | None,
        vision: VisionPrefill | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        self.timeout = timeout
        self.chat_template = chat_template
        self.vision = vision
        eod = tokenizer.eod
        self.stop_ids = frozenset([eod]) if eod is not None and eod >= 0 else frozenset()

    # --- requests to engine jobs --------------------------------------------

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            texts: list[str] | None = [prompt]
        elif all(isinstance(p, str) for p in prompt):
            texts = list(prompt)  # type: ignore[arg-type]
        else:
            texts = None
        if texts is not None:
            return [self._tokenize(t) for t in texts]
        lists = [prompt] if all(isinstance(p, int) for p in prompt) else prompt
        out = []
        for ids in lists:
            if not ids:
                raise ApiError("prompt: a token-id prompt must not be empty")
            bad = [i for i in ids if not 0 <= i < self.tokenizer.vocab_size]  # type: ignore[operator]
            if bad:
                raise ApiError(
                    f"prompt: token id {bad[0]} is outside the vocabulary "
                    f"(0..{self.tokenizer.vocab_size - 1})"
                )
            out.append(list(ids))  # type: ignore[arg-type]
        return out

    def _tokenize(self, text: str) -> list[int]:
        ids = self.tokenizer.tokenize(text)
        if not ids:
            if not self.stop_ids:
                raise ApiError("prompt: empty, and this tokenizer has no end-of-document token")
            ids = [next(iter(self.stop_ids))]  # an empty prompt starts a new document
        return ids

    def _max_tokens(self, requested: int | None, prompt: list[int]) -> int:
        room = self.limits.max_positions - len(prompt)
        max_tokens = room if requested is None else requested
        cap = self.limits.max_tokens_to_generate
        if cap is not None and max_tokens > cap:
            if requested is None:
                max_tokens = cap
            else:
                raise ApiError(f"max_tokens: at most {cap} on this server", param="max_tokens")
        if max_tokens > room:
            raise ApiError(
                f"This model's maximum context length is {self.limits.max_positions} tokens. "
                f"However, you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in "
                f"your prompt; {max_tokens} for the completion). Please reduce your prompt or "
                "completion length.",
                param="max_tokens",
            )
        return max_tokens

    def _params(
        self,
        req: SamplingFields,
        max_tokens: int,
        index: int,
        logprobs: bool,
        top_logprobs: int,
        prompt_logprobs: bool,
    ) -> SamplingParams:
        for key in req.logit_bias or {}:
            if int(key) >= self.tokenizer.vocab_size:
                raise ApiError(f"logit_bias: token id {key} is outside the vocabulary")
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=req.temperature if req.temperature > 0 else 1.0,
            greedy=req.temperature == 0,
            top_k=req.top_k,
            top_p=req.top_p if req.top_p < 1.0 else 0.0,
            seed=None if req.seed is None else choice_seed(req.seed, index),
            stop_token_ids=self.stop_ids,
            stop_strings=tuple(req.stop_strings()),
            logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _check_size(self, jobs: list[_Job]) -> None:
        total = sum(len(j.prompt) + j.params.max_new_tokens for j in jobs)
        if total > self.limits.max_tokens_to_oom:
            raise ApiError(
                f"this request needs {total} tokens (prompts + completions, all choices); "
                f"the server allows {self.limits.max_tokens_to_oom} per request"
            )

    # --- running jobs ---------------------------------------------------------

    def admit(self, jobs: list[_Job]) -> list[AsyncGeneration]:
        """Queue every job of a request in the engine, before any answer is sent: a full
        queue is a 503, not a 200 stream that breaks off (EngineFullError)."""
        requests = [(job.prompt, job.params) for job in jobs]
        images = [job.images for job in jobs]
        return submit_all(self.engine, requests, self.timeout, images)

    async def _run_all(self, generations: list[AsyncGeneration]) -> list[Completion]:
        tasks = [asyncio.ensure_future(collect(g)) for g in generations]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _stream_all(
        self, jobs: list[_Job], generations: list[AsyncGeneration]
    ) -> AsyncIterator[tuple[_Job, Completion, str, str | None, Completion | None]]:
        """(job, completion so far, new text, finish reason, the event's own token) as tokens
        arrive, all jobs merged. The token (with its log-probabilities) is taken when its
        event arrives: the completion so far may have grown by the time it is read. None for
        an event that only finishes, a stop token, or a request without log-probabilities."""
        queue: asyncio.Queue[
            tuple[_Job, Completion, str, str | None, Completion | None] | Exception
        ] = asyncio.Queue()

        async def run(job: _Job, gen: AsyncGeneration) -> None:
            result = Completion(prompt=job.prompt)
            text = TextStream(self.tokenizer.detokenize, job.params.stop_strings)
            try:
                async for event in gen.events():
                    result.add(event)
                    delta, new = "", None
                    if event.choice is not None and event.choice.token not in self.stop_ids:
                        delta = text.push([event.choice.token])
                        if job.params.reports_logprobs:
                            new = _last_only(result)
                    finish = None
                    if event.finish_reason is not None:
                        delta += text.finish()
                        finish = "stop" if text.stopped else _finish_reason(event.finish_reason)
                    elif text.stopped:
                        finish = "stop"
                    if delta or finish or event.choice is not None:
                        await queue.put((job, result, delta, finish, new))
                    if finish:
                        return
            except Exception as exc:  # surfaces in the stream as an error event
                await queue.put(exc)

        tasks = [
            asyncio.ensure_future(run(job, gen)) for job, gen in zip(jobs, generations, strict=True)
        ]
        try:
            pending = len(jobs)
            while pending:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item[3] is not None:
                    pending -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()

    # --- /v1/completions --------------------------------------------------------

    def completion_jobs(self, req: CompletionRequest) -> list[_Job]:
        jobs = []
        for p, prompt in enumerate(self._prompts(req)):
            max_tokens = self._max_tokens(req.max_tokens, prompt)
            for j in range(req.n):
                index = p * req.n + j
                params = self._params(
                    req,
                    max_tokens,
                    index,
                    logprobs=req.logprobs is not None,  # logprobs=0 still asks for them
                    top_logprobs=req.logprobs or 0,
                    prompt_logprobs=req.echo and req.logprobs is not None,
                )
                jobs.append(_Job(index, prompt, params))
        self._check_size(jobs)
        return jobs

    async def completions(
        self, req: CompletionRequest, jobs: list[_Job], generations: list[AsyncGeneration]
    ) -> dict[str, Any]:
        completions = await self._run_all(generations)
        choices = []
        for job, result in zip(jobs, completions, strict=True):
            text, finish, tokens = self._final_text(result, job.params)
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(result, tokens, req.echo)
            if req.echo:
                text = self.tokenizer.detokenize(result.prompt) + text
            choices.append(
                {"text": text, "index": job.index, "logprobs": logprobs, "finish_reason": finish}
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(jobs, completions, req.n),
        }

    async def stream_completions(
        self, req: CompletionRequest, jobs: list[_Job], generations: list[AsyncGeneration]
    ) -> AsyncIterator[str]:
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        echoed: set[int] = set()
        results: dict[int, Completion] = {}

        def chunk(choice: dict[str, Any]) -> str:
            return _sse({**head, "choices": [choice]})

        try:
            async for job, result, delta, finish, new in self._stream_all(jobs, generations):
                results[job.index] = result
                if req.echo and job.index not in echoed:
                    echoed.add(job.index)
                    delta = self.tokenizer.detokenize(job.prompt) + delta
                logprobs = None
                if req.logprobs is not None and new is not None:
                    logprobs = self._completion_logprobs(new, new.tokens, echo=False)
                choice = {"text": delta, "index": job.index, "logprobs": logprobs}
                yield chunk({**choice, "finish_reason": finish})
            if req.stream_options is not None and req.stream_options.include_usage:
                done = [results[j.index] for j in jobs]
                yield _sse({**head, "choices": [], "usage": _usage(jobs, done, req.n)})
        except Exception as exc:  # the status line is out: end with an error event
            yield _sse(_stream_error(exc))
        yield _sse("[DONE]")

    def _final_text(self, result: Completion, params: SamplingParams) -> tuple[str, str, list[int]]:
        """The choice's text, finish reason, and the tokens it is made of."""
        tokens = list(result.tokens)
        finish = _finish_reason(result.finish_reason)
        if tokens and tokens[-1] in self.stop_ids and finish == "stop":
            tokens = tokens[:-1]
        stream = TextStream(self.tokenizer.detokenize, params.stop_strings)
        text = stream.push(tokens) + stream.finish()
        if stream.stopped:
            finish = "stop"
        return text, finish, tokens

    def _completion_logprobs(
        self, result: Completion, tokens: list[int], echo: bool
    ) -> dict[str, Any]:
        piece = self._piece
        ids: list[int] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        if echo:
            ids += result.prompt
            token_logprobs += [None] + list(result.prompt_logprobs or [])
            top += [None] * len(result.prompt)
        n = len(tokens)
        ids += tokens
        token_logprobs += result.logprobs[:n]
        top += [{piece(t): lp for t, lp in alts} for alts in result.top_logprobs[:n]]
        strings = [piece(t) for t in ids]
        offsets, offset = [], 0
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": strings,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _piece(self, token: int) -> str:
        return self.tokenizer.detokenize([token])

    # --- /v1/chat/completions ----------------------------------------------------

    def chat_jobs(self, req: ChatCompletionRequest) -> list[_Job]:
        if self.chat_template is None:
            raise ApiError(
                "this model's tokenizer has no chat template; use /v1/completions",
                status=404,
            )
        messages, images = self._chat_messages(req)
        try:
            text = self.chat_template.render(messages)
        except ValueError as exc:
            raise ApiError(f"messages: {exc}", param="messages") from None
        rows = None
        if self.vision is None:
            prompt = self.chat_template.tokenize(self.tokenizer, text)
        else:
            template, tokenizer = self.chat_template, self.tokenizer
            try:
                image_prompt = self.vision.prompt(
                    text,
                    images,
                    lambda piece: template.tokenize(tokenizer, piece),
                    "messages",
                    tokenizer.bos,
                )
            except ImageInputError as err:
                raise ApiError(str(err), param="messages") from None
            prompt, rows = image_prompt.ids, image_prompt.rows
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else None
        requested = req.max_tokens if requested is None else requested
        max_tokens = self._max_tokens(requested, prompt)
        top = req.top_logprobs or 0 if req.logprobs else 0
        jobs = [
            _Job(
                j,
                prompt,
                self._params(req, max_tokens, j, req.logprobs, top, prompt_logprobs=False),
                rows,
            )
            for j in range(req.n)
        ]
        self._check_size(jobs)
        return jobs

    def _chat_messages(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list]:
        """The messages as the template reads them (content as text, each image part an
        `<image>` tag where it stands) and the images decoded, in that order."""
        messages: list[dict[str, Any]] = []
        images: list = []
        for i, message in enumerate(req.messages):
            content = message.content
            if isinstance(content, list):
                pieces = []
                for j, part in enumerate(content):
                    field = f"messages[{i}].content[{j}]"
                    if part.type == "text":
                        pieces.append(part.text or "")
                        continue
                    if part.image_url is None:
                        raise ApiError(f"{field}.image_url: required for an image_url part")
                    if self.vision is None:
                        raise ApiError(
                            f"{field}: this model is text-only and takes no images",
                            param="messages",
                        )
                    try:
                        images.append(
                            decode_image_url(
                                part.image_url.url,
                                f"{field}.image_url.url",
                                self.vision.max_image_pixels,
                            )
                        )
                    except ImageInputError as err:
                        raise ApiError(str(err), param="messages") from None
                    pieces.append(IMAGE_TAG)
                content = "".join(pieces)
            messages.append({"role": message.role, "content": content})
        return messages, images

    async def chat(
        self, req: ChatCompletionRequest, jobs: list[_Job], generations: list[AsyncGeneration]
    ) -> dict[str, Any]:
        completions = await self._run_all(generations)
        choices = []
        for job, result in zip(jobs, completions, strict=True):
            text, finish, tokens = self._final_text(result, job.params)
            logprobs = self._chat_logprobs(result, tokens) if req.logprobs else None
            choices.append(
                {
                    "index": job.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(jobs, completions, req.n),
        }

    async def stream_chat(
        self, req: ChatCompletionRequest, jobs: list[_Job], generations: list[AsyncGeneration]
    ) -> AsyncIterator[str]:
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
        }
        results: dict[int, Completion] = {}
        for job in jobs:
            choice = {"index": job.index, "delta": {"role": "assistant", "content": ""}}
            yield _sse({**head, "choices": [{**choice, "logprobs": None, "finish_reason": None}]})
        try:
            async for job, result, delta, finish, new in self._stream_all(jobs, generations):
                results[job.index] = result
                logprobs = None
                if req.logprobs and new is not None:
                    logprobs = self._chat_logprobs(new, new.tokens)
                choice = {
                    "index": job.index,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
                yield _sse({**head, "choices": [choice]})
            if req.stream_options is not None and req.stream_options.include_usage:
                done = [results[j.index] for j in jobs]
                yield _sse({**head, "choices": [], "usage": _usage(jobs, done, req.n)})
        except Exception as exc:  # the status line is out: end with an error event
            yield _sse(_stream_error(exc))
        yield _sse("[DONE]")

    def _chat_logprobs(self, result: Completion, tokens: list[int]) -> dict[str, Any]:
        def entry(token: int, logprob: float | None) -> dict[str, Any]:
            text = self._piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, logprob, alts in zip(tokens, result.logprobs, result.top_logprobs, strict=False):
            content.append(
                {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in alts]}
            )
        return {"content": content}


def _last_only(result: Completion) -> Completion:
    return Completion(
        prompt=result.prompt,
        tokens=result.tokens[-1:],
        logprobs=result.logprobs[-1:],
        top_logprobs=result.top_logprobs[-1:],
    )


def _finish_reason(engine_reason: str) -> str:
    return "stop" if engine_reason == "stop" else "length"


def _usage(jobs: list[_Job], completions: list[Completion], n: int) -> dict[str, int]:
    prompt_tokens = sum(len(job.prompt) for job in jobs) // max(n, 1)
    completion_tokens = sum(len(c.tokens) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _stream_error(exc: Exception) -> dict[str, Any]:
    """The event that ends a stream which cannot finish: what the `openai` client raises as
    an APIError (a body that just stops reads as a network fault, or as a short answer)."""
    if isinstance(exc, GenerationTimeout):
        message, kind = "generation took longer than the server's --request-timeout", "timeout"
    elif isinstance(exc, GenerationFailed):
        message, kind = f"generation failed: {exc}", "server_error"
    else:
        log.exception("streamed answer failed")
        message, kind = f"internal error: {type(exc).__name__}: {exc}", "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
