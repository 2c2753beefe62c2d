"""Schema fuzzing of the OpenAI server (slow): schemathesis generates requests from the app's own
OpenAPI schema (/openapi.json, written by FastAPI from the pydantic request models), both valid
(positive) and schema-violating (negative) ones, and sends them to the ASGI app in-process.

Properties, for every generated request:
  * no 5xx status, and no exception escaping the app (with the in-process transport a handler's
    exception, or one raised while a stream is being sent, reaches the caller instead of becoming a
    500 or a silently cut stream);
  * every error response is JSON in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``;
and after the run the server still answers a fixed greedy request exactly as before it, with no
request left running and no KV cache left in use.

Bounded and reproducible: Hypothesis is derandomized (its seed comes from the test, no example
database), each operation has a fixed number of examples, the engine's context is small
(max_model_len=64, so accepted max_tokens stay small), every request has a read timeout, and the
in-process transport cuts an event stream after a few events (schemathesis' max_stream_events), so
``"stream": true`` cases are fuzzed too without hanging. A soft time budget stops starting new
cases if the machine is much slower than expected (reported as a warning, never a silent pass of a
failing case: once a case has failed, every case runs).
"""

from __future__ import annotations

import logging
import time
import traceback
import warnings

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup

from leapfrog.config import EngineConfig
from leapfrog.engine.engine import LLMEngine
from leapfrog.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
MAX_MODEL_LEN = 64
TIMEOUT_S = 30  # per request; a non-streaming request still running then fails as a hang
BUDGET_S = 150  # soft budget for generating new cases (the whole test stays under ~3 minutes)

# (method, path, generation mode, examples). Operations without parameters (the GETs) have a
# single possible request, so Hypothesis stops after it.
PLAN = [
    ("GET", "/health", GenerationMode.POSITIVE, 5),
    ("GET", "/v1/models", GenerationMode.POSITIVE, 5),
    ("GET", "/v1/models/{model}", GenerationMode.POSITIVE, 10),
    ("GET", "/metrics", GenerationMode.POSITIVE, 5),
    ("GET", "/version", GenerationMode.POSITIVE, 5),
    ("POST", "/tokenize", GenerationMode.POSITIVE, 30),
    ("POST", "/tokenize", GenerationMode.NEGATIVE, 15),
    ("POST", "/detokenize", GenerationMode.POSITIVE, 30),
    ("POST", "/detokenize", GenerationMode.NEGATIVE, 15),
    ("POST", "/v1/completions", GenerationMode.POSITIVE, 150),
    ("POST", "/v1/completions", GenerationMode.NEGATIVE, 75),
    ("POST", "/v1/chat/completions", GenerationMode.POSITIVE, 150),
    ("POST", "/v1/chat/completions", GenerationMode.NEGATIVE, 75),
]

# Explicit cases sent before the fuzzing, under the same checks: input the generator cannot or rarely
# produces (lone surrogates), and edges found by hand (sizes, extreme numbers) that must stay 2xx/4xx.
_C, _CH = "/v1/completions", "/v1/chat/completions"
_MSG = [{"role": "user", "content": "hi"}]
SEEDS = [
    (_C, {"prompt": "\ud800"}),
    (_C, {"prompt": ["ok", "\udc00"], "stream": True}),
    (_C, {"prompt": "x", "model": "\ud800"}),
    (_C, {"prompt": "x", "stop": "\ud800", "stream": True, "max_tokens": 4}),
    (_CH, {"messages": [{"role": "user", "content": "\ud800"}]}),
    (_CH, {"messages": _MSG, "model": "tiny\ud800"}),
    (_C, {"prompt": ["x"] * 20, "n": 16, "max_tokens": 1}),
    (_C, {"prompt": "x", "n": 16, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 3}),
    (_C, {"prompt": "x", "seed": 2**64, "top_k": 2**70, "max_tokens": 2}),
    (_C, {"prompt": "x", "temperature": 5e-324, "top_p": 5e-324, "max_tokens": 2}),
    (_C, {"prompt": [True, 1], "max_tokens": 2}),
    (_CH, {"messages": _MSG, "n": 4, "stream": True, "stop": ["a"], "max_tokens": 8}),
]

GREEDY = {"model": "tiny", "prompt": "def foo(x):\n    return", "max_tokens": 16, "temperature": 0,
          "ignore_eos": True}
GREEDY_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "write a loop"}], "max_tokens": 12,
               "temperature": 0, "ignore_eos": True}


LONE_SURROGATE = "\ud800"  # a valid JSON escape, but not a valid Unicode character


def _poison(x):
    if isinstance(x, str):
        return x + LONE_SURROGATE
    if isinstance(x, list):
        return [_poison(v) for v in x]
    if isinstance(x, dict):
        return {k: _poison(v) if k in ("text", "content") else v for k, v in x.items()}
    return x


def focus(body, knobs: tuple[bool, bool, int], vocab: int):
    """Steer the valid (positive) cases. Half of them are taken past the first 400s into the engine
    (the served model's name, max_tokens that fit the context, token ids inside the vocabulary), and
    half of those are streamed: random valid data alone rarely gets that far (a random ``model``
    string is refused). A quarter of all get a lone UTF-16 surrogate appended to their text fields
    (model, prompt, message contents, stop): JSON can carry one, schemathesis never generates one."""
    on, stream, poison = knobs
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if on:
        if isinstance(body.get("model"), str):
            body["model"] = "tiny"
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(k), int) and not isinstance(body[k], bool) and body[k] > MAX_MODEL_LEN // 4:
                body[k] = 1 + body[k] % (MAX_MODEL_LEN // 4)
        p = body.get("prompt")
        if isinstance(p, list):
            body["prompt"] = [[abs(t) % vocab for t in x] if isinstance(x, list) else
                              abs(x) % vocab if isinstance(x, int) and not isinstance(x, bool) else x for x in p]
        if stream:
            body["stream"] = True
    if poison == 3:
        for k in ("model", "prompt", "messages", "stop"):
            if k in body:
                body[k] = _poison(body[k])
    return body


def openai_error_shape(ctx, response, case) -> None:
    """A schemathesis check: an error status comes with an OpenAI-shaped JSON error body."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except Exception:  # noqa: BLE001
        raise AssertionError(f"{response.status_code} error body is not JSON: {response.text[:200]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, \
        f"{response.status_code} error body is not OpenAI-shaped: {body!r}"[:500]
    assert isinstance(err["message"], str) and err["message"], f"error.message: {err!r}"
    assert isinstance(err["type"], str) and err["type"], f"error.type: {err!r}"
    assert err["param"] is None or isinstance(err["param"], str), f"error.param: {err!r}"


@pytest.fixture(scope="module")
def app(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN,
                                    max_num_seqs=8, speculative_config=SPEC))
    app = build_app(engine, "tiny")
    yield app
    # schemathesis' in-process transport starts the app's lifespan (the engine thread) on first use and
    # keeps it for the process (until exit); end it here so the engine thread stops with this module.
    from schemathesis.python import asgi
    shutdown = getattr(asgi, "shutdown_lifespans", None)  # not a documented API: fall back to the engine
    if shutdown is not None:
        shutdown()
    else:
        app.state.engine.shutdown()


@pytest.fixture(scope="module")
def schema(app):
    # an explicit config (no schemathesis.toml is looked up); failure reports show the real bodies (by
    # default fields such as max_tokens are shown as "[Filtered]", like secrets)
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=config)


def call(schema, method: str, path: str, body=None):
    op = schema[path][method]
    case = op.Case(body=body) if body is not None else op.Case()
    return case.call(timeout=TIMEOUT_S)


def greedy_outputs(schema) -> tuple[str, str]:
    r = call(schema, "POST", "/v1/completions", GREEDY)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    r = call(schema, "POST", "/v1/chat/completions", GREEDY_CHAT)
    assert r.status_code == 200, r.text
    return text, r.json()["choices"][0]["message"]["content"]


def engine_idle(schema, timeout: float = 15.0) -> dict[str, float]:
    """Wait until no request is running or waiting and the KV cache is empty; return the gauges."""
    deadline = time.monotonic() + timeout
    while True:
        text = call(schema, "GET", "/metrics").text
        gauges = {}
        for line in text.splitlines():
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                if line.startswith((f"leapfrog:{name}{{", f"leapfrog:{name} ")):
                    gauges[name] = float(line.rsplit(" ", 1)[1])
        if (len(gauges) == 3 and all(v == 0 for v in gauges.values())) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)


def describe(header: str, e: BaseException, keep: int = 40) -> str:
    """A failure for the report: schemathesis' own report (status, body, curl) for a failed check,
    else the innermost frames, the error and the curl line; each of Hypothesis' distinct bugs apart."""
    if isinstance(e, BaseExceptionGroup) and not isinstance(e, FailureGroup):
        return "\n\n".join(describe(f"{header} [{i + 1}/{len(e.exceptions)}]", sub, keep)
                             for i, sub in enumerate(e.exceptions))
    if isinstance(e, FailureGroup):
        lines = [str(e).rstrip()] + [n.rstrip() for n in getattr(e, "__notes__", [])]
    else:
        lines = "".join(traceback.format_exception(e)).splitlines()
        if len(lines) > keep:
            lines = ["  ..."] + lines[-keep:]
    return "\n".join([f"===== {header}"] + lines)


def send_seed(schema, path: str, body) -> str | None:
    """One explicit case under the fuzz checks; -> a failure report, or None."""
    case = schema[path]["POST"].Case(body=body)
    try:
        response = case.call(timeout=TIMEOUT_S)
        case.validate_response(response, checks=[not_a_server_error, openai_error_shape])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - schemathesis' FailureGroup is a BaseExceptionGroup
        return describe(f"seed POST {path} {body!r}", e)
    return None


def fuzz(op, mode: GenerationMode, examples: int, end: float, stats: dict, vocab: int) -> None:
    """Run ``examples`` derandomized cases of one operation; raises Hypothesis' (shrunk) failure."""
    failed = False
    steer = mode == GenerationMode.POSITIVE and op.method.upper() == "POST"

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(case=op.as_strategy(generation_mode=mode),
           knobs=st.tuples(st.booleans(), st.booleans(), st.integers(0, 3)) if steer
           else st.just((False, False, 0)))
    def run(case, knobs):
        nonlocal failed
        if not failed and time.monotonic() > end:
            stats["skipped"] += 1
            return
        stats["cases"] += 1
        try:
            if steer:
                case.body = focus(case.body, knobs, vocab)
            response = case.call(timeout=TIMEOUT_S)
            case.validate_response(response, checks=[not_a_server_error, openai_error_shape])
        except BaseException:
            failed = True
            raise

    run()


def test_fuzz_openai_schema(app, schema, tokenizer, caplog):
    # the server logs each unhandled error with its traceback; shrinking repeats them hundreds of
    # times, and the report below already holds each distinct one
    caplog.set_level(logging.CRITICAL, logger="leapfrog.server")
    before = greedy_outputs(schema)
    # the schema covers every route the server has, so a new route is fuzzed (or this fails) too
    ops = {(r.ok().method.upper(), r.ok().path) for r in schema.get_all_operations()}
    assert ops == {(m, p) for m, p, _, _ in PLAN}, ops

    t0 = time.monotonic()
    end = t0 + BUDGET_S
    stats = {"cases": 0, "skipped": 0}
    failures = [f for path, body in SEEDS if (f := send_seed(schema, path, body)) is not None]
    for method, path, mode, examples in PLAN:
        try:
            fuzz(schema[path][method], mode, examples, end, stats, len(tokenizer))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - every operation is fuzzed; all failures are reported
            failures.append(describe(f"fuzz {method} {path} ({mode.value})", e))
    elapsed = time.monotonic() - t0
    if stats["skipped"]:
        warnings.warn(f"fuzz budget of {BUDGET_S}s ran out: {stats['skipped']} cases skipped "
                      f"({stats['cases']} ran in {elapsed:.0f}s)", stacklevel=1)

    # the server is still sound: same greedy outputs, nothing left running, no KV leaked
    gauges = engine_idle(schema)
    after = greedy_outputs(schema)
    problems = list(failures)
    if after != before:
        problems.append(f"greedy outputs changed by the fuzz run: {before!r} -> {after!r}")
    if len(gauges) != 3 or any(v != 0 for v in gauges.values()):
        problems.append(f"engine not idle after the fuzz run: {gauges}")
    assert not problems, (f"{len(problems)} problem(s) after {len(SEEDS)} seeds and {stats['cases']} fuzz requests "
                          f"(shrinking included) in {elapsed:.0f}s:\n\n"
                          + "\n\n".join(problems))
