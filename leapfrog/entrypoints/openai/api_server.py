"""FastAPI app: routes, authentication, body limits and OpenAI-shaped errors.

Routes: /v1/completions, /v1/chat/completions (both with ``stream``), /v1/models,
/tokenize, /detokenize, /version, /health, /metrics. Every error is
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad input; a bug in
the server is the only source of a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

import uvicorn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leapfrog.engine.async_engine import AsyncEngine, EngineStopped
from leapfrog.engine.engine import LLMEngine
from leapfrog.entrypoints.openai.metrics import ServerMetrics
from leapfrog import __version__
from leapfrog.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  StreamOptions, TokenizeRequest, text_chars)
from leapfrog.entrypoints.openai.serving import (APIError, ClientDisconnected, OpenAIServing, chat_logprobs,
                                                 completion_logprobs, failure, prompt_logprobs_json, sse, usage)
from leapfrog.outputs import RequestOutput

MAX_BODY_BYTES = 4 * 1024 * 1024
#: seconds a request's body may go without a byte arriving (as nginx's client_body_timeout, 60 s
#: there): a client that sends its headers and stalls gets a 408 and the connection closes, not a
#: coroutine held open for good. Per part, no total deadline: an upload that keeps coming is read
#: (4 MiB at most, MAX_BODY_BYTES)
BODY_TIMEOUT_S = 30.0
TOKEN_CHARS = 4   # about a token's characters: a token list's size as text, for the long texts' lane
log = logging.getLogger("leapfrog.server")


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a lone UTF-16 surrogate echoed from a request (a model name in
    an error message, say) cannot be encoded as UTF-8, and must not turn a 400 into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return ASCIIJSONResponse(APIError(status, message, type_, param, code).body(), status_code=status,
                             headers=headers)


class Guard:
    """ASGI middleware at the door: the API key, then the body size, counted while reading (so a
    ``Transfer-Encoding: chunked`` body cannot bypass the limit), and its pace (each part within
    BODY_TIMEOUT_S of the last, read here at every request, else 408). The body is read here in
    full (at most MAX_BODY_BYTES) and replayed to the app; later ``receive`` calls reach the
    server, which is how a route learns that its client went away."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int = MAX_BODY_BYTES) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") != "/health":
            auth = headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                return await error(401, "invalid or missing API key (Authorization: Bearer ...)",
                                   type_="authentication_error", code="invalid_api_key")(scope, receive, send)
        size = headers.get("content-length")
        if size is not None and (not (size.isascii() and size.isdigit()) or int(size) > self.max_body):
            return await self._too_large(scope, receive, send)
        body, more = bytearray(), True
        while more:
            try:
                msg = await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                # (Connection: close, RFC 9110: the server closes the socket after it; else uvicorn's
                # keep-alive timer, cancelled by any later byte, could leave it open)
                return await error(408, f"no part of the request body arrived for {BODY_TIMEOUT_S:g} s",
                                   code="body_timeout", headers={"Connection": "close"})(scope, receive, send)
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_body:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error(413, f"request body larger than {self.max_body} bytes", code="body_too_large")(
            scope, receive, send)


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None,
              max_waiting: int = 256) -> FastAPI:
    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = ServerMetrics(served_model_name, engine.max_model_len)
    async_engine.on_finished = metrics.request_finished
    async_engine.on_iteration = metrics.iteration
    serving = OpenAIServing(async_engine, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        # in-flight requests end as "abort" (see LeapfrogServer for signals); join off the event loop
        await asyncio.to_thread(async_engine.shutdown)
        await asyncio.to_thread(engine.close)   # tensor-parallel workers exit with the server

    app = FastAPI(title="leapfrog", lifespan=lifespan, default_response_class=ASCIIJSONResponse)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(Guard, api_key=api_key)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        log.exception("unhandled error")
        return error(500, f"internal server error: {type(e).__name__}: {e}", type_="server_error",
                     code="internal_error")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return ASCIIJSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EngineStopped)
    async def stopped(_: Request, e: EngineStopped):
        return error(503, str(e), type_="server_unavailable", code="shutting_down")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error(400, f"invalid JSON body: {msg}", code="invalid_json")
        if not loc and first.get("type") in ("dict_type", "model_type", "model_attributes_type"):   # (not an object)
            return error(400, "the body must be a JSON object (Content-Type: application/json)",
                         code="invalid_json")
        return error(400, f"{'.'.join(loc) or 'body'}: {msg}", param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, str(e.detail), type_=kind)

    @app.get("/health")
    async def health():
        if not async_engine.alive:
            return error(503, "the engine is not running", type_="server_unavailable", code="engine_down")
        return {"status": "ok"}

    @app.head("/health", include_in_schema=False)   # (load balancers' probes; GET's operation in the schema)
    async def health_head():
        return await health()

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "leapfrog",
                "root": str(engine.config.model), "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):   # OpenAI's retrieve (client.models.retrieve)
        serving.check_model(model)
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        kv = engine.kv
        stats = getattr(engine.proposer, "stats", None)
        metrics.set_engine_state(len(engine.scheduler.running), async_engine.num_waiting,
                                 kv.used_tokens() / kv.token_budget, stats() if stats is not None else None)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def head(prefix: str, obj: str) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": served_model_name}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        serving.check_request(req)
        sp = serving.sampling_params(req, req.max_tokens if req.max_tokens is not None else 16)
        k = serving.spec_tokens(req)
        prompts = serving.completion_prompts(req)
        top = head("cmpl", "text_completion")
        k_lp = req.logprobs

        def echo_text(o: RequestOutput) -> str:
            return o.prompt if o.prompt is not None else serving.decode(o.prompt_token_ids)

        def logprobs(o: RequestOutput, ids: list[int], pos: list, offset: int, echo: bool) -> dict | None:
            if k_lp is None:
                return None
            if echo:
                ids, pos = o.prompt_token_ids + ids, (o.prompt_logprobs or [None] * len(o.prompt_token_ids)) + pos
            return completion_logprobs(ids, pos, k_lp, offset, serving.decode)

        if req.stream:
            sent = {}   # choice -> text_offset of its next token (the token texts so far, as without streaming)

            def chunk(ev: StreamEvent) -> dict:
                o, c = ev.out, ev.out.outputs[0]
                new_ids, new_pos = c.token_ids[len(c.token_ids) - ev.new_tokens:], (c.logprobs or [])[
                    len(c.token_ids) - ev.new_tokens:]
                echo = req.echo and ev.first
                text = (echo_text(o) if echo else "") + ev.text
                lps = logprobs(o, new_ids, new_pos, sent.get(ev.index, 0), echo)
                if lps is not None and lps["tokens"]:
                    sent[ev.index] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                choice = {"index": 0, "text": text, "logprobs": lps,
                          "finish_reason": c.finish_reason if o.finished else None,
                          "stop_reason": c.stop_reason if o.finished else None}
                if req.return_token_ids:
                    choice["token_ids"] = new_ids
                    if ev.first:
                        choice["prompt_token_ids"] = o.prompt_token_ids
                if ev.first and req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
                return choice

            return await _streaming(serving.stream_all(prompts, sp, k), disconnected(raw), top, sp.n,
                                    len(prompts) * sp.n, req.stream_options, chunk,
                                    always=k_lp is not None or req.echo or req.return_token_ids)
        outs = await serving.run_all(prompts, sp, k, disconnected(raw))
        choices = []
        for i, o in enumerate(outs):
            c = o.outputs[0]
            prefix = echo_text(o) if req.echo else ""
            choice = {"index": i, "text": prefix + c.text, "logprobs": logprobs(o, c.token_ids, c.logprobs or [], 0,
                                                                                req.echo),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice.update(prompt_token_ids=o.prompt_token_ids, token_ids=c.token_ids)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
            choices.append(choice)
        return {**top, "choices": choices, "usage": usage(outs, sp.n)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        serving.check_request(req)
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        sp = serving.sampling_params(req, getattr(req, max_field), max_field)
        k = serving.spec_tokens(req)
        prompt = await async_engine.in_tokenizer_thread(serving.chat_prompt, req, chars=text_chars(req.messages))
        top = head("chatcmpl", "chat.completion")
        k_lp = req.top_logprobs or 0

        if req.stream:
            def chunk(ev: StreamEvent) -> dict:
                o, c = ev.out, ev.out.outputs[0]
                n = len(c.token_ids) - ev.new_tokens
                choice = {"index": 0, "delta": {"content": ev.text} if ev.text else {},
                          "logprobs": chat_logprobs(c.token_ids[n:], c.logprobs[n:], k_lp) if req.logprobs else None,
                          "finish_reason": c.finish_reason if o.finished else None,
                          "stop_reason": c.stop_reason if o.finished else None}
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids[n:]
                return choice

            def extra_first(o: RequestOutput) -> dict:   # (the top-level fields of the answer without streaming)
                extra = {}
                if req.return_token_ids:
                    extra["prompt_token_ids"] = prompt.ids
                if req.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
                return extra

            return await _streaming(serving.stream_all([prompt], sp, k), disconnected(raw),
                                    {**top, "object": "chat.completion.chunk"}, sp.n, sp.n, req.stream_options,
                                    chunk, first_delta={"role": "assistant", "content": ""},
                                    always=req.logprobs or req.return_token_ids, first_extra=extra_first)
        outs = await serving.run_all([prompt], sp, k, disconnected(raw))
        choices = []
        for i, o in enumerate(outs):
            c = o.outputs[0]
            choice = {"index": i, "message": {"role": "assistant", "content": c.text},
                      "logprobs": chat_logprobs(c.token_ids, c.logprobs, k_lp) if req.logprobs else None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {**top, "choices": choices, "usage": usage(outs, sp.n)}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt.ids
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(outs[0].prompt_logprobs)
        return body

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        ids = await async_engine.in_tokenizer_thread(serving.tokenize, req,
                                                     chars=len(req.prompt or "") + text_chars(req.messages))
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = await async_engine.in_tokenizer_thread(
                serving.tokenizer.convert_ids_to_tokens, ids, chars=TOKEN_CHARS * len(ids))
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)   # (~1M ids of a 4 MiB body: a second of decoding, off the event loop)
        text = await async_engine.in_tokenizer_thread(serving.detokenize, req.tokens,
                                                      chars=TOKEN_CHARS * len(req.tokens))
        return {"prompt": text}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, e: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    return app


def disconnected(raw: Request):
    """-> a coroutine function that returns when the client closes the connection (the body was
    read already, so the next ASGI message is the disconnect)."""
    async def wait() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass
    return wait


class LeapfrogServer(uvicorn.Server):
    """uvicorn's server, but a signal first ends every in-flight request (streams get their
    finish_reason "abort" chunk and [DONE]); uvicorn's graceful shutdown then finds the
    connections finishing instead of waiting out its timeout on running generations."""

    def handle_exit(self, sig, frame) -> None:
        engine = getattr(getattr(self.config.app, "state", None), "engine", None)
        if engine is not None:
            engine.begin_shutdown()
        super().handle_exit(sig, frame)


@dataclass
class StreamEvent:
    """One advance of one choice, for a route's chunk builder."""
    index: int            # the choice
    out: RequestOutput    # its output so far
    text: str             # new text (held back while it could still become a stop string)
    new_tokens: int       # tokens generated since the last event of this choice
    first: bool           # the first chunk of this choice


async def _streaming(events, client_gone, head: dict, n: int, total: int, stream_options: StreamOptions | None,
                     make_choice: Callable[[StreamEvent], dict], first_delta: dict | None = None,
                     always: bool = False, first_extra: Callable[[RequestOutput], dict] | None = None):
    """Start the stream (so request errors, and an engine failure of a one-choice request in
    its first step, still become JSON errors), then serve SSE chunks. Until the first event the
    client is watched here (Starlette watches it once the response runs). Every stream ends
    with a finish_reason per choice and ``[DONE]``: if the engine fails after the 200 went out,
    the open choices end with finish_reason "error" and an ``error`` object. A choice's chunk
    goes out when it has new text, when it finishes, or (``always``: logprobs, token ids, echo)
    whenever it has new tokens. ``first_extra``: fields of the ``first_delta`` chunk (the stream's
    first), from the first output (the prompt's logprobs come with it)."""
    assert first_extra is None or first_delta is not None, "first_extra rides on the first_delta chunk"
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = include_usage and stream_options.continuous_usage_stats
    it = events.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    watch = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not nxt.done():
            raise ClientDisconnected()
        try:
            first = nxt.result()
        except StopAsyncIteration:
            first = None
    except BaseException:
        if not nxt.done():
            nxt.cancel()   # the generator's finally aborts the engine requests
            with contextlib.suppress(BaseException):
                await nxt
        await it.aclose()
        raise
    finally:
        watch.cancel()
    if first is not None and total == 1 and first[1].finished and first[1].outputs[0].finish_reason == "error":
        await it.aclose()
        raise failure(first[1], "request")
    extra0 = first_extra(first[1]) if first_extra is not None and first is not None else {}

    async def chunks():
        finals: dict[int, object] = {}
        try:
            started: set[int] = set()
            if first_delta is not None:
                for i in range(total):
                    yield sse({**head, "choices": [{"index": i, "delta": first_delta, "logprobs": None,
                                                    "finish_reason": None}], **(extra0 if i == 0 else {})})
            ev = first
            while ev is not None:
                idx, out, text, new_tok = ev
                if text or out.finished or (always and (new_tok or idx not in started)):
                    choice = make_choice(StreamEvent(idx, out, text, new_tok, idx not in started))
                    started.add(idx)
                    choice["index"] = idx
                    extra = {}
                    if out.finished and out.outputs[0].finish_reason == "error":
                        extra = failure(out, "choice").body()
                    if continuous:
                        p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
                        extra["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
                    yield sse({**head, "choices": [choice], **extra})
                if out.finished:
                    finals[idx] = out
                try:
                    ev = await it.__anext__()
                except StopAsyncIteration:
                    ev = None
            if include_usage:
                outs = [finals[i] for i in sorted(finals)]
                yield sse({**head, "choices": [], "usage": usage(outs, n)})
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is long gone
            if isinstance(e, APIError):   # (its own status and type: 503 when the server shuts down)
                log.warning("stream ended with HTTP %d: %s", e.status, e.message)
                err = e.body()
            else:
                log.exception("stream failed")
                err = APIError(500, f"{type(e).__name__}: {e}", "server_error", code="engine_error").body()
            for i in range(total):
                if i not in finals:
                    choice = {"index": i, "logprobs": None, "finish_reason": "error"}
                    choice.update({"delta": {}} if first_delta is not None else {"text": ""})
                    yield sse({**head, "choices": [choice], **err})
        yield sse("[DONE]")

    async def body():
        try:
            async for c in chunks():
                yield c
        finally:
            await it.aclose()  # client gone: the requests are aborted and their KV freed

    return StreamingResponse(body(), media_type="text/event-stream")
