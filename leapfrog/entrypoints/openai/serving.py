"""Protocol <-> AsyncEngine: sampling params, prompts, responses, SSE streaming, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from leapfrog.engine.async_engine import AsyncEngine, EngineOverloaded, EngineStopped, Reservation
from leapfrog.entrypoints.openai.metrics import ServerMetrics
from leapfrog.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, TokenizeRequest, _Sampling,
                                                  template_messages)
from leapfrog.errors import ConfigError, RequestError
from leapfrog.outputs import PositionLogprobs, RequestOutput, SpecMetrics
from leapfrog.request import Prepared
from leapfrog.sampling.grammar import StructuredOutputsParams
from leapfrog.sampling_params import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code or str(self.status)}}


@dataclass
class Prompt:
    text: str | None
    ids: list[int] | None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = metrics
        inner = engine.engine
        self.tokenizer = inner.tokenizer
        self.max_model_len = inner.max_model_len
        self.vocab_size = inner.vocab_size
        spec = inner.config.speculative_config
        self.max_spec_tokens = spec["num_speculative_tokens"] if spec else 0

    # ------------------------------------------------------------------ request -> engine inputs
    def check_request(self, req: _Sampling) -> None:
        """Refuse what would change the answer but is not implemented (never silently ignore it),
        and fields that only make sense together."""
        for name, value in (req.model_extra or {}).items():
            unused = _UNSUPPORTED.get(name)
            if unused is not None and not unused(value):
                raise APIError(400, f"`{name}` is not supported by this server", param=name,
                               code="unsupported_parameter")
            if unused is None:
                raise APIError(400, f"`{name}` is not a field this server knows; it is refused rather than ignored "
                                    "(check its spelling, and the README's list of request fields)",
                               param=name, code="unsupported_parameter")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of={req.best_of} with n={req.n} is not supported: the server returns every "
                                "sample it draws (best_of equal to n, or unset)", param="best_of",
                           code="unsupported_parameter")
        if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_model(req.model)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def sampling_params(self, req: _Sampling, max_tokens: int | None, max_field: str = "max_tokens") -> SamplingParams:
        """``max_field``: the request field ``max_tokens`` came from (chat's max_completion_tokens),
        named in its errors."""
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise APIError(400, f"{max_field}={max_tokens} is larger than the context ({self.max_model_len})",
                           param=max_field)
        prompt_logprobs = req.prompt_logprobs
        if isinstance(req, ChatCompletionRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
            if req.echo and logprobs is not None:   # echo with logprobs reports the prompt's too (OpenAI)
                prompt_logprobs = max(prompt_logprobs or 0, logprobs)
        bias = None
        if req.logit_bias is not None:
            bad = [k for k in req.logit_bias if not _TOKEN_ID_KEY.fullmatch(k)]
            if bad:   # (int() would also take "5_0", " 5" or other scripts' digits)
                raise APIError(400, f"logit_bias key {bad[0]!r}: keys must be token ids (decimal integers as "
                                    "strings)", param="logit_bias")
            bias = {int(k): v for k, v in req.logit_bias.items()}
        kw: dict[str, Any] = dict(
            structured_outputs=self.structured_outputs(req),
            n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            prediction=None if req.prediction is None else req.prediction.text,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        try:
            return SamplingParams(**kw)
        except ConfigError as e:
            param = str(e).split("=")[0].removeprefix("SamplingParams.")
            raise APIError(400, str(e), param=max_field if param == "max_tokens" else param) from None

    def structured_outputs(self, req: _Sampling) -> StructuredOutputsParams | None:
        """The one constraint of response_format, structured_outputs or guided_* (more than one: 400)."""
        given: list[tuple[str, dict]] = []
        rf = req.response_format
        if rf is not None:
            kind = rf.get("type")
            other = sorted(set(rf) - {"type"} - ({"json_schema"} if kind == "json_schema" else set()))
            spec = rf.get("json_schema")
            if isinstance(spec, dict):   # (OpenAI's name, description, schema and strict; vLLM also reads
                other += [f"json_schema.{k}" for k in sorted(   # the schema under json_schema.json_schema)
                    set(spec) - {"name", "description", "schema", "strict", "json_schema"})]
            if other:
                raise APIError(400, f"response_format: {other[0]!r} is not supported (refused, not ignored)",
                               param="response_format")
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format json_schema needs json_schema.schema (an object)",
                                   param="response_format")
                given.append(("response_format", {"json": schema}))
            elif kind != "text":
                raise APIError(400, f"response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'",
                               param="response_format")
        if req.structured_outputs is not None:
            given.append(("structured_outputs", dict(req.structured_outputs)))
        for name in ("json", "regex", "choice", "grammar"):
            v = getattr(req, f"guided_{name}")
            if v is not None:
                given.append((f"guided_{name}", {name: v}))
        if not given:
            return None
        if len(given) > 1:
            raise APIError(400, f"give one structured output constraint, not {[g for g, _ in given]}",
                           param=given[1][0])
        field, kw = given[0]
        try:
            return StructuredOutputsParams(**kw)
        except (ConfigError, TypeError) as e:
            raise APIError(400, f"{field}: {e}", param=field) from None

    def spec_tokens(self, req: _Sampling) -> int | None:
        if req.speculative is None:
            return None
        k = req.speculative.num_speculative_tokens
        if k > self.max_spec_tokens:
            raise APIError(400, f"speculative.num_speculative_tokens={k} exceeds the server's "
                                f"{self.max_spec_tokens} (a request may only narrow speculation)",
                           param="speculative.num_speculative_tokens")
        return k

    def completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        if isinstance(p, str):
            return [Prompt(p, None)]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            out = [Prompt(None, list(p))]  # type: ignore[arg-type]
        elif all(isinstance(x, str) for x in p):
            return [Prompt(x, None) for x in p]  # type: ignore[union-attr]
        else:
            out = [Prompt(None, list(x)) for x in p]  # type: ignore[arg-type]
        # every prompt checked before any runs: a bad id in prompt 3 is a 400, not an error mid-stream
        for i, pr in enumerate(out):
            bad = [t for t in pr.ids or () if not 0 <= t < self.vocab_size]
            if not pr.ids or bad:
                why = f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})" if bad else "is empty"
                raise APIError(400, f"prompt {i}: {why}", param="prompt")
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> Prompt:
        return Prompt(None, self._chat_ids(req.messages, req.add_generation_prompt))

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        """/tokenize: a prompt (with or without special tokens) or chat messages."""
        self._need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            return self._chat_ids(req.messages, req.add_generation_prompt)
        try:
            return list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        except Exception as e:  # noqa: BLE001 - the input's fault (a lone surrogate, say)
            raise APIError(400, f"could not tokenize the prompt: {type(e).__name__}: {e}", param="prompt") from None

    def detokenize(self, ids: list[int]) -> str:
        self._need_tokenizer()
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        return self.decode(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer (skip_tokenizer_init)", param="prompt")

    def _chat_ids(self, messages: list, add_generation_prompt: bool) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template", param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(template_messages(messages), tokenize=True,
                                                     add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ------------------------------------------------------------------ running
    async def _stream(self, rid: str, prompt: Prompt, index: int, k: int | None, reservation: Reservation,
                      prepared: Prepared, arrival: float, on_accepted: Callable[[], None] | None = None
                      ) -> AsyncIterator[RequestOutput]:
        with _engine_errors():
            async for out in self.engine.generate(rid, prompt.text, prompt.ids, prepared, k, reservation, on_accepted,
                                                  index, arrival):
                yield out

    async def _prepare(self, sp: SamplingParams, reservation: Reservation) -> Prepared:
        """The request's params checked and their lists built (bad words, stop strings, a
        prediction) once for all its prompts and choices, after it was admitted (an overloaded
        server answers its 503 at once); refused or left (a cancelled task), its places are released."""
        try:
            with _engine_errors():
                return await self.engine.prepare(sp)
        except BaseException:
            self.engine.release(reservation)
            raise

    def _jobs(self, prompts: list[Prompt], sp: SamplingParams) -> list[tuple[int, Prompt, int]]:
        """One engine request per (prompt, n) choice: (its index in the answer, its prompt, its
        choice index, which offsets its seed); all share the request's prepared params."""
        return [(j * sp.n + i, p, i) for j, p in enumerate(prompts) for i in range(sp.n)]

    def admit(self, jobs: int, sp: SamplingParams) -> Reservation:
        """A request of ``jobs`` engine requests (prompts x n) must fit the waiting bound: one that
        never can is a 400 (retrying cannot help); one that cannot now is a 503."""
        limit = self.engine.max_waiting
        if jobs > limit:
            raise APIError(400, f"this request needs {jobs} sequences (prompts x n) but the server queues at most "
                                f"{limit}; send fewer prompts or a smaller n", param="n", code="too_many_sequences")
        try:
            return self.engine.reserve(jobs)
        except EngineOverloaded as e:
            raise APIError(503, f"{e}; retry later", type_="server_overloaded", code="overloaded") from None

    async def run_all(self, prompts: list[Prompt], sp: SamplingParams, k: int | None,
                      disconnected: Callable[[], Awaitable[None]] | None = None) -> list[RequestOutput]:
        """Every choice's final output. If ``disconnected`` returns first (the client went away),
        every choice is aborted at once and ClientDisconnected is raised. A choice that failed in
        the engine (finish_reason "error") makes the whole answer a JSON 500."""
        base, arrival = uuid.uuid4().hex, time.monotonic()   # (TTFT counts the params' preparing)
        jobs = self._jobs(prompts, sp)
        reservation = self.admit(len(jobs), sp)
        prepared = await self._prepare(sp, reservation)

        async def one(idx: int, p: Prompt, i: int) -> RequestOutput:
            last = None
            async for out in self._stream(f"{base}-{idx}", p, i, k, reservation, prepared, arrival):
                last = out
            assert last is not None
            return last

        tasks = [asyncio.ensure_future(one(*j)) for j in jobs]
        gathered = asyncio.gather(*tasks)
        watch = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        try:
            if watch is not None:
                await asyncio.wait({gathered, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not gathered.done():
                    raise ClientDisconnected()
            outs = list(await gathered)
        finally:
            for t in tasks:
                t.cancel()
            if watch is not None:
                watch.cancel()
            if not gathered.done():
                gathered.cancel()
            # a cancelled choice leaves the gather's CancelledError unread: asyncio would log it
            gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.engine.release(reservation)
        failed = [o for o in outs if o.outputs[0].finish_reason == "error"]
        if failed:
            raise failure(failed[0], "request")
        self.metrics.request_params(sp.n, sp.max_tokens)   # served requests only, as vLLM counts them
        return outs

    async def stream_all(self, prompts: list[Prompt], sp: SamplingParams, k: int | None
                         ) -> AsyncIterator[tuple[int, RequestOutput, str, int]]:
        """Yield (choice index, output, new text, new tokens) as any choice advances. Text that
        could still become part of a stop string is held back until it cannot. Nothing is yielded
        until the engine has accepted every choice: a request refused at the door (its second
        prompt too long for the context) raises its error before the first event, so the answer
        is a JSON 4xx, not a stream that fails after the first prompt's first tokens went out."""
        base, arrival = uuid.uuid4().hex, time.monotonic()   # (TTFT counts the params' preparing)
        hold = max((len(s) for s in sp.stop_strings), default=1) - 1
        q: asyncio.Queue = asyncio.Queue()

        async def pump(idx: int, p: Prompt, i: int) -> None:
            try:
                async for out in self._stream(f"{base}-{idx}", p, i, k, reservation, prepared, arrival,
                                              lambda: q.put_nowait((idx, _ACCEPTED))):
                    await q.put((idx, out))
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer (a shutdown: EngineStopped's 503)
                await q.put((idx, e))

        jobs = self._jobs(prompts, sp)
        reservation = self.admit(len(jobs), sp)
        prepared = await self._prepare(sp, reservation)
        tasks = [asyncio.ensure_future(pump(*j)) for j in jobs]
        sent_text = [0] * len(jobs)
        sent_tok = [0] * len(jobs)
        done = accepted = 0
        # each choice's latest output from before every choice was accepted (outputs are cumulative:
        # the latest carries all the earlier ones' text and tokens), in the order the choices first came
        held: dict[int, RequestOutput] = {}
        try:
            while done < len(jobs):
                if accepted == len(jobs) and held:
                    idx = next(iter(held))
                    out = held.pop(idx)
                else:
                    idx, out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                if out is _ACCEPTED:
                    accepted += 1
                    continue
                if accepted < len(jobs):
                    held[idx] = out
                    continue
                c = out.outputs[0]
                end = len(c.text) if out.finished else max(sent_text[idx], len(c.text) - hold)
                text = c.text[sent_text[idx]:end]
                new_tok = len(c.token_ids) - sent_tok[idx]
                sent_text[idx], sent_tok[idx] = end, len(c.token_ids)
                done += out.finished
                if done == len(jobs):
                    self.metrics.request_params(sp.n, sp.max_tokens)   # served requests only
                yield idx, out, text, new_tok
        finally:
            for t in tasks:
                t.cancel()
            self.engine.release(reservation)


#: stream_all's queue marker: the engine accepted a choice (AsyncEngine.generate's on_accepted)
_ACCEPTED = object()


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


def error_text(out: RequestOutput) -> str:
    return f"{type(out.error).__name__}: {out.error}" if out.error is not None else "unknown error"


def failure(out: RequestOutput, what: str) -> APIError:
    """The error of a request (or choice: ``what``) that ended with finish_reason "error": a 400
    when the request was at fault (a structured-output constraint past llguidance's limits
    partway through), else the engine's 500."""
    if isinstance(out.error, RequestError):
        return APIError(400, f"this {what} failed: {out.error}", param=out.error.param)
    return APIError(500, f"the engine failed on this {what}: {error_text(out)}", type_="server_error",
                    code="engine_error")


def _unused(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x for x in values)


#: a logit_bias key: a token id written in ASCII decimal digits
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")

# OpenAI/vLLM fields that would change the answer and are not implemented yet -> 400, with the
# values that mean "not used" (which are accepted).
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _unused(""),
    "tools": _unused([]), "tool_choice": _unused("none"), "functions": _unused([]),
    "function_call": _unused("none"), "guided_decoding_backend": _unused(), "guided_whitespace_pattern": _unused(),
    "logits_processors": _unused([]), "use_beam_search": _unused(False),
    "audio": _unused(), "modalities": _unused(["text"]), "echo": _unused(False), "add_special_tokens": _unused(),
    "continue_final_message": _unused(False), "chat_template": _unused(),
    "chat_template_kwargs": _unused({}), "documents": _unused(),
    "length_penalty": _unused(1.0), "spaces_between_special_tokens": _unused(True),
}


@contextlib.contextmanager
def _engine_errors():
    """The engine's refusals as API errors: a bad request's 400, a shutdown's 503."""
    try:
        yield
    except RequestError as e:
        raise APIError(400, str(e), param=e.param or "prompt") from None
    except EngineStopped as e:
        raise APIError(503, str(e), type_="server_unavailable", code="shutting_down") from None


def usage(outs: list[RequestOutput], n: int = 1) -> dict:
    """OpenAI usage plus a ``speculative`` block for this request (all its choices). ``outs`` are
    in job order (prompt-major, n choices each), so each prompt's tokens count once. With a
    prediction, ``completion_tokens_details`` has OpenAI's accepted / rejected_prediction_tokens
    (prediction tokens that appeared in the completion / the rest, summed over the choices)."""
    spec = SpecMetrics()
    for o in outs:
        if o.metrics is not None:
            spec.merge(o.metrics.spec)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs[::n])
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": 0},   # no prefix cache yet
           "speculative": spec.to_dict()}
    acc = [o.metrics.accepted_prediction_tokens for o in outs if o.metrics is not None]
    if any(a is not None for a in acc):
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(a or 0 for a in acc),
            "rejected_prediction_tokens": sum(o.metrics.rejected_prediction_tokens or 0 for o in outs
                                              if o.metrics is not None)}
    return out


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


#: what -inf becomes in JSON (strict JSON has no infinities; vLLM's value)
LOGPROB_FLOOR = -9999.0


def _lp(v: float) -> float:
    return max(v, LOGPROB_FLOOR)


def _top(pos: PositionLogprobs, k: int) -> list[tuple[int, "Any"]]:
    """The k most likely entries of a position, best first."""
    return sorted(((t, e) for t, e in pos.items() if e.rank is not None and e.rank <= k),
                  key=lambda te: te[1].rank)[:k]


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], k: int,
                        text_offset: int, decode: Callable[[list[int]], str] | None = None) -> dict:
    """OpenAI's completions ``logprobs`` object for these tokens (a None position: the first
    prompt token, which has no logprob; its text is ``decode([token])``); offsets count characters
    from ``text_offset``."""
    tokens, values, tops, offsets = [], [], [], []
    for t, pos in zip(token_ids, positions):
        if pos is None:
            text = decode([t]) if decode is not None else ""
        else:
            text = pos[t].decoded_token or ""
        tokens.append(text)
        values.append(None if pos is None else _lp(pos[t].logprob))
        top: dict[str, float] | None = None
        if pos is not None:   # keyed by text: tokens with the same text keep the most likely one's value
            top = {}
            for _, e in _top(pos, k):
                top.setdefault(e.decoded_token or "", _lp(e.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(text: str | None, v: float) -> dict:
        text = text or ""
        return {"token": text, "logprob": _lp(v), "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**entry(pos[t].decoded_token, pos[t].logprob),
                         "top_logprobs": [entry(e.decoded_token, e.logprob) for _, e in _top(pos, k)]}
                        for t, pos in zip(token_ids, positions)]}


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if pos is None else {str(t): {"logprob": _lp(e.logprob), "rank": e.rank,
                                               "decoded_token": e.decoded_token} for t, e in pos.items()}
            for pos in positions]
