"""One bad request never hurts another (server): validation at the door, isolation of engine
failures, disconnects, the body limit, the queue bound. Real server thread, real clients
(httpx, the official openai client). SIGTERM is tested through a subprocess in test_serve_cli.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import greedy_text, make_server
from tests.sampling.test_structured import BIG_OBJECT

PROMPT = "def foo(x):\n    return"


@pytest.fixture(scope="module")
def server(llama_dir):
    with make_server(llama_dir, max_waiting=32) as s:
        yield s


@pytest.fixture(scope="module")
def expected(llama_dir):
    return greedy_text(llama_dir, PROMPT, 16)


def good(server) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def engine_of(server):
    return server.app.state.engine.engine


def idle(server, timeout: float) -> bool:
    eng = engine_of(server)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not eng.requests and eng.kv.num_free == eng.kv.num_rows:
            return True
        time.sleep(0.02)
    return False


C, CH = "/v1/completions", "/v1/chat/completions"
BAD = [  # (path, body, param or message fragment)
    (C, {"prompt": "x", "max_tokens": 4, "temperature": 1.0, "repetition_penalty": 1e-300}, "repetition_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 1e300}, "repetition_penalty"),
    (C, {"prompt": "x", "min_tokens": 2, "stop_token_ids": [100000]}, "stop_token_ids"),
    (C, {"prompt": "x", "logit_bias": {"five": 10}}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"100000": 10}}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    (C, {"prompt": "x", "allowed_token_ids": [5, 100000]}, "allowed_token_ids"),
    (C, {"prompt": "x", "bad_words": [""]}, "bad_words"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens"),
    (C, {"prompt": "x", "best_of": 3}, "best_of"),
    (C, {"prompt": "x", "suffix": "end"}, "suffix"),
    (C, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (C, {"prompt": "x", "n": 16, "max_tokens": 2} | {"prompt": ["a", "b", "c"]}, "sequences"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "text"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "image_url"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                                                                              "json_schema": {"schema": {"type": 5}}}},
     "structured_outputs"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    # keys inside objects are refused as fields are (found by fuzzing: they were ignored)
    (CH, {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text", "junk": 1}}, "junk"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, "junk": 1}}}, "junk"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]},
     "cache_control"),
    # the fields with no effect on the answer are typed too
    (C, {"prompt": "x", "metadata": 5}, "metadata"),
    (C, {"prompt": "x", "store": "x"}, "store"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": 5}, "parallel_tool_calls"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    (C, {"prompt": [[1, 2], [3, 10**6]], "stream": True}, "prompt 1"),
    (C, {"prompt": [[1, 2], []]}, "prompt 1"),
    (C, {"prompt": "\ud800"}, "surrogate"),                    # a lone UTF-16 surrogate (found by fuzzing)
    # a field the server does not know is refused, not ignored (a typo, or another API's name)
    (C, {"prompt": "x", "temprature": 0}, "temprature"),
    (C, {"prompt": "x", "max_completion_tokens": 1}, "max_completion_tokens"),
    (CH, {"messages": [{"role": "user", "content": "hi"}], "typical_p": 0.5}, "typical_p"),
    # wrong types are refused, never converted
    (C, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (C, {"prompt": "x", "temperature": "0.5"}, "temperature"),
    (C, {"prompt": "x", "echo": "yes"}, "echo"),
    (C, {"prompt": "x", "stream": "true"}, "stream"),
    (C, {"prompt": [True, False]}, "prompt"),
    (C, {"prompt": "x", "speculative": {"num_speculative_tokens": True}}, "num_speculative_tokens"),
    # message fields the chat template would not see are refused
    (CH, {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "name"),
    (CH, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "42"}]}, "tool_calls"),
    (CH, {"messages": [{"role": "user"}]}, "content"),
    # logit_bias keys are decimal token ids, not whatever int() accepts
    (C, {"prompt": "x", "logit_bias": {"5_0": 1}}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {" 5": 1}}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"\u0665": 1}}, "logit_bias"),
    # choice lists past the bound (built on the engine's thread) and min_tokens against a grammar
    (C, {"prompt": "x", "guided_choice": [f"c{i}" for i in range(1025)]}, "choice"),
    (C, {"prompt": "x", "guided_regex": "a", "min_tokens": 3}, "min_tokens"),
    (C, {"prompt": "x", "max_tokens": 256, "truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),
    # a schema that compiles but passes llguidance's limits at its first token: the request's 400
    (C, {"prompt": "x", "max_tokens": 4, "guided_json": BIG_OBJECT}, "max is 2000"),
    (C, {"prompt": "x", "max_tokens": 4, "guided_json": BIG_OBJECT, "stream": True}, "max is 2000"),
]


@pytest.mark.parametrize("path, body, what", BAD, ids=[w for _, _, w in BAD])
def test_bad_requests_get_400_and_hurt_nobody(server, expected, path, body, what):
    r = httpx.post(server.url + path, content=json.dumps({"model": "tiny", **body}),  # ASCII-escaped JSON
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert what in (err["param"] or "") + err["message"]
    assert good(server) == expected and idle(server, 5)


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_prompts_are_all_accepted_before_the_first_byte(server, expected, monkeypatch, n):
    """Several text prompts streamed, the second too long for the context and tokenized only once
    the first has tokens out (held here): the answer is the JSON 400, not a 200 stream that sends
    prompt 0's first tokens and then fails every choice (found by fuzzing)."""
    eng = engine_of(server)
    real, first_out = eng.encode_prompt, threading.Event()
    long_prompt = "hello world " * 200

    def slow(text):
        if text == long_prompt:
            first_out.wait(10)   # prompt 0 has produced a token (or 10 s went by)
        return real(text)
    monkeypatch.setattr(eng, "encode_prompt", slow)
    on_iteration = server.app.state.engine.on_iteration
    monkeypatch.setattr(server.app.state.engine, "on_iteration",
                        lambda stats: (first_out.set(), on_iteration and on_iteration(stats)))
    r = httpx.post(server.url + C, timeout=60, json={"model": "tiny", "prompt": ["hi", long_prompt], "max_tokens": 4,
                                                     "n": n, "stream": True})
    assert first_out.is_set()
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert "max_model_len" in r.json()["error"]["message"]
    assert good(server) == expected and idle(server, 5)


def test_an_api_error_inside_a_stream_keeps_its_status(server, expected, monkeypatch):
    """A choice that ends with an APIError after the stream started (the server shutting down:
    503) reports that error in-band, not a relabelled 500 engine error."""
    from leapfrog.entrypoints.openai.serving import APIError, OpenAIServing
    real = OpenAIServing._stream

    async def failing(self, rid, *args, **kw):
        async for out in real(self, rid, *args, **kw):
            yield out
            if rid.endswith("-1"):   # the second choice, after its first output
                raise APIError(503, "the server is shutting down", type_="server_unavailable", code="shutting_down")
    monkeypatch.setattr(OpenAIServing, "_stream", failing)
    r = httpx.post(server.url + C, timeout=60, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "n": 2,
                                                     "temperature": 0, "ignore_eos": True, "stream": True})
    chunks, done = _sse(r.text.splitlines())
    assert r.status_code == 200 and done
    errors = [c["error"] for c in chunks if "error" in c]
    assert errors and all(e["type"] == "server_unavailable" and e["code"] == "shutting_down" for e in errors), errors
    monkeypatch.undo()
    assert good(server) == expected and idle(server, 5)


@pytest.mark.parametrize("held", ["compile_grammar", "encode_prompt"])
def test_requests_are_prepared_off_the_engine_thread(server, expected, monkeypatch, held):
    """A text prompt is tokenized, and a structured-output matcher built, on threads of their
    own, not the engine's: while one request's preparation is held (here until a running
    stream has finished), the running stream goes on to its end."""
    eng = engine_of(server)
    real, answered, threads, held_for, finished = getattr(eng, held), threading.Event(), [], [], []

    def slow(arg):
        if held == "compile_grammar" or arg == "x":   # the held request's prompt is "x"
            threads.append(threading.current_thread().name)
            t0 = time.monotonic()
            answered.wait(60)   # on the engine's thread this would hold the running stream for 60 s
            held_for.append(time.monotonic() - t0)
        return real(arg)
    monkeypatch.setattr(eng, held, slow)
    on_finished = server.app.state.engine.on_finished
    monkeypatch.setattr(server.app.state.engine, "on_finished", lambda out: (finished.append(out), on_finished(out)))

    async def main():
        async with httpx.AsyncClient(timeout=120) as h:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            async with h.stream("POST", server.url + C, json=body) as r:
                lines = r.aiter_lines()
                got = [await lines.__anext__()]   # running: its first chunk is out
                guided = asyncio.ensure_future(h.post(server.url + C, json={
                    "model": "tiny", "prompt": "x", "max_tokens": 4, "guided_regex": "[a-z]{4}"}))
                while not threads:
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                got += [ln async for ln in lines]
                waited = time.monotonic() - t0
            answered.set()
            return _sse(got), waited, await guided
    (chunks, done), waited, guided = asyncio.run(main())
    assert threads == [{"compile_grammar": "leapfrog-grammar", "encode_prompt": "leapfrog-tokenize"}[held]]
    assert done and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected and waited < 30
    assert guided.status_code == 200 and len(guided.json()["choices"][0]["text"]) == 4
    # its time to first token counts the preparation (it arrived before it was held)
    out = next(o for o in finished if o.prompt == "x")
    assert out.metrics.time_to_first_token >= held_for[0] > 0


def test_chat_templates_and_tokenize_run_off_the_event_loop(server, monkeypatch):
    """The chat template and /tokenize run on the tokenizer's thread (on the event loop a long
    conversation would hold every stream's chunks)."""
    tok = engine_of(server).tokenizer
    threads = []
    for name in ("apply_chat_template", "encode"):
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _real=real, **k: threads.append(
            threading.current_thread().name) or _real(*a, **k))
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + CH, timeout=30, json={"model": "tiny", "messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/tokenize", timeout=30, json={"model": "tiny", "prompt": "def f():"})
    assert r.status_code == 200 and r.json()["count"] > 0
    assert len(threads) >= 2 and set(threads) == {"leapfrog-tokenize"}, threads


def test_a_long_prompt_tokenizing_holds_no_normal_request(server, monkeypatch):
    """Text over LONG_TEXT_CHARS tokenizes on a thread of its own: while a long prompt (here held
    in the tokenizer; a 4 MB one takes seconds, and is refused when it can never fit) tokenizes,
    normal completions, chats and /tokenize are answered. They queued behind it: 4 such prompts
    held a small request 31 s (helper's fuzzing)."""
    from leapfrog.engine.async_engine import LONG_TEXT_CHARS
    tok = engine_of(server).tokenizer
    release, holding, threads = threading.Event(), threading.Event(), []
    for name in ("apply_chat_template", "encode"):
        real = getattr(tok, name)

        def spy(text, *a, _real=real, **k):
            long = len(text) > LONG_TEXT_CHARS if isinstance(text, str) else len(str(text)) > LONG_TEXT_CHARS
            threads.append((long, threading.current_thread().name))
            if long:
                holding.set()
                release.wait(60)
            return _real(text, *a, **k)
        monkeypatch.setattr(tok, name, spy)
    long_prompt = "def f(x):\n" * (LONG_TEXT_CHARS // 10 + 1)
    answers = {}

    def send(name, route, body):
        answers[name] = httpx.post(server.url + route, timeout=60, json={"model": "tiny", **body})
    bigs = [threading.Thread(target=send, args=("long", C, {"prompt": long_prompt, "max_tokens": 2})),
            threading.Thread(target=send, args=("long-chat", CH, {"messages": [{"role": "user", "content": long_prompt}],
                                                                   "max_tokens": 2}))]
    for t in bigs:
        t.start()
    try:
        assert holding.wait(30)
        send("small", C, {"prompt": "def f():", "max_tokens": 2})
        send("chat", CH, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        send("tokenize", "/tokenize", {"prompt": "def f():"})
        assert "long" not in answers and "long-chat" not in answers   # (still held: these did not wait for it)
    finally:
        release.set()
        for t in bigs:
            t.join(60)
    assert [answers[k].status_code for k in ("small", "chat", "tokenize")] == [200, 200, 200]
    assert {answers[k].status_code for k in ("long", "long-chat")} <= {200, 400}   # (400: longer than the context)
    assert {name for long, name in threads if long} == {"leapfrog-tokenize-long"}, threads
    assert {name for long, name in threads if not long} == {"leapfrog-tokenize"}, threads


@pytest.mark.parametrize("body, param", [({"stop_token_ids": [100000]}, "stop_token_ids"),
                                         ({"min_tokens": 2, "stop_token_ids": list(range(320))}, "min_tokens"),
                                         ({"logit_bias": {"100000": 1}}, "logit_bias")])
def test_errors_name_the_field_at_fault(server, body, param):
    r = httpx.post(server.url + C, timeout=30, json={"model": "tiny", "prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_max_completion_tokens_errors_name_it(server):
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + CH, timeout=30, json={"model": "tiny", "messages": msgs,
                                                      "max_completion_tokens": 10**30})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert "max_completion_tokens=" in r.json()["error"]["message"]


def test_null_means_the_default_where_openai_allows_null(server, expected):
    """Clients that send every field, null where unset (n, stream, the penalties, echo, chat's
    logprobs are nullable in OpenAI's API), get the defaults' answer, not a 400; null stays a
    400 for fields OpenAI does not make nullable."""
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None}
    r = httpx.post(server.url + C, timeout=60, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 16,
                                                     "temperature": 0, "ignore_eos": True, "echo": None,
                                                     "logprobs": None, **nulls})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(server.url + CH, timeout=60, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4, "logprobs": None, **nulls})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    r = httpx.post(server.url + C, timeout=30, json={"model": "tiny", "prompt": "x", "ignore_eos": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text


@pytest.mark.parametrize("raw", [b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                                 b'{"model": "tiny", "prompt": "x", "top_p": Infinity}',
                                 b'{"model": "tiny", "prompt": "x", "presence_penalty": -Infinity}'])
def test_non_finite_json_numbers_are_400(server, raw):
    r = httpx.post(server.url + C, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_extreme_but_valid_values_are_answered(server, expected):
    for extra in ({"top_k": 2**70, "temperature": 1.0}, {"seed": 2**64, "temperature": 1.0},
                  {"seed": -(2**70), "temperature": 0.5}, {"user": "someone", "store": False, "metadata": {}}):
        r = httpx.post(server.url + C, timeout=30, json={"model": "tiny", "prompt": "x", "max_tokens": 4, **extra})
        assert r.status_code == 200, (extra, r.text)
    same = [httpx.post(server.url + C, timeout=30, json={"model": "tiny", "prompt": "x", "max_tokens": 8,
                                                          "seed": 2**64 + 3, "temperature": 1.0}).json()
            ["choices"][0]["text"] for _ in range(2)]
    assert same[0] == same[1]
    assert good(server) == expected


def _inject(server, marker_seed: int, after: int = 0, first_step_seed: int | None = None):
    """Fault injection: sampling raises for any request whose seed is ``marker_seed`` once it has
    ``after`` tokens, and for one with ``first_step_seed`` at once."""
    def fault(reqs):
        if any((r.params.seed == marker_seed and len(r.output_ids) >= after) or
               (first_step_seed is not None and r.params.seed == first_step_seed) for r in reqs):
            raise RuntimeError("injected sampling fault")
    engine_of(server).fault_injector = fault


def _sse(lines) -> tuple[list[dict], bool]:
    chunks, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
        else:
            chunks.append(json.loads(line[6:]))
    return chunks, done


@pytest.mark.parametrize("others", [1, 4, 15])
def test_engine_failure_of_one_request_spares_the_others(server, expected, others):
    """One request's sampling raises mid-batch (speculation on): it alone gets a JSON 500 (or an
    error chunk, finish_reason "error" and [DONE] when streaming); every other stream finishes
    with its normal text, finish_reason and [DONE]. A stream that fails in its first step gets a
    JSON 500 too (the status line has not gone out yet)."""
    _inject(server, 666, after=3, first_step_seed=667)
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as h:
                async def stream(body):
                    async with h.stream("POST", server.url + C, json=body) as r:
                        return r.status_code, _sse([ln async for ln in r.aiter_lines()])
                normal = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                          "stream": True}
                bad = {"model": "tiny", "prompt": "x", "max_tokens": 16, "temperature": 1.0, "seed": 666}
                return await asyncio.gather(h.post(server.url + C, json=bad), stream({**bad, "stream": True}),
                                            h.post(server.url + C, json={**bad, "seed": 667, "stream": True}),
                                            *[stream(normal) for _ in range(others)])
        bad_plain, (code, (bad_chunks, bad_done)), first_step, *rest = asyncio.run(main())
    finally:
        engine_of(server).fault_injector = None
    assert bad_plain.status_code == 500
    assert bad_plain.json()["error"]["type"] == "server_error"
    assert "injected sampling fault" in bad_plain.json()["error"]["message"]
    assert first_step.status_code == 500 and first_step.json()["error"]["code"] == "engine_error"
    assert code == 200 and bad_done
    assert bad_chunks[-1]["choices"][0]["finish_reason"] == "error" and "error" in bad_chunks[-1]
    for code, (chunks, done) in rest:
        assert code == 200 and done
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert idle(server, 5) and good(server) == expected


def test_unhandled_server_error_is_json_500(server, expected, monkeypatch):
    from leapfrog.entrypoints.openai import serving as serving_mod

    def boom(self, req):
        raise KeyError("a bug")
    monkeypatch.setattr(serving_mod.OpenAIServing, "chat_prompt", boom)
    r = httpx.post(server.url + CH, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    monkeypatch.undo()
    assert good(server) == expected


def test_non_streaming_client_that_gives_up_is_aborted_within_a_second(server):
    eng = engine_of(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 230, "temperature": 0, "ignore_eos": True,
            "speculative": {"num_speculative_tokens": 0}}
    real = eng.runner.step

    def slow(chunks, **kw):  # ~20 ms a step, so 230 tokens take seconds
        time.sleep(0.02)
        return real(chunks, **kw)
    eng.runner.step = slow
    try:
        for _ in range(8):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + C, json=body, timeout=httpx.Timeout(10, read=0.3))
        t0 = time.time()
        assert idle(server, 1.5), f"{len(eng.requests)} requests still running"
        assert time.time() - t0 < 1.5
    finally:
        eng.runner.step = real


def test_chunked_body_cannot_bypass_the_limit(server, expected):
    """A 10 MiB body with no content-length (Transfer-Encoding: chunked) is counted while it is
    read and refused with 413 once it passes 4 MiB; the app never sees it."""
    def body():
        for _ in range(10 * 1024):
            yield b" " * 1024
    try:
        r = httpx.post(server.url + C, content=body(), headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    except httpx.TransportError:
        pass  # the server may answer and close before the client finished sending
    assert good(server) == expected


def test_a_body_that_stalls_gets_408_and_hurts_nobody(server, expected, monkeypatch):
    """A client that sends its headers and part of its body, then nothing, is answered 408 (JSON)
    once BODY_TIMEOUT_S pass without a byte; requests meanwhile and after are answered."""
    from leapfrog.entrypoints.openai import api_server
    monkeypatch.setattr(api_server, "BODY_TIMEOUT_S", 1.0)
    with socket.create_connection((server.host, server.port), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        t0 = time.time()
        assert good(server) == expected   # (while the stalled body waits)
        reply = b""
        while b"}}" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert 0.9 < time.time() - t0 < 15
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert b"connection: close" in head.lower()   # (the server closes it: no keep-alive after a 408)
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert good(server) == expected


def test_a_body_that_keeps_coming_slowly_is_read(server, expected, monkeypatch):
    """The body timeout is per part: a body sent a few bytes at a time, each part well within
    BODY_TIMEOUT_S but the whole longer than it, is read and answered."""
    from leapfrog.entrypoints.openai import api_server
    monkeypatch.setattr(api_server, "BODY_TIMEOUT_S", 1.0)
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                       "ignore_eos": True}).encode()
    parts = [body[i:i + len(body) // 5 + 1] for i in range(0, len(body), len(body) // 5 + 1)]

    def slowly():
        for part in parts:
            time.sleep(0.4)
            yield part
    t0 = time.time()
    r = httpx.post(server.url + C, content=slowly(), timeout=30,
                   headers={"content-type": "application/json", "content-length": str(len(body))})
    assert time.time() - t0 > 1.5   # (longer than the timeout in all)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected


def test_queue_bound(llama_dir):
    """A request that can never fit the waiting bound is a 400; one that cannot fit now is a 503."""
    with make_server(llama_dir, max_num_seqs=1, max_waiting=4) as s:
        r = httpx.post(s.url + C, json={"model": "tiny", "prompt": "x", "n": 5, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"

        async def main():
            async with httpx.AsyncClient(timeout=60) as h:
                body = {"model": "tiny", "prompt": "x", "max_tokens": 60, "ignore_eos": True, "n": 3}
                return await asyncio.gather(*[h.post(s.url + C, json=body) for _ in range(4)])
        codes = sorted(r.status_code for r in asyncio.run(main()))
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=3).choices[0].finish_reason


def test_server_without_tokenizer(llama_dir):
    """--skip-tokenizer-init: token-id prompts work; text, chat and stop strings are clear 400s."""
    from leapfrog.config import EngineConfig
    from leapfrog.engine.engine import LLMEngine
    from leapfrog.entrypoints.cli import build_parser
    from leapfrog.entrypoints.openai.api_server import build_app
    from leapfrog.entrypoints.openai.server_thread import ServerThread
    assert build_parser().parse_args(["serve", str(llama_dir), "--skip-tokenizer-init"]).skip_tokenizer_init
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", max_model_len=64, skip_tokenizer_init=True))
    with ServerThread(build_app(engine, "tiny")) as s:
        r = httpx.post(s.url + C, json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        for path, body, what in [(C, {"prompt": "text"}, "tokenizer"), (C, {"prompt": [1, 2], "stop": "x"}, "stop"),
                                 (CH, {"messages": [{"role": "user", "content": "x"}]}, "chat template")]:
            r = httpx.post(s.url + path, json={"model": "tiny", **body})
            assert r.status_code == 400 and what in r.json()["error"]["message"], r.text


def test_clients_that_leave_before_their_first_token_are_aborted(server):
    """Slow steps (0.4 s) and a busy engine: clients (streaming or not) that give up while their
    add is still queued, or before their first token, leave nothing running behind them."""
    eng = engine_of(server)
    real = eng.runner.step

    def slow(chunks, **kw):
        time.sleep(0.4)
        return real(chunks, **kw)
    eng.runner.step = slow
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as h:
                busy = asyncio.ensure_future(h.post(server.url + C, json={
                    "model": "tiny", "prompt": "x", "max_tokens": 6, "ignore_eos": True}))
                await asyncio.sleep(0.1)   # the engine is mid-step from now on
                quick = httpx.Timeout(10, read=0.15)
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}

                async def leave(stream: bool):
                    try:
                        if stream:
                            async with h.stream("POST", server.url + C, json={**body, "stream": True},
                                                timeout=quick) as r:
                                async for _ in r.aiter_lines():
                                    pass
                        else:
                            await h.post(server.url + C, json=body, timeout=quick)
                    except httpx.ReadTimeout:
                        return True
                    return False
                gave_up = await asyncio.gather(*[leave(i % 2 == 0) for i in range(6)])
                assert all(gave_up)
                assert (await busy).status_code == 200
        asyncio.run(main())
        assert idle(server, 2.0), f"{sorted(eng.requests)} still running"
    finally:
        eng.runner.step = real
