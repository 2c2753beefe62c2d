"""FastAPI app: routes, authentication, body limits and OpenAI-shaped errors.

Routes: /v1/completions, /v1/chat/completions (both with ``stream``), /v1/models, /health,
/metrics. Every error is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status
for bad input; a bug in the server is the only source of a 500.
"""

from __future__ import annotations

import secrets
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from leapfrog.engine.async_engine import AsyncEngine
from leapfrog.engine.engine import LLMEngine
from leapfrog.entrypoints.openai.metrics import ServerMetrics
from leapfrog.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from leapfrog.entrypoints.openai.serving import APIError, OpenAIServing, sse, usage

MAX_BODY_BYTES = 4 * 1024 * 1024


def error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type_, param, code).body(), status_code=status)


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None,
              max_waiting: int = 256) -> FastAPI:
    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = ServerMetrics(served_model_name)
    async_engine.on_finished = metrics.request_finished
    serving = OpenAIServing(async_engine, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()  # SIGTERM/SIGINT via uvicorn: in-flight requests end as "abort"

    app = FastAPI(title="leapfrog", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.metrics = metrics

    @app.middleware("http")
    async def guard(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            return error(413, f"request body larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
        if api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), api_key.encode()):
                return error(401, "invalid or missing API key (Authorization: Bearer ...)",
                             type_="authentication_error", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error(400, f"invalid JSON body: {msg}", code="invalid_json")
        return error(400, f"{'.'.join(loc) or 'body'}: {msg}", param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, str(e.detail), type_=kind)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "leapfrog", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        kv = engine.kv
        metrics.set_engine_state(len(engine.scheduler.running), async_engine.num_waiting,
                                 kv.used_tokens() / kv.token_budget)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def head(prefix: str, obj: str) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": served_model_name}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        serving.check_model(req.model)
        sp = serving.sampling_params(req, req.max_tokens if req.max_tokens is not None else 16)
        k = serving.spec_tokens(req)
        prompts = serving.completion_prompts(req)
        top = head("cmpl", "text_completion")
        if req.stream:
            return await _streaming(serving.stream_all(prompts, sp, k), top, sp.n, req.stream_options,
                                    lambda text, out: {"index": 0, "text": text, "logprobs": None,
                                                       "finish_reason": out.outputs[0].finish_reason
                                                       if out.finished else None})
        outs = await serving.run_all(prompts, sp, k)
        choices = [{"index": i, "text": (o.prompt or "") + o.outputs[0].text if req.echo else o.outputs[0].text,
                    "logprobs": None, "finish_reason": o.outputs[0].finish_reason,
                    "stop_reason": o.outputs[0].stop_reason} for i, o in enumerate(outs)]
        return {**top, "choices": choices, "usage": usage(outs, sp.n)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        serving.check_model(req.model)
        max_tokens = req.max_completion_tokens or req.max_tokens
        sp = serving.sampling_params(req, max_tokens)
        k = serving.spec_tokens(req)
        prompt = serving.chat_prompt(req)
        top = head("chatcmpl", "chat.completion")
        if req.stream:
            return await _streaming(serving.stream_all([prompt], sp, k), {**top, "object": "chat.completion.chunk"},
                                    sp.n, req.stream_options,
                                    lambda text, out: {"index": 0, "delta": {"content": text} if text else {},
                                                       "logprobs": None,
                                                       "finish_reason": out.outputs[0].finish_reason
                                                       if out.finished else None},
                                    first_delta={"role": "assistant", "content": ""})
        outs = await serving.run_all([prompt], sp, k)
        choices = [{"index": i, "message": {"role": "assistant", "content": o.outputs[0].text},
                    "logprobs": None, "finish_reason": o.outputs[0].finish_reason,
                    "stop_reason": o.outputs[0].stop_reason} for i, o in enumerate(outs)]
        return {**top, "choices": choices, "usage": usage(outs, sp.n)}

    return app


async def _streaming(events, head: dict, n: int, stream_options: StreamOptions | None, make_choice,
                     first_delta: dict | None = None):
    """Start the stream (so request errors still become JSON errors), then serve SSE chunks."""
    include_usage = bool(stream_options and stream_options.include_usage)
    it = events.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = None

    async def body():
        finals: dict[int, object] = {}
        try:
            if first_delta is not None:
                for i in range(n):
                    yield sse({**head, "choices": [{"index": i, "delta": first_delta, "logprobs": None,
                                                    "finish_reason": None}]})
            ev = first
            while ev is not None:
                idx, out, text, _ = ev
                if text or out.finished:
                    choice = make_choice(text, out)
                    choice["index"] = idx
                    yield sse({**head, "choices": [choice]})
                if out.finished:
                    finals[idx] = out
                try:
                    ev = await it.__anext__()
                except StopAsyncIteration:
                    ev = None
            if include_usage:
                outs = [finals[i] for i in sorted(finals)]
                yield sse({**head, "choices": [], "usage": usage(outs, n)})
            yield sse("[DONE]")
        finally:
            await it.aclose()  # client gone: the requests are aborted and their KV freed

    return StreamingResponse(body(), media_type="text/event-stream")
