"""The OpenAI-compatible server, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from leapfrog import LLM, SamplingParams
from tests.entrypoints.openai.conftest import make_server

PROMPTS = ["def foo(x):\n    return", "import os\nimport", "class A:\n    def", "for i in range(",
           "x = [1, 2, 3]\n", "while True:\n    ", "# comment\n", "print("]


@pytest.fixture(scope="module")
def reference(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256)


def ref_text(reference, prompt, n=24):
    return reference.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def test_completion_equals_offline_generate(server, reference):
    c = client(server)
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref_text(reference, PROMPTS[0])
    assert r.choices[0].finish_reason == "length"
    u = r.usage.model_dump()
    assert u["completion_tokens"] == 24 and u["prompt_tokens"] > 0
    spec = u["speculative"]
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
    assert set(spec) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                         "mean_acceptance_length"}


def test_completion_stream_and_usage(server, reference):
    c = client(server)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == ref_text(reference, PROMPTS[1])
    assert chunks[-1].usage.completion_tokens == 24
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat_stream_and_not(server, reference):
    c = client(server)
    msgs = [{"role": "user", "content": "write a loop"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    prompt_ids = reference.get_tokenizer().apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    expected = reference.generate({"prompt_token_ids": list(prompt_ids)},
                                  SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(parts) == expected


def test_stop_strings_never_streamed_past(server, reference):
    full = ref_text(reference, PROMPTS[2], 30)
    stop = full[12:15]
    c = client(server)
    chunks = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop],
                                  stream=True, extra_body={"ignore_eos": True})
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full[:full.index(stop)]


def test_n_and_sampling_fields(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=8, temperature=1.0, n=3, seed=1,
                             top_p=0.9, presence_penalty=0.5, frequency_penalty=0.1,
                             extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
    assert len(r.choices) == 3 and [ch.index for ch in r.choices] == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 24
    assert len({ch.text for ch in r.choices}) > 1  # choices are sampled independently


def test_a_requests_choices_share_one_prepare_on_the_tokenizer_thread(server, monkeypatch):
    """The params of a request's prompts x n choices are checked and their lists built once
    (``LLMEngine.prepare``), on the tokenizer's thread: per choice, on the event loop and then
    the engine's thread, a 4 MiB body's 400k stop ids cost ~90 ms a choice (23 s for n = 256)
    that every other stream waited through. Choice i is the request seeded with seed + i. Its
    100k ids count as 100k characters: the long texts' thread, short prompts not queued behind."""
    import threading
    eng = server.app.state.engine.engine
    real, threads = eng.prepare, []
    monkeypatch.setattr(eng, "prepare", lambda p: threads.append(threading.current_thread().name) or real(p))
    c = client(server)
    kw = dict(model="tiny", max_tokens=6, temperature=1.0, seed=5, stop=["\n\n"])
    ids = list(range(20, 40)) * 5_000
    r = c.completions.create(prompt=[PROMPTS[0], PROMPTS[1]], n=3, **kw,
                             extra_body={"ignore_eos": True, "stop_token_ids": ids, "bad_words": ["zqxv"]})
    assert threads == ["leapfrog-tokenize-long"], threads
    for j, p in enumerate(PROMPTS[:2]):
        for i in range(3):
            one = c.completions.create(prompt=p, n=1, **{**kw, "seed": 5 + i},
                                       extra_body={"ignore_eos": True, "stop_token_ids": ids, "bad_words": ["zqxv"]})
            assert r.choices[3 * j + i].text == one.choices[0].text


def test_per_request_speculation_control(server):
    c = client(server)
    off = c.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=20, temperature=0,
                               extra_body={"ignore_eos": True, "speculative": {"num_speculative_tokens": 0}})
    on = c.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=20, temperature=0,
                              extra_body={"ignore_eos": True, "speculative": {"num_speculative_tokens": 2}})
    assert off.usage.model_dump()["speculative"]["num_draft_tokens"] == 0
    s = on.usage.model_dump()["speculative"]
    assert s["num_draft_tokens"] <= 2 * s["num_drafts"]
    assert off.choices[0].text == on.choices[0].text


def test_32_concurrent_streams_equal_alone(server, reference):
    async def one(c, i):
        prompt = PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        return prompt, text

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*[one(c, i) for i in range(32)])

    results = asyncio.run(main())
    for prompt, text in results:
        assert text == ref_text(reference, prompt, 20), prompt


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_disconnect_frees_kv(server):
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions",
                      json={"model": "tiny", "prompt": PROMPTS[5], "max_tokens": 200, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break
        deadline = time.time() + 10
        while time.time() < deadline:
            m = metric_values(server.url)
            if m[("leapfrog:kv_cache_usage_perc", ())] == 0 and m[("leapfrog:num_requests_running", ())] == 0:
                break
            time.sleep(0.05)
        assert m[("leapfrog:kv_cache_usage_perc", ())] == 0
        assert m[("leapfrog:num_requests_running", ())] == 0
        assert m[("leapfrog:request_success_total", (("finished_reason", "abort"),))] >= 1


BAD = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x " * 400, "max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "speculative": {"num_speculative_tokens": 99}}, 400,
     "speculative"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "speculative": {"num_speculative_tokens": -1}}, 400,
     "speculative"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_4xx_error_shape(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert param in (err["param"] or "") + err["message"]


def test_transport_level_errors_and_recovery(server, reference):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    for body, kind in ((b"hello", "text/plain"), (b"[1, 2]", "application/json")):   # not a JSON object
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": kind})
        assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"], r.text
    assert httpx.head(server.url + "/health").status_code == 200   # (load balancers' probes)
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (5 * 1024 * 1024),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()
    # the server still answers normally
    r = client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref_text(reference, PROMPTS[0])
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_metrics_counters_match_usage(llama_dir):
    with make_server(llama_dir) as s:
        c = client(s)
        total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        prompt_tokens = 0
        for p in PROMPTS[:4]:   # not streamed: the engine measures inter-token latency itself
            r = c.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True})
            for k in total:
                total[k] += r.usage.model_dump()["speculative"][k]
            prompt_tokens += r.usage.prompt_tokens
        for bad in ({"prompt": "x", "max_tokens": 4, "n": 999}, {"prompt": "x" * 5000, "max_tokens": 4},
                    {"prompt": "x", "max_tokens": 4, "temprature": 1}):   # refused: not in the params family
            assert httpx.post(s.url + "/v1/completions", json={"model": "tiny", **bad}, timeout=30).status_code == 400
        m = metric_values(s.url)
        # vLLM's request families: token histograms, phases, params; the step family's tokens add up
        assert m[("leapfrog:request_generation_tokens_sum", ())] == 120
        assert m[("leapfrog:request_prompt_tokens_sum", ())] == prompt_tokens
        assert m[("leapfrog:iteration_tokens_total_sum", ())] == prompt_tokens + 120
        assert m[("leapfrog:request_params_max_tokens_sum", ())] == 120
        assert m[("leapfrog:request_params_n_count", ())] == 4
        for phase in ("queue", "prefill", "decode", "inference"):
            assert m[(f"leapfrog:request_{phase}_time_seconds_count", ())] == 4
        assert m[("leapfrog:request_inference_time_seconds_sum", ())] == pytest.approx(
            m[("leapfrog:request_prefill_time_seconds_sum", ())] + m[("leapfrog:request_decode_time_seconds_sum", ())])
        assert m[("leapfrog:request_time_per_output_token_seconds_count", ())] == 4
        # one interval per verify step after the first token: between 30/(K+1) - 1 and 29 per request
        itl = m[("leapfrog:inter_token_latency_seconds_count", ())]
        assert 4 * (30 // 5 - 1) <= itl <= 4 * 29
        assert total["num_draft_tokens"] > 0
        for k, v in total.items():
            assert m[(f"leapfrog:spec_decode_{k}_total", ())] == v
        per_pos = sum(v for (name, _), v in m.items() if name == "leapfrog:spec_decode_num_accepted_tokens_per_pos_total")
        assert per_pos == total["num_accepted_tokens"]
        assert m[("leapfrog:time_to_first_token_seconds_count", ())] == 4
        # n > 1 (README): every choice is an engine request with its own prefill; usage counts the
        # prompt once, request_params_* count the API request once
        r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, n=3,
                                 extra_body={"ignore_eos": True})
        m2 = metric_values(s.url)
        grew = {k: m2[(k, ())] - m[(k, ())] for k in (
            "leapfrog:prompt_tokens_total", "leapfrog:request_prompt_tokens_sum",
            "leapfrog:request_prompt_tokens_count", "leapfrog:request_params_n_count",
            "leapfrog:request_params_n_sum", "leapfrog:generation_tokens_total")}
        assert grew == {"leapfrog:prompt_tokens_total": 3 * r.usage.prompt_tokens,
                        "leapfrog:request_prompt_tokens_sum": 3 * r.usage.prompt_tokens,
                        "leapfrog:request_prompt_tokens_count": 3, "leapfrog:request_params_n_count": 1,
                        "leapfrog:request_params_n_sum": 3, "leapfrog:generation_tokens_total": 15}, grew
        assert r.usage.completion_tokens == 15


def test_api_key(llama_dir):
    with make_server(llama_dir, api_key="sekret") as s:
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 401
        r = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(s, api_key="wrong").models.list()
        assert client(s, api_key="sekret").models.list().data[0].id == "tiny"


def test_overload_gets_503(llama_dir):
    with make_server(llama_dir, max_num_seqs=1, max_waiting=1) as s:
        async def main():
            async with httpx.AsyncClient(timeout=60) as h:
                body = {"model": "tiny", "prompt": "x", "max_tokens": 60, "ignore_eos": True}
                return await asyncio.gather(*[h.post(s.url + "/v1/completions", json=body) for _ in range(8)])
        codes = [r.status_code for r in asyncio.run(main())]
        assert 200 in codes and 503 in codes
        assert set(codes) <= {200, 503}
