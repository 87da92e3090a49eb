"""The HTTP server: Megatron's `PUT /api`, the OpenAI endpoints, /health, /metrics, OpenAPI.

Every failure a client can cause is a 4xx with a message, never a traceback:
bad JSON and schema violations are 400 (not FastAPI's 422), a body over
--max-request-bytes is 413, a missing/wrong bearer token 401, a full queue
503, a request past --request-timeout 504. Errors of `/api` are
`{"message": …}` (what Megatron's client prints); errors of `/v1/…` are
OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mg.core.tokenizers import BaseTokenizer
from mg.generate_server import __version__
from mg.generate_server.async_bridge import (
    AsyncGeneration,
    ClientGone,
    GenerationFailed,
    GenerationTimeout,
    cancel_all,
    collect,
    submit_all,
    unless_disconnected,
)
from mg.generate_server.chat import ChatTemplate
from mg.generate_server.engine import EngineFullError, GenerationEngine
from mg.generate_server.errors import ApiError
from mg.generate_server.megatron_api import (
    Limits,
    build_jobs,
    image_prompts,
    megatron_response,
    parse_megatron_request,
)
from mg.generate_server.metrics import CONTENT_TYPE, ServerMetrics
from mg.generate_server.openai_api import OpenAIService
from mg.generate_server.openai_schema import ChatCompletionRequest, CompletionRequest
from mg.generate_server.vision_prefill import VisionPrefill

log = logging.getLogger("mg.generate_server")
T = TypeVar("T")


@dataclass
class ServerSettings:
    limits: Limits
    max_request_bytes: int = 1 << 20
    request_body_timeout: float = 30.0
    """Seconds to receive a request's whole body; a client that sends slower gets a 408."""
    request_timeout: float | None = 300.0
    api_key: str | None = None
    vision: VisionPrefill | None = None
    """A vision-language checkpoint's image path; None: text only (images refused)."""


class MegatronApiBody(BaseModel):
    """`PUT /api` fields (REFERENCE §5); documents the body, which is validated by hand
    with Megatron's own messages."""

    prompts: list[str] = Field(..., min_length=1, max_length=128)
    tokens_to_generate: int = Field(64, ge=0)
    logprobs: bool = False
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    top_k: int = Field(0, ge=0, le=1000)
    top_p: float = Field(0.0, ge=0.0, le=1.0)
    top_p_decay: float = Field(0.0, ge=0.0, le=1.0)
    top_p_bound: float = Field(0.0, ge=0.0, le=1.0)
    add_BOS: bool = False  # noqa: N815 - Megatron's field name
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False
    random_seed: int = Field(-1, ge=-1, le=2**64 - 1)
    no_log: bool = False
    stop_token: int | None = Field(None, ge=0)
    images: list[str | list[str] | None] | None = Field(
        None,
        description="mg's extension (a vision-language model): per prompt, a base64 image, "
        "a list of them, or null; placed at the prompt's <image> tags, else at its start",
    )


class MegatronApiResponse(BaseModel):
    text: list[str]
    segments: list[list[str]]
    logprobs: list[list[float]] | None


def _is_openai(path: str) -> bool:
    return path.startswith("/v1/")


_NUMBER_ERRORS = {"int_type": "must be an integer", "float_type": "must be a number"}
"""pydantic's strict type errors that a JSON true/false gets where a number belongs."""

RETRY_AFTER_SECONDS = 1
"""What a 503 (full queue) tells the client to wait before it tries again."""


def _error(path: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    if _is_openai(path):
        kind = "invalid_request_error" if status < 500 else "server_error"
        body: dict[str, Any] = {
            "error": {"message": message, "type": kind, "param": param, "code": None}
        }
    else:
        body = {"message": message}
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


class AdmittedStream(StreamingResponse):
    """A streamed answer whose sequences were admitted before its status line: however the
    response ends (finished, client gone, the status line never sent), the sequences
    still in the engine are cancelled."""

    def __init__(self, content: AsyncIterator[str], generations: list[AsyncGeneration]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cancel_all(self.generations)


async def _answer(request: Request, generations: list[AsyncGeneration], work: Awaitable[T]) -> T:
    """A non-streamed answer of admitted sequences; they leave the engine if the client
    goes or anything fails."""
    try:
        return await unless_disconnected(request, work)
    finally:
        cancel_all(generations)


CLIENT_GONE = "mg.client_gone"  # scope key: an asyncio.Event set when the client hangs up


class _BodyTooLarge(Exception):
    pass


class _BodyTooSlow(Exception):
    pass


class BodyLimitMiddleware:
    """413 for bodies over the limit, whether or not Content-Length says so up front; 408
    for a body that does not arrive within `body_timeout` seconds (a slow client holds
    a connection and a worker otherwise)."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        too_large = _error(
            scope["path"], 413, f"request body is larger than {self.max_bytes} bytes"
        )
        too_slow = _error(
            scope["path"], 408, f"request body not received within {self.body_timeout:g} s"
        )
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        seen = 0
        started = False
        # Once the body is read, one task owns `receive` and waits for the disconnect: it
        # sets scope[CLIENT_GONE] (non-streaming handlers poll it) and answers the app's
        # later receives (a streaming response's disconnect listener) with that message.
        gone = scope.setdefault(CLIENT_GONE, asyncio.Event())
        watcher: asyncio.Task[Message] | None = None

        async def watch() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            return message

        async def counted_receive() -> Message:
            nonlocal seen, watcher
            if watcher is not None:
                return await asyncio.shield(watcher)
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise _BodyTooSlow from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
                if not message.get("more_body", False):
                    watcher = asyncio.ensure_future(watch())
            elif message["type"] == "http.disconnect":
                gone.set()
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await too_large(scope, receive, send)
        except _BodyTooSlow:
            if not started:
                await too_slow(scope, receive, send)
        finally:
            if watcher is not None:
                watcher.cancel()


class AuthAndMetricsMiddleware:
    """The bearer-token check (401), the request counter and time-to-response-start per
    route, and a 500 with a message for an unhandled error, as a plain ASGI layer: a
    streamed response's chunks pass straight through. (Starlette's `BaseHTTPMiddleware`
    relays each chunk through a memory stream and a task switch; with 32 clients
    streaming that was most of the HTTP side's time per token, taken from the cores
    the model runs on.)"""

    OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        started = time.monotonic()
        if self.expected is not None and path not in self.OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.metrics.requests.labels(path, "401").inc()
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                await _error(path, 401, message)(scope, receive, send)
                return
        responded = False

        async def observed_send(message: Message) -> None:
            nonlocal responded
            if message["type"] == "http.response.start":
                responded = True
                endpoint = getattr(scope.get("route"), "path", "other")
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
                self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        except Exception as exc:  # last resort: a 500 with a message, the server stays up
            log.exception("unhandled error on %s", path)
            if responded:  # the status line is out: nothing more to tell this client
                return
            error = _error(path, 500, f"internal error: {type(exc).__name__}: {exc}")
            await error(scope, receive, observed_send)


def create_app(
    engine: GenerationEngine,
    tokenizer: BaseTokenizer,
    model_name: str,
    settings: ServerSettings,
    chat_template: ChatTemplate | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`; run it with uvicorn."""
    app = FastAPI(
        title="mg-serve",
        version=__version__,
        description="Text generation: Megatron-LM's PUT /api and OpenAI-compatible endpoints.",
    )
    metrics = ServerMetrics(engine)
    openai = OpenAIService(
        engine,
        tokenizer,
        settings.limits,
        model_name,
        settings.request_timeout,
        chat_template,
        settings.vision,
    )
    app.state.engine = engine
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_bytes,
        body_timeout=settings.request_body_timeout,
    )
    app.add_middleware(AuthAndMetricsMiddleware, api_key=settings.api_key, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        field = ".".join(location) or None
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if isinstance(first.get("input"), bool) and first.get("type") in _NUMBER_ERRORS:
            message = f"{_NUMBER_ERRORS[first['type']]}, not {json.dumps(first['input'])}"
        if first.get("type") == "json_invalid":
            field = None
            message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        return _error(request.url.path, 400, f"{field}: {message}" if field else message, field)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(request.url.path, exc.status, exc.message, exc.param)

    @app.exception_handler(EngineFullError)
    async def on_full(request: Request, exc: EngineFullError) -> JSONResponse:
        return _error(request.url.path, 503, str(exc))

    @app.exception_handler(GenerationTimeout)
    async def on_timeout(request: Request, exc: GenerationTimeout) -> JSONResponse:
        return _error(
            request.url.path,
            504,
            f"generation took longer than the server's --request-timeout "
            f"({settings.request_timeout} s)",
        )

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(GenerationFailed)
    async def on_failed(request: Request, exc: GenerationFailed) -> JSONResponse:
        return _error(request.url.path, 500, f"generation failed: {exc}")

    @app.put(
        "/api",
        response_model=MegatronApiResponse,
        summary="Megatron-LM text generation",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": MegatronApiBody.model_json_schema()}},
            }
        },
        responses={400: {"description": "invalid request; body {'message': ...}"}},
    )
    async def megatron_generate(request: Request) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ApiError("request body is nested too deeply to be a request") from None
        req = parse_megatron_request(body)
        if settings.vision is None:
            with_images = image_prompts(body, req, tokenizer, None)
        else:  # decoding and the vision tower off the event loop
            with_images = await asyncio.to_thread(
                image_prompts, body, req, tokenizer, settings.vision
            )
        jobs = build_jobs(req, tokenizer, settings.limits, with_images)
        if not req.no_log:
            host = request.client.host if request.client else "?"
            log.info(
                "PUT /api from %s: %d prompt(s), tokens_to_generate=%d",
                host,
                len(req.prompts),
                req.tokens_to_generate,
            )
        rows = None
        if with_images:  # a BOS put in front (add_BOS) moves the image rows by one
            bos = int(req.add_BOS)
            rows = [m.rows.shifted(bos) if m and m.rows else None for m in with_images]
        generations = submit_all(engine, jobs, settings.request_timeout, rows)  # or a 503 now
        runs = asyncio.gather(*(collect(g) for g in generations))
        completions = await _answer(request, generations, runs)
        return megatron_response(list(completions), tokenizer, req.logprobs, with_images)

    @app.post("/v1/completions", summary="OpenAI-compatible text completion")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        jobs = openai.completion_jobs(req)
        generations = openai.admit(jobs)  # a full queue is a 503 here, before any 200
        if req.stream:
            stream = openai.stream_completions(req, jobs, generations)
            return AdmittedStream(stream, generations)
        return await _answer(request, generations, openai.completions(req, jobs, generations))

    if chat_template is not None:

        @app.post("/v1/chat/completions", summary="OpenAI-compatible chat completion")
        async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
            if settings.vision is None:
                jobs = openai.chat_jobs(req)
            else:  # decoding and the vision tower off the event loop
                jobs = await asyncio.to_thread(openai.chat_jobs, req)
            generations = openai.admit(jobs)  # a full queue is a 503 here, before any 200
            if req.stream:
                return AdmittedStream(openai.stream_chat(req, jobs, generations), generations)
            return await _answer(request, generations, openai.chat(req, jobs, generations))

    @app.get("/v1/models", summary="The served model")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "mg"}],
        }

    @app.get("/health", summary="Liveness and load")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_name,
            "active": engine.num_active,
            "waiting": engine.num_waiting,
        }

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
