"""Issue 14's API through a `leapfrog serve` subprocess (as a vLLM client meets it), with the
official openai client: logprobs, echo, structured outputs, logit_bias, tokenization, errors,
usage details and the metric families."""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest

from tests.entrypoints.openai.test_serve_cli import free_port, start_serve

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


@pytest.fixture(scope="module")
def served(llama_dir):
    port = free_port()
    proc = start_serve([str(llama_dir), "--dtype", "float32", "--served-model-name", "tiny",
                        "--speculative-config", SPEC, "--max-model-len", "256"], port)
    url = f"http://127.0.0.1:{port}"
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)


def test_api_through_a_subprocess(served):
    c = openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0)
    prompt = "def foo(x):\n    return"
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2, echo=True,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt) and len(lp.top_logprobs) == len(lp.tokens) > 8
    assert all(v <= 0 for v in lp.token_logprobs if v is not None)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    ch = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a number"}], max_tokens=40, temperature=0,
        logprobs=True, top_logprobs=1,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": False}}})
    assert isinstance(json.loads(ch.choices[0].message.content)["n"], int)
    assert ch.choices[0].logprobs.content
    ids = httpx.post(served + "/tokenize", json={"model": "tiny", "prompt": prompt}).json()["tokens"]
    assert httpx.post(served + "/detokenize", json={"model": "tiny", "tokens": ids}).json()["prompt"] == prompt
    first = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                 extra_body={"return_token_ids": True, "ignore_eos": True})
    t0 = first.choices[0].model_dump()["token_ids"][0]
    banned = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(t0): -100}, extra_body={"return_token_ids": True,
                                                                           "ignore_eos": True})
    assert banned.choices[0].model_dump()["token_ids"][0] != t0
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt=prompt, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt=prompt, max_tokens=2, best_of=3, n=1)
    assert httpx.get(served + "/version").status_code == 200
    text = httpx.get(served + "/metrics").text
    for family in ("leapfrog:request_queue_time_seconds", "leapfrog:iteration_tokens_total",
                   "leapfrog:inter_token_latency_seconds", "leapfrog:request_params_max_tokens",
                   "leapfrog:spec_decode_num_draft_tokens"):
        assert family in text
