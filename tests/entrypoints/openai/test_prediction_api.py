"""Predicted outputs through the official openai client (its typed ``prediction`` parameter) on a
server configured for suffix decoding: equal outputs, OpenAI's usage fields, 400s for bad
predictions, and the suffix cache's size in /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.conftest import greedy_text, make_server

PROMPT = "def foo(x):\n    return"


@pytest.fixture(scope="module")
def server(llama_dir):
    with make_server(llama_dir, spec={"method": "suffix", "num_speculative_tokens": 8}) as s:
        yield s


@pytest.fixture(scope="module")
def ref(llama_dir):
    return greedy_text(llama_dir, PROMPT, 32)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_completion_with_prediction_usage(server, ref):
    c = client(server)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0,
                             extra_body={"ignore_eos": True, "prediction": {"type": "content", "content": ref}})
    assert r.choices[0].text == ref
    d = r.usage.completion_tokens_details
    assert d.accepted_prediction_tokens > 0
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens >= 1
    assert r.usage.model_dump()["speculative"]["num_accepted_tokens"] > 0


def test_chat_with_typed_prediction_parts(server):
    c = client(server)
    plain = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None   # no prediction, no prediction counts
    half = len(text) // 2
    r = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=0,
        prediction={"type": "content", "content": [{"type": "text", "text": text[:half]},
                                                   {"type": "text", "text": text[half:]}]},
        extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == text
    assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize("prediction, why", [
    ("just a string", "prediction"),
    ({"type": "file", "content": "x"}, "prediction"),
    ({"type": "content", "content": 5}, "prediction"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}, "prediction"),
    ({"type": "content", "content": "word " * 400}, "new tokens fit"),
])
def test_bad_predictions_get_400(server, prediction, why):
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "prediction": prediction}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert why in err["message"] or why == err.get("param") or why in str(err)
    if why == "new tokens fit":   # the engine's check names the field (RequestError.param)
        assert err["param"] == "prediction"
    # the server still answers
    ok = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200


def test_suffix_cache_in_metrics(server):
    c = client(server)
    for _ in range(2):
        c.completions.create(model="tiny", prompt="import os\nimport", max_tokens=16, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    vals = {s.labels["quantity"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "leapfrog:suffix_cache"}
    assert vals["requests"] >= 2 and vals["tokens"] > 0 and vals["nodes"] > 0 and vals["bytes"] > 0


def test_text_predictions_tokenize_off_the_engine_thread(server, ref, monkeypatch):
    """A text prediction (up to the 4 MiB body) is tokenized on the tokenizer's thread, as the
    prompt is: in the engine's add_request it stalled every running request while it tokenized."""
    import threading
    eng = server.app.state.engine.engine
    real, threads = eng.encode_prediction, []
    monkeypatch.setattr(eng, "encode_prediction",
                        lambda text: threads.append(threading.current_thread().name) or real(text))
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0,
                                          extra_body={"ignore_eos": True,
                                                      "prediction": {"type": "content", "content": ref}})
    assert r.choices[0].text == ref and r.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert threads == ["leapfrog-tokenize"], threads
