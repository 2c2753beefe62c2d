"""Token rules (logit_bias, allowed_token_ids, bad_words): what they do to a row, through the
engine, and that speculation keeps them lossless (greedy and seeded output equal to the output
without speculation; the sampled law is the constrained target's)."""

from __future__ import annotations

import collections
import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError, RequestError
from leapfrog.sampling import sampler
from leapfrog.sampling.sampler import BadWords, RowSpec
from tests.conftest import prompts_of
from tests.spec_decode.test_sampling_lossless import _spec, assert_follows_target, tiny  # noqa: F401

V = 10


def _rows(specs):
    return sampler.build_rows(specs, V)


def test_bad_words_ban_the_last_token_after_the_prefix():
    sp = SamplingParams(temperature=0)
    words = BadWords(((4,), (1, 2, 3)))
    logits = torch.zeros(3, V)
    rows = _rows([RowSpec(sp, [1], [7, 1], (), words),      # ends with the prefix 1 2? no: 7 1
                  RowSpec(sp, [1], [7, 1, 2], (), words),   # ends with 1 2: 3 is banned
                  RowSpec(sp, [1, 2], [], (), words)])      # the prompt does not count
    out = sampler.penalised_logits(logits, rows)
    assert out[:, 4].isinf().all()                          # one-token words: banned everywhere
    assert torch.isinf(out[1, 3]) and not torch.isinf(out[0, 3]) and not torch.isinf(out[2, 3])
    assert torch.isfinite(out[:, [0, 1, 2, 5, 6, 7, 8, 9]]).all()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), max_size=12),
       st.lists(st.integers(0, 4), max_size=8))
def test_bad_words_index_bans_what_the_word_by_word_rule_bans(words, output):
    """The index (one lookup per distinct word length) bans exactly the tokens the rule bans
    word by word: each word's last token wherever the output ends with the rest of the word."""
    want = {w[-1] for w in words if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:] == w[:-1]}
    bw = BadWords(tuple(map(tuple, words)))   # (one-token words: always banned; the rest by prefix)
    assert set(bw.always) | {t for group in bw.ending(output) for t in group} == want


def test_allowed_bias_and_greedy():
    logits = torch.arange(V, dtype=torch.float32).repeat(3, 1)        # argmax 9 everywhere
    rows = _rows([RowSpec(SamplingParams(temperature=0, allowed_token_ids=[2, 5]), [1], []),
                  RowSpec(SamplingParams(temperature=0, logit_bias={0: 100.0}), [1], []),
                  RowSpec(SamplingParams(temperature=0, logit_bias={9: -100.0, 8: -1.5}), [1], [])])
    assert sampler.greedy_tokens(logits, rows).tolist() == [5, 0, 7]
    p = sampler.probs(logits, _rows([RowSpec(SamplingParams(temperature=1.0, allowed_token_ids=[2, 5],
                                                            logit_bias={2: 3.0}), [1], [])]))
    assert p[0].nonzero().flatten().tolist() == [2, 5]
    torch.testing.assert_close(p[0, 2] / p[0, 5], torch.tensor(1.0))  # 2 + 3 = 5: equal logits


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words="word"), "bad_words"),
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_bad_values_are_refused(kw, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8)


def test_engine_checks_ids_and_impossible_rules(plain):
    for kw, field in [(dict(logit_bias={10_000: 1.0}), "logit_bias"),
                      (dict(allowed_token_ids=[3, 10_000]), "allowed_token_ids"),
                      (dict(allowed_token_ids=[5], min_tokens=2, stop_token_ids=[5]), "allowed_token_ids"),
                      # (stop ids alone covering the vocabulary under min_tokens: refused with ignore_eos too)
                      (dict(min_tokens=2, ignore_eos=True, stop_token_ids=list(range(plain.engine.vocab_size))),
                       "whole vocabulary")]:
        with pytest.raises(RequestError, match=field):
            plain.generate("x = 1", SamplingParams(max_tokens=4, **kw), use_tqdm=False)


@pytest.mark.parametrize("share", [0.0, 2.0], ids=["dense", "sparse"])
@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.integers(0, V - 1), st.floats(-5, 5, width=32), max_size=V), min_size=1,
                max_size=4), st.lists(st.booleans(), min_size=V, max_size=V))
def test_a_logit_bias_adds_its_values_kept_dense_or_as_entries(share, biases, masked):
    """Each row's logit_bias adds its values to its logits, whether kept as a dense row (a bias of
    DENSE_BIAS_SHARE of the vocabulary or more: 0 makes every one dense) or as entries (2: none),
    after the masks (a masked token stays -inf)."""
    allowed = [t for t in range(V) if not masked[t]] or [0]
    specs = [RowSpec(SamplingParams(temperature=0.7, logit_bias=b or None, allowed_token_ids=allowed), [1], [])
             for b in biases]
    logits = torch.randn(len(specs), V, generator=torch.Generator().manual_seed(len(biases)))
    with mock.patch.object(sampler, "DENSE_BIAS_SHARE", share):
        rows = _rows(specs)
    assert rows.bias is None or (rows.bias.dense is None) == (share > 1)
    want = logits.clone()
    for i, b in enumerate(biases):
        for t, v in b.items():
            want[i, t] += v
    want[:, [t for t in range(V) if t not in allowed]] = float("-inf")
    assert torch.equal(sampler.penalised_logits(logits, rows), want)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, V - 1), min_size=1, max_size=V), st.dictionaries(st.integers(0, V - 1),
       st.floats(-5, 5), max_size=V), st.floats(1.0, 2.0), st.lists(st.integers(0, V - 1), max_size=6),
       st.lists(st.lists(st.integers(0, V - 1), max_size=5), min_size=1, max_size=4))
def test_rows_with_the_requests_kept_tensors_equal_rows_built_afresh(allowed, bias, rep, prompt, outs):
    """A request's rule tensors kept in its memo (RuleTensors, built at its first row; the params'
    part shared, its output's counts kept as it grows) give the rows that building them for
    every row gives, step after step (its output growing, drafts after it); its logit_bias kept
    dense (any bias of this vocabulary of 10) and as entries (DENSE_BIAS_SHARE patched to 2)."""
    for share in (sampler.DENSE_BIAS_SHARE, 2.0):
        with mock.patch.object(sampler, "DENSE_BIAS_SHARE", share):
            _kept_equal_fresh(allowed, bias, rep, prompt, outs)


def _kept_equal_fresh(allowed, bias, rep, prompt, outs):
    sp = SamplingParams(temperature=0.7, allowed_token_ids=allowed, logit_bias=bias, repetition_penalty=rep,
                        presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4)
    words = BadWords(((3,), (1, 2), (5, 5, 6)))
    memo: dict = {}
    shared: dict = {}
    for step in range(3):
        out = [t for o in outs[:step + 1] for t in o]
        kept = _rows([RowSpec(sp, prompt, out + o, (4, 9), words, memo=memo, shared=shared, committed=len(out))
                      for o in outs])
        fresh = _rows([RowSpec(sp, prompt, out + o, (4, 9), words) for o in outs])
        want = torch.zeros(len(outs), V, dtype=torch.bool)   # (the rule, word by word)
        for i, o in enumerate(outs):
            row = out + o
            want[i, [3] + [2] * (row[-1:] == [1]) + [6] * (row[-2:] == [5, 5])] = True
            want[i, [4, 9]] = len(row) < 4
            want[i] |= ~torch.isin(torch.arange(V), torch.tensor(allowed))
        assert torch.equal(kept.masked, want)
        assert len(memo) == len(shared) == 1
        assert torch.equal(kept.masked, fresh.masked)
        assert (kept.bias is None) == (fresh.bias is None)
        if kept.bias is not None:
            for part in ("sparse", "dense"):
                a, b = getattr(kept.bias, part), getattr(fresh.bias, part)
                assert (a is None) == (b is None) and (a is None or all(map(torch.equal, a, b)))
        assert all(torch.equal(a, b) for a, b in zip(kept.penalties, fresh.penalties))


def test_a_long_list_of_words_after_one_prefix_is_a_kept_tensor():
    """100 bad words after one token: a row ending with it bans all 100 (and the rows that do not,
    none), the list's tensor built once and kept for the request's later rows."""
    words = BadWords(tuple((7, t) for t in range(100)) + ((9, 8, 1),))
    sp, memo = SamplingParams(temperature=0), {}
    for _ in range(2):
        rows = sampler.build_rows([RowSpec(sp, [1], [3, 7], (), words, memo=memo),
                                   RowSpec(sp, [1], [3, 9, 8], (), words, memo=memo),
                                   RowSpec(sp, [1], [7, 3], (), words, memo=memo)], 128)
        assert rows.masked[0].nonzero().flatten().tolist() == list(range(100))
        assert rows.masked[1].nonzero().flatten().tolist() == [1] and not rows.masked[2].any()
    (rt,) = memo.values()
    assert len(rt.groups) == 1

def test_a_requests_output_counts_are_kept_as_its_output_grows():
    """A penalty's output counts are kept per request: each row adds only the tokens committed
    since the last one (counted afresh for each row, 8k output tokens cost a step of 6 rows
    11-12 ms at a 128k vocabulary) and its own drafts, which stay out of the kept counts."""
    sp = SamplingParams(temperature=0.7, frequency_penalty=0.5)
    memo: dict = {}

    def counts(out, drafts, committed):
        rows = _rows([RowSpec(sp, [0], out + d, memo=memo, committed=committed) for d in drafts])
        return rows.penalties[1].tolist()

    assert counts([1, 2, 2], [[3], [4, 4]], 3) == [[0, 1, 2, 1, 0, 0, 0, 0, 0, 0], [0, 1, 2, 0, 2, 0, 0, 0, 0, 0]]
    (rt,) = memo.values()
    assert rt.output_counts.n == 3 and rt.output_counts.counts.tolist() == [0, 1, 2, 0, 0, 0, 0, 0, 0, 0]
    assert counts([1, 2, 2, 4, 5], [[]], 5) == [[0, 1, 2, 0, 1, 1, 0, 0, 0, 0]]
    assert rt.output_counts.n == 5


def test_a_requests_rule_tensors_are_built_once(plain, tokenizer, monkeypatch):
    """allowed_token_ids, logit_bias and a penalty's prompt become tensors once per request, not
    once per row of every step (a 128k vocabulary: 110-350 ms a step of 6 rows)."""
    calls = []
    real = sampler.RuleTensors.of
    monkeypatch.setattr(sampler.RuleTensors, "of", staticmethod(lambda *a: calls.append(a[0]) or real(*a)))
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True, allowed_token_ids=list(range(30, 300)),
                        logit_bias={50: 2.0}, repetition_penalty=1.2)
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts_of(tokenizer, 2)], sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs) and len(calls) == 2

def test_one_params_object_is_prepared_once_for_every_prompt_and_choice(plain, tokenizer, monkeypatch):
    """LLM.generate checks a SamplingParams against the model once, and every request made from it
    (prompts x n choices) shares what that built: the stop ids, the bad words and the params'
    rule tensors (a prompt's penalty mask stays its own). Checked per choice, 400k stop ids cost
    ~90 ms each on the engine's thread. Choice i is the request seeded with seed + i."""
    eng = plain.engine
    prepared, checks, reqs = [], [], []
    real_prepare, real_check, real_add = eng.prepare, eng._check_params, eng.add_request
    monkeypatch.setattr(eng, "prepare", lambda p: prepared.append(p) or real_prepare(p))
    monkeypatch.setattr(eng, "_check_params", lambda p: checks.append(p) or real_check(p))
    monkeypatch.setattr(eng, "add_request", lambda *a, **k: reqs.append(real_add(*a, **k)) or reqs[-1])
    sp = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, ignore_eos=True, min_tokens=2,
                        stop_token_ids=[7, 7, 9] * 1000, allowed_token_ids=list(range(30, 300)),
                        repetition_penalty=1.2, bad_words=["return"])
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 2)]
    outs = plain.generate(prompts, sp, use_tqdm=False)
    assert len(prepared) == len(checks) == 1 and len(reqs) == 6
    first = reqs[0]
    for r in reqs:
        assert r.stop_ids is first.stop_ids and r.stop_set is first.stop_set and r.bad_words is first.bad_words
        assert r.params is first.params and r.shared_rules is first.shared_rules
    (base,) = first.shared_rules.values()   # (built at the first row of any of them)
    tensors = [next(iter(r.rule_tensors.values())) for r in reqs]
    assert all(t.outside is base.outside and t.stops is base.stops for t in tensors)
    assert len({id(t.output_counts) for t in tensors}) == 6   # (each request's own)
    assert not torch.equal(tensors[0].prompt_seen, tensors[3].prompt_seen)   # (two prompts)
    monkeypatch.undo()
    for j, p in enumerate(prompts):
        for i in range(3):
            one = plain.generate(p, dataclasses.replace(sp, n=1, seed=3 + i), use_tqdm=False)[0]
            assert outs[j].outputs[i].token_ids == one.outputs[0].token_ids


def test_prepared_params_keep_lists_of_their_own(plain):
    """A caller changing its lists after prepare changes nothing the requests use (the checks
    and the kept rule tensors were made for the lists as they were)."""
    ids, bias = [5, 6], collections.defaultdict(float, {7: 1.0})   # (a dict of any kind)
    prep = plain.engine.prepare(SamplingParams(temperature=0, max_tokens=2, stop_token_ids=ids, logit_bias=bias,
                                               allowed_token_ids=[5, 6, 7, 8], stop=["a"]))
    ids.append(10_000)   # (past the vocabulary)
    bias[10_000] = 1.0
    assert prep.params.stop_token_ids == [5, 6] and prep.params.logit_bias == {7: 1.0}
    out = plain.generate({"prompt_token_ids": [1, 2, 3]}, prep.params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1


def test_params_prepared_by_another_engine_are_refused(plain, llama_dir):
    """(Their ids were checked against the other model's vocabulary, their EOS is its own.)"""
    other = LLM(model=str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=1)
    with pytest.raises(RequestError, match="another engine"):
        plain.engine.add_request("other", None, [1, 2, 3], other.engine.prepare(SamplingParams()))
    assert "other" not in plain.engine.requests


def test_a_requests_stop_ids_are_kept_once_each(plain):
    """EOS and stop_token_ids become one tuple (each id once) and a set when the request is added:
    rebuilt at every access, 500k stop_token_ids cost 30 ms a step of the whole batch."""
    sp = SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=[7, 7, 9] * 100_000)
    req = plain.engine.add_request("long-ids", None, [1, 2, 3], sp)
    try:
        assert req.stop_ids == (*plain.engine.eos_ids, 7, 9) and req.stop_set == set(req.stop_ids)
        assert req.stop_ids is req.stop_ids   # (kept, not rebuilt)
    finally:
        plain.engine.abort("long-ids")

def test_n_choices_share_their_bad_words_and_stop_strings(plain, tokenizer, monkeypatch):
    """LLM.generate with n > 1 tokenizes the bad words and indexes the stop strings once for all
    the choices (100k bad words take 9 s to tokenize)."""
    calls = []
    real = plain.engine.encode_bad_words
    monkeypatch.setattr(plain.engine, "encode_bad_words", lambda p: calls.append(p) or real(p))
    sp = SamplingParams(temperature=1.0, n=3, seed=2, max_tokens=8, bad_words=["return"], stop=["\n\n"])
    out = plain.generate({"prompt_token_ids": prompts_of(tokenizer, 1)[0]}, sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(calls) == 1

def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


def test_rules_through_the_engine(plain, tokenizer):
    prompt = {"prompt_token_ids": prompts_of(tokenizer, 1)[0]}
    g = dict(temperature=0, max_tokens=24, ignore_eos=True)
    base = plain.generate(prompt, SamplingParams(**g), use_tqdm=False)[0].outputs[0].token_ids
    allowed = sorted(set(base[:3]) | {7, 11, 13})
    out = plain.generate(prompt, SamplingParams(**g, allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed) and out.token_ids[:3] == base[:3]
    out = plain.generate(prompt, SamplingParams(**g, logit_bias={42: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [42] * 24
    # a word the output contains (a span that tokenizes back to itself) is never produced once banned
    word = next(w for i in range(len(base) - 1)
                if tokenizer.encode(w := tokenizer.decode(base[i:i + 2]), add_special_tokens=False) == base[i:i + 2]
                and w.strip())
    out = plain.generate(prompt, SamplingParams(**g, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    variants = plain.engine.encode_bad_words(SamplingParams(bad_words=[word])).words
    assert any(_contains(base, v) for v in variants)
    assert not any(_contains(out.token_ids, v) for v in variants) and out.token_ids != base


RULES = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=list(range(40, 200)),
                        logit_bias={50: 2.0, 60: -3.0}, bad_words=["return", "self"]),
         SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logit_bias={50: 2.0, 61: 4.0},
                        bad_words=["the"], allowed_token_ids=list(range(30, 300)))]


@pytest.mark.parametrize("method", ["draft_model", "ngram", "suffix", "eagle3"])
def test_speculation_keeps_rules_lossless(llama_dir, draft_dir, tokenizer, plain, method, tmp_path):
    """Greedy and seeded requests with every rule: the same output with speculation as without
    (EAGLE-3 with a draft vocabulary of 200: some allowed tokens are outside it)."""
    if method == "eagle3":
        from tests.spec_decode.test_eagle import make_head
        head = make_head(llama_dir, tmp_path, "eagle3", draft_vocab_size=200, target_layer_ids=(0, 1))
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "eagle_topk": 2,
                "num_draft_tokens": 5}
    else:
        spec = {"method": method, "num_speculative_tokens": 3}
        if method == "draft_model":
            spec["model"] = str(draft_dir)
        elif method == "ngram":
            spec["prompt_lookup_min"] = 1
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 4)]
    sps = [RULES[i % 2] for i in range(4)]
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sps, use_tqdm=False)]
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    assert got == ref
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_sampled_law_under_rules(tiny, draft_dir):  # noqa: F811
    """Unseeded rejection sampling with allowed_token_ids and logit_bias: tokens 2 and 3 follow
    the constrained target's exact law (chi-square)."""
    target, draft = tiny
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, allowed_token_ids=[1, 2, 3, 5, 8, 9],
                        logit_bias={2: 1.5, 5: -1.0})
    assert_follows_target(target, _spec("draft_model", draft), sp, seed=3)
