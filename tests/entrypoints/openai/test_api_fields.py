"""The OpenAI/vLLM fields a client written for vLLM sends, through the official openai client
against a real server with speculation on (ngram): logprobs (completions and chat, streaming
and not, echo, prompt_logprobs), token rules, return_token_ids, truncation, usage details,
continuous usage stats, include_stop_str_in_output, 404 for an unknown model, /tokenize,
/detokenize, /version and /v1/models."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from leapfrog import LLM, SamplingParams

PROMPT = "def foo(x):\n    return"


@pytest.fixture(scope="module")
def reference(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def ref_out(reference, prompt, **kw):
    sp = SamplingParams(**{"temperature": 0, "max_tokens": 16, "ignore_eos": True, **kw})
    return reference.generate(prompt, sp, use_tqdm=False)[0]


def test_completion_logprobs_equal_offline_without_speculation(server, reference):
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    ch = r.choices[0]
    ref = ref_out(reference, PROMPT, logprobs=3)
    c = ref.outputs[0]
    assert ch.text == c.text and ch.model_extra["token_ids"] == c.token_ids
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
    joined = "".join(lp.tokens)
    assert joined == ch.text or "\ufffd" in joined   # a token that is part of a UTF-8 character decodes to U+FFFD
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(16)]
    for i, t in enumerate(c.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(c.logprobs[i][t].logprob, abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 3 and max(lp.top_logprobs[i].values()) == pytest.approx(
            lp.token_logprobs[i], abs=1e-4)   # greedy: the chosen token is the most likely
    assert ch.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_echo_with_logprobs_and_token_prompts_streaming_and_not(server, reference):
    c = client(server)
    ids = reference.get_tokenizer().encode(PROMPT)
    whole = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, echo=True, logprobs=1,
                                 extra_body={"ignore_eos": True})
    ch = whole.choices[0]
    ref = ref_out(reference, PROMPT, max_tokens=8)
    prompt_text = reference.get_tokenizer().decode(ids)
    assert ch.text == prompt_text + ref.outputs[0].text
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + 8 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    # the first prompt token has no logprob but has its text, and each offset is where its token starts
    assert lp.tokens[0] == reference.get_tokenizer().decode(ids[:1]) != ""
    n = len(ids)   # (the prompt is ASCII; the random model's output tokens can be partial UTF-8)
    assert "".join(lp.tokens[:n]) == prompt_text and lp.text_offset[1] == len(lp.tokens[0])
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, echo=True, logprobs=1,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(x.choices[0].text for x in chunks if x.choices) == ch.text
    streamed = [v for x in chunks if x.choices and x.choices[0].logprobs for v in x.choices[0].logprobs.token_logprobs]
    assert len(streamed) == len(lp.token_logprobs) and streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    offsets = [o for x in chunks if x.choices and x.choices[0].logprobs for o in x.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_chat_logprobs_streaming_and_not(server):
    c = client(server)
    msgs = [{"role": "user", "content": "write a loop"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                  top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    joined = "".join(e.token for e in content)
    assert len(content) == 12 and (joined == r.choices[0].message.content or "\ufffd" in joined)
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for x in chunks if x.choices and x.choices[0].logprobs for e in x.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)
    # without logprobs: none
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_prompt_logprobs(server, reference):
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ids = reference.get_tokenizer().encode(PROMPT)
    ref = ref_out(reference, PROMPT, max_tokens=2, prompt_logprobs=2).prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        assert plp[j][str(ids[j])]["logprob"] == pytest.approx(ref[j][ids[j]].logprob, abs=1e-4)
        assert plp[j][str(ids[j])]["rank"] == ref[j][ids[j]].rank


def test_prompt_logprobs_streamed(server):
    """Streamed, the prompt's logprobs come in chat's first chunk (they were once dropped there)
    and in each completion choice's first chunk, as the answers without streaming carry them."""
    c = client(server)
    msgs = [{"role": "user", "content": "hi"}]
    kw = dict(model="tiny", max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 1})
    full = c.chat.completions.create(messages=msgs, **kw).model_extra["prompt_logprobs"]
    chunks = list(c.chat.completions.create(messages=msgs, stream=True, **kw))
    assert [i for i, ch in enumerate(chunks) if "prompt_logprobs" in ch.model_extra] == [0]
    streamed = chunks[0].model_extra["prompt_logprobs"]
    assert streamed[0] is None and len(streamed) == len(full) > 1
    for a, b in zip(streamed[1:], full[1:]):
        assert a.keys() == b.keys() and all(a[t]["logprob"] == pytest.approx(b[t]["logprob"], abs=1e-5) for t in a)
    chunks = list(c.completions.create(prompt=[PROMPT, "x = 1"], stream=True, **kw))
    firsts = {}
    for ch in chunks:
        for choice in ch.choices:
            firsts.setdefault(choice.index, choice.model_extra.get("prompt_logprobs"))
    assert sorted(firsts) == [0, 1] and all(v is not None and v[0] is None for v in firsts.values())


def test_token_rules_and_truncation(server, reference):
    c = client(server)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={"42": 100},
                             extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [42] * 6
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.9, seed=1,
                             extra_body={"allowed_token_ids": [40, 41, 42], "return_token_ids": True})
    assert set(r.choices[0].model_extra["token_ids"]) <= {40, 41, 42}
    base = ref_out(reference, PROMPT, max_tokens=10)
    tok = reference.get_tokenizer()   # a generated token whose text tokenizes back to it
    word = next(w for t in base.outputs[0].token_ids
                if (w := tok.decode([t])).strip() and tok.encode(w, add_special_tokens=False) == [t])
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                             extra_body={"bad_words": [word], "ignore_eos": True})
    assert r.choices[0].text != base.outputs[0].text
    want = ref_out(reference, PROMPT, max_tokens=10, bad_words=[word])
    assert r.choices[0].text == want.outputs[0].text
    long = "x = 1\n" * 100
    r = c.completions.create(model="tiny", prompt=long, max_tokens=4, extra_body={"truncate_prompt_tokens": 20})
    assert r.usage.prompt_tokens == 20
    longer = "x = 1\n" * 200   # past max_model_len (256): -1 keeps what fits beside max_tokens
    r = c.completions.create(model="tiny", prompt=longer, max_tokens=6, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 256 - 6 and r.usage.completion_tokens == 6
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, best_of=2, temperature=1.0,
                             user="someone")
    assert len(r.choices) == 2


def test_bad_words_tokenize_off_the_engine_thread(server, reference, monkeypatch):
    """bad_words (up to the 4 MiB body: ~1 M words) are tokenized on the tokenizer's thread, as the
    prompt is: in the engine's add_request they stalled every running request while they tokenized.
    Many of them still ban what one of them bans."""
    import threading
    eng = server.app.state.engine.engine
    real, threads = eng.encode_bad_words, []
    monkeypatch.setattr(eng, "encode_bad_words",
                        lambda params: threads.append(threading.current_thread().name) or real(params))
    base = ref_out(reference, PROMPT, max_tokens=10)
    tok = reference.get_tokenizer()
    word = next(w for t in base.outputs[0].token_ids
                if (w := tok.decode([t])).strip() and tok.encode(w, add_special_tokens=False) == [t])
    many = [f"zq{i}xv" for i in range(20_000)] + [word]
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, n=2,
                                          extra_body={"bad_words": many, "ignore_eos": True})
    want = ref_out(reference, PROMPT, max_tokens=10, bad_words=[word]).outputs[0].text
    assert [c.text for c in r.choices] == [want, want]
    assert threads == ["leapfrog-tokenize-long"], threads   # (160k characters: the long lane; once for n = 2)


def test_bad_words_are_tokenized_after_admission_and_a_failure_frees_its_places(server, monkeypatch):
    """A request the queue can never take is refused before its bad words are tokenized (they can
    take seconds); one whose bad words cannot be tokenized gets its 400 and leaves no place held."""
    ae = server.app.state.engine
    calls = []
    real = ae.engine.encode_bad_words
    monkeypatch.setattr(ae.engine, "encode_bad_words", lambda p: calls.append(1) or real(p))
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ["a"] * 17, "n": 16,
                                                         "max_tokens": 2, "bad_words": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences" and not calls
    for stream in (False, True):
        body = json.dumps({"model": "tiny", "prompt": "a", "n": 2, "max_tokens": 2, "bad_words": ["ok", "\ud800"],
                           "stream": stream})   # (a lone surrogate, escaped: it cannot be tokenized)
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
        assert ae._pending == 0
    assert client(server).completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].text is not None

def test_many_stop_strings_are_indexed_off_the_engine_thread(server, reference, monkeypatch):
    """Stop strings are indexed (StopStrings) on the tokenizer's thread, not in the engine's
    add_request, once for a request's choices; 20k of them stop where the one that matches
    stops, streaming too."""
    import threading

    from leapfrog.engine import engine
    text = ref_out(reference, PROMPT, max_tokens=10).outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want = ref_out(reference, PROMPT, max_tokens=10, stop=[stop]).outputs[0]
    real, threads = engine.StopStrings, []
    monkeypatch.setattr(engine, "StopStrings",
                        lambda stops: threads.append(threading.current_thread().name) or real(stops))
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, n=2,
                                          stop=[f"zq{i}xv" for i in range(20_000)] + [stop], stream=True,
                                          extra_body={"ignore_eos": True})
    text, finish = ["", ""], [None, None]
    for chunk in r:
        for c in chunk.choices:
            text[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert text == [want.text] * 2 and finish == ["stop"] * 2 and want.finish_reason == "stop"
    assert threads == ["leapfrog-tokenize-long"], threads   # (once for n = 2)


def test_continuous_usage_and_stop_token_text(server, reference):
    c = client(server)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True}))
    with_choices = [x for x in chunks if x.choices]
    assert all(x.usage is not None for x in with_choices)
    counts = [x.usage.completion_tokens for x in with_choices]
    assert counts == sorted(counts) and counts[-1] == 8 and chunks[-1].usage.completion_tokens == 8
    # include_stop_str_in_output with a stop token: its text stays in the output (vLLM)
    base = ref_out(reference, PROMPT, max_tokens=8)
    tok = reference.get_tokenizer()
    ids = base.outputs[0].token_ids   # a stop token with whole characters for text
    i = next(i for i in range(1, 8) if ids[i] not in ids[:i] and tok.decode([ids[i]]).strip()
             and "\ufffd" not in tok.decode([ids[i]]))
    stop, texts = ids[i], []
    for include in (False, True):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                 extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": include,
                                             "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == ids[:i + 1] and r.choices[0].stop_reason == stop
        texts.append(r.choices[0].text)
        assert texts[-1] == ref_out(reference, PROMPT, max_tokens=8, stop_token_ids=[stop],
                                    include_stop_str_in_output=include).outputs[0].text
    assert len(texts[1]) > len(texts[0]) and texts[1].endswith(tok.decode([stop]).strip())


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nope", prompt="x", max_tokens=2)
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"model": "tiny\ud800", "prompt": "x"}),
                   headers={"content-type": "application/json"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_detokenize_and_token_strs_run_off_the_event_loop(server, monkeypatch):
    """/detokenize (a 4 MiB body holds ~1M ids: a second to decode) and /tokenize's token strings
    run on the tokenizer's thread: on the event loop they held every stream's chunks."""
    import threading
    tok, threads = server.app.state.engine.engine.tokenizer, []
    for name in ("decode", "convert_ids_to_tokens"):
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, real=real, **k: threads.append(threading.current_thread().name)
                            or real(*a, **k))
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()["tokens"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids * 20_000})   # (~2M characters: the long lane)
    assert r.status_code == 200 and r.json()["prompt"].startswith(PROMPT)
    assert threads == ["leapfrog-tokenize", "leapfrog-tokenize-long"], threads

def test_tokenize_detokenize_version_models(server, reference):
    tok = reference.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": PROMPT, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256 and len(body["token_strs"]) == body["count"]
    plain = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 0
    r = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert r.json()["prompt"] == tok.decode(body["tokens"])
    for bad in ({"tokens": [10**6]}, {"tokens": "x"}):
        assert httpx.post(server.url + "/detokenize", json=bad).status_code == 400
    for bad in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, {"prompt": "x", "oops": 1}):
        assert httpx.post(server.url + "/tokenize", json=bad).status_code == 400
    assert httpx.post(server.url + "/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    from leapfrog import __version__
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    m = client(server).models.list().data[0]
    assert m.id == "tiny" and m.model_extra["root"] and m.model_extra["max_model_len"] == 256
    assert client(server).models.retrieve("tiny").id == "tiny"   # GET /v1/models/{id}
    r = httpx.get(server.url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_structured_outputs(server):
    from tests.sampling.test_structured import SCHEMA, valid
    c = client(server)
    msgs = [{"role": "user", "content": "a user record"}]
    for seed in range(3):
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=64, temperature=0.8, seed=seed,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}})
        assert r.choices[0].finish_reason == "stop" and valid("json", r.choices[0].message.content)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=64, temperature=0,
                                  response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(text), dict)
    assert text.startswith("{")
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body={"structured_outputs": {
        "choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, extra_body={"guided_regex": "[ab]{3}-[0-9]"})
    assert re.fullmatch(r"[ab]{3}-[0-9]", r.choices[0].text)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, stream=True,
                                       extra_body={"guided_choice": ["left", "right"]}))
    assert "".join(x.choices[0].text for x in chunks if x.choices) in ("left", "right")
    for body, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                       "schema": {"type": "nope"}}}},
                         "structured_outputs"),
                        ({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
                        ({"structured_outputs": {"jsn": {}}}, "structured_outputs")):
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": "tiny", "messages": msgs, "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
