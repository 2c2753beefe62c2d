"""One bad request never hurts another (offline engine).

- Validation at the door: every bad SamplingParams value is a ConfigError, every value that needs
  the model (token ids, stop strings without a tokenizer) a RequestError, and the engine then
  serves the next request with the same output as before.
- Isolation by construction: a test-only fault injector makes one request's sampling raise in
  the middle of decoding; that request alone ends with finish_reason "error", and every other
  request of the batch (1, 4 or 16 of them, speculation on) finishes with exactly the output it
  has without the fault (greedy and seeded requests are position-keyed, so the retry changes nothing).
"""

from __future__ import annotations

import math

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError, EngineError, RequestError
from tests.conftest import prompts_of


@pytest.fixture(scope="module")
def llm(llama_dir, draft_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=16, seed=0,
               speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})


def probe(llm, tokenizer):
    """A fixed mixed batch (greedy + seeded): what 'the same output as before' is compared with."""
    p = prompts_of(tokenizer, 2)
    outs = llm.generate([{"prompt_token_ids": p[0]}, {"prompt_token_ids": p[1]}],
                        [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


BAD_PARAMS = [
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=-1.0), dict(temperature="1"),
    dict(top_p=float("nan")), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=float("nan")), dict(min_p=2.0),
    dict(repetition_penalty=float("nan")), dict(repetition_penalty=1e-300), dict(repetition_penalty=0.0),
    dict(repetition_penalty=1e300), dict(presence_penalty=float("inf")), dict(frequency_penalty=-3.0),
    dict(top_k=-2), dict(top_k=1.5), dict(n=0), dict(n=10**6), dict(max_tokens=0), dict(max_tokens=True),
    dict(min_tokens=-1), dict(min_tokens=20, max_tokens=10), dict(seed=1.5), dict(seed=True),
    dict(stop=[""]), dict(stop=5), dict(stop_token_ids=[-1]), dict(stop_token_ids=["a"]),
    dict(ignore_eos="yes"), dict(logprobs=21), dict(logit_bias={1: "x"}),
]


@pytest.mark.parametrize("kw", BAD_PARAMS, ids=[str(k) for k in BAD_PARAMS])
def test_bad_sampling_params_are_config_errors(kw):
    name = next(iter(kw))
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, name", [(dict(seed=2**80), "seed"), (dict(seed=-(2**64)), "seed"),
                                      (dict(dtype=["x"]), "dtype")])
def test_bad_engine_values_are_config_errors(llama_dir, kw, name):
    """An engine seed past what torch's generators take (it failed deep inside with an
    OverflowError) and a dtype that is not a string are ConfigErrors naming the field."""
    from leapfrog import LLM
    with pytest.raises(ConfigError, match=name):
        LLM(model=str(llama_dir), **kw)


def test_bad_requests_leave_the_engine_clean(llm, tokenizer):
    before = probe(llm, tokenizer)
    p = prompts_of(tokenizer, 1)[0]
    bad = [
        SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[100000], max_tokens=4),
        SamplingParams(temperature=0, stop_token_ids=[320], max_tokens=4),   # vocabulary is [0, 320)
    ]
    for sp in bad:
        with pytest.raises(RequestError, match="stop_token_ids"):
            llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)
        assert not llm.engine.has_unfinished()
    for args in ([{"prompt_token_ids": [1, 2**70]}], [{"prompt_token_ids": [1, -1]}], [{"prompt": 5}], [3.5]):
        with pytest.raises(RequestError):
            llm.generate(args, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RequestError, match="SamplingParams"):
        llm.generate([{"prompt_token_ids": p}], [{"temperature": 0}], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert probe(llm, tokenizer) == before


def test_extreme_but_valid_values_work(llm, tokenizer):
    """top_k beyond the vocabulary means off; any integer seed is hashed to a 64-bit key."""
    p = prompts_of(tokenizer, 1)[0]

    def run(**kw):
        sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, **kw)
        return llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids

    assert run(top_k=2**70, seed=1) == run(top_k=0, seed=1) == run(top_k=-1, seed=1)
    big = [run(seed=s) for s in (2**64, 2**64, -(2**80), 2**64 + 1)]
    assert big[0] == big[1] and len(big[2]) == 10 and big[0] != big[3]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=1e4, repetition_penalty=0.01,
                                                               max_tokens=5, seed=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5


def test_stop_strings_need_a_tokenizer(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(stop="x"), use_tqdm=False)
    assert llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].finish_reason == "length"


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _run_engine(llm, prompts, bad: str | None) -> dict:
    """Add every request to the engine, step to the end; the fault hits request ``bad`` once it
    has 3 tokens (mid-decode, with drafts in flight)."""
    eng = llm.engine

    def fault(reqs):
        for r in reqs:
            if r.request_id == bad and len(r.output_ids) >= 3:
                raise RuntimeError("injected sampling fault")
    eng.fault_injector = fault if bad else None
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", None, p, _params(i))
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
        return outs
    finally:
        eng.fault_injector = None


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_fault_injection_isolates_one_request(llm, tokenizer, bs):
    prompts = (prompts_of(tokenizer, 8) * 2)[:bs]
    clean = _run_engine(llm, prompts, None)
    faulty = _run_engine(llm, prompts, "r0")
    assert faulty["r0"].outputs[0].finish_reason == "error"
    assert "injected sampling fault" in str(faulty["r0"].error)
    assert 3 <= len(faulty["r0"].outputs[0].token_ids) < 16
    for rid, out in clean.items():
        if rid != "r0":
            assert out.outputs[0].finish_reason == "length"
            assert faulty[rid].outputs[0].token_ids == out.outputs[0].token_ids, rid
    assert not llm.engine.has_unfinished() and llm.engine.kv.num_free == llm.engine.kv.num_rows
    assert _run_engine(llm, prompts, None).keys() == clean.keys()


def test_offline_generate_raises_and_engine_stays_clean(llm, tokenizer):
    before = probe(llm, tokenizer)
    p = prompts_of(tokenizer, 4)

    def fault(reqs):
        if any(r.params.seed == 999 for r in reqs):
            raise RuntimeError("boom")
    llm.engine.fault_injector = fault
    try:
        sps = [SamplingParams(temperature=0, max_tokens=8)] * 3 + [SamplingParams(temperature=1, seed=999)]
        with pytest.raises(EngineError, match="boom"):
            llm.generate([{"prompt_token_ids": x} for x in p], sps, use_tqdm=False)
    finally:
        llm.engine.fault_injector = None
    assert not llm.engine.has_unfinished()
    assert probe(llm, tokenizer) == before


def test_nonfinite_logits_fail_only_that_request(llm, tokenizer):
    """A sampler fed NaN raises (never draws garbage); isolation ends just that request."""
    eng = llm.engine
    real = eng.runner.step
    p = prompts_of(tokenizer, 2)

    def step(chunks, **kw):
        out = real(chunks, **kw)
        if "nan" in eng.requests and any(c.row == eng.requests["nan"].row for c in chunks):
            out.logits = torch.full_like(out.logits, math.nan)  # the whole batch's: isolation must find the culprit
        return out
    eng.runner.step = step
    try:
        eng.add_request("nan", None, p[0], SamplingParams(temperature=1.0, max_tokens=4))
        eng.add_request("ok", None, p[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
    finally:
        eng.runner.step = real
    assert outs["nan"].outputs[0].finish_reason == "error"
    assert isinstance(outs["nan"].error, FloatingPointError)
    assert outs["ok"].outputs[0].finish_reason == "length"


def test_max_model_len_beyond_the_model_is_refused(llama_dir):
    with pytest.raises(ConfigError, match=r"context, 512 \(max_position_embeddings in"):
        LLM(model=str(llama_dir), dtype="float32", max_model_len=513)


@pytest.mark.parametrize("kw, match", [
    (dict(max_num_seqs=10**9), "GiB of KV cache"),   # (not a MemoryError, nor the OOM killer)
    (dict(allow_pickle="yes"), "allow_pickle"),
    (dict(skip_tokenizer_init="no"), "skip_tokenizer_init"),
    (dict(tokenizer=123), "tokenizer=123"),
    (dict(device="bogus"), "device='bogus'"),
])
def test_engine_options_are_checked(llama_dir, kw, match):
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(llama_dir), dtype="float32", **kw)


def test_failures_after_the_commit_never_rerun_the_batch(llm, tokenizer):
    """A bookkeeping failure after the KV commit (here the K controller) must not make the engine
    verify the batch again on advanced state: outputs stay exactly the clean ones."""
    prompts = prompts_of(tokenizer, 4)
    clean = _run_engine(llm, prompts, None)
    ctl = llm.engine.spec_controller
    real = ctl.observe
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("controller bug")
        return real(*a, **kw)
    ctl.observe = flaky
    try:
        again = _run_engine(llm, prompts, None)
    finally:
        ctl.observe = real
    assert calls["n"] > 3
    assert ({k: v.outputs[0].token_ids for k, v in again.items()}
            == {k: v.outputs[0].token_ids for k, v in clean.items()})


def test_whole_vocabulary_stop_ids_with_min_tokens_is_refused(llm, tokenizer):
    with pytest.raises(RequestError, match="whole vocabulary"):
        llm.generate({"prompt_token_ids": prompts_of(tokenizer, 1)[0]},
                     SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=list(range(320))), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_nonfinite_logits_fail_greedy_requests_too(llm, tokenizer):
    eng = llm.engine
    real = eng.runner.step

    def step(chunks, **kw):
        out = real(chunks, **kw)
        out.logits = torch.full_like(out.logits, math.nan)
        return out
    eng.runner.step = step
    try:
        with pytest.raises(EngineError, match="non-finite"):
            llm.generate({"prompt_token_ids": prompts_of(tokenizer, 1)[0]}, SamplingParams(temperature=0, max_tokens=3),
                         use_tqdm=False)
    finally:
        eng.runner.step = real
    assert not eng.has_unfinished()
