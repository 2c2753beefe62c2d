"""min_draft_confidence (spec_decode/config.py): a greedy request's chain ends at the first draft
whose path confidence (the product of the drafter's probabilities along it) is below the setting,
for EAGLE chains and draft models, eagerly and on the Python loops; greedy output stays the
target's alone (float32), the lengths follow the rule, and bad settings are refused."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leapfrog import LLM, SamplingParams
from leapfrog.config import EngineConfig
from leapfrog.errors import ConfigError
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.draft import chain_length
from tests.conftest import CONFIGS, prompts_of, save_shapes
from tests.spec_decode.test_eagle import make_head

MAX = 32
K = 6


def test_chain_length_ends_at_the_first_draft_below_the_confidence():
    lps = [math.log(0.9), math.log(0.8), math.log(0.5), math.log(0.9)]   # path: 0.9, 0.72, 0.36, 0.324
    assert chain_length(lps, 4, None) == 4 and chain_length(lps, 2, None) == 2
    assert chain_length(lps, 4, 0.7) == 3     # 0.36 < 0.7: the third draft is the last
    assert chain_length(lps, 4, 0.95) == 1    # below at once: one draft
    assert chain_length(lps, 4, 0.3) == 4     # never below
    assert chain_length(lps, 2, 0.3) == 2 and chain_length(lps[:1], 4, 0.3) == 1   # (levels, drafted)
    assert chain_length([], 4, 0.5) == 0


@given(st.lists(st.floats(-5.0, 0.0), max_size=12), st.integers(1, 12), st.floats(0.01, 1.0))
def test_chain_length_property(lps, levels, c):
    n = chain_length(lps, levels, c)
    assert n == min(levels, len(lps)) or sum(lps[:n]) < math.log(c)   # ended early only below c
    assert all(sum(lps[:d]) >= math.log(c) for d in range(1, n))       # ... and at the first draft below
    assert (n >= 1) == (min(levels, len(lps)) >= 1)


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "num_speculative_tokens": 4, "min_draft_confidence": 0.3}, "applies to methods"),
    ({"method": "suffix", "num_speculative_tokens": 4, "min_draft_confidence": 0.3}, "applies to methods"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 4, "min_draft_confidence": 0}, r"\(0, 1\]"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 4, "min_draft_confidence": 1.5}, r"\(0, 1\]"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 4, "min_draft_confidence": "0.3"}, r"\(0, 1\]"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 4, "min_draft_confidence": True}, r"\(0, 1\]"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 4, "min_draft_confidence": 0.3,
      "adaptive": True}, "adaptive"),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 4, "min_draft_confidence": 0.3}, "eagle_topk"),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 4, "eagle_topk": 1, "min_draft_confidence": 0.3,
      "num_draft_tokens": "auto"}, "adaptive"),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 3, "min_draft_confidence": 0.3,
      "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 0, 0)]"}, "eagle_topk"),
])
def test_bad_min_draft_confidence_is_refused(spec, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig.from_dict(spec)


def test_min_draft_confidence_refused_with_speculation_rounds(llama_dir):
    spec = {"method": "draft_model", "model": "self", "num_speculative_tokens": 4, "min_draft_confidence": 0.3}
    with pytest.raises(ConfigError, match="min_draft_confidence"):
        EngineConfig(model=str(llama_dir), speculative_config=spec, enforce_eager=False, num_scheduler_steps=2)
    assert SpeculativeConfig.from_dict(spec).min_draft_confidence == 0.3


def _eagle_run(target, head, native: str, monkeypatch, prompts, sps, conf):
    """(outputs, every step's (drafts, candidate scores, asked k) per request) of EAGLE-3 chains."""
    with monkeypatch.context() as m:
        m.setenv("LEAPFROG_NATIVE_DRAFTS", native)
        llm = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=4,
                  speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": K,
                                      "eagle_topk": 1, **({} if conf is None else {"min_draft_confidence": conf})})
    prop, seen = llm.engine.proposer, []
    propose = prop.propose

    def record(reqs, ks):
        d = propose(reqs, ks)
        seen.extend((t, s, prop._levels(r, k), r.params.greedy)   # (levels: k, or fewer near the end)
                    for t, s, k, r in zip(d.lists(), d.candidate_scores, ks, reqs))
        return d
    prop.propose = record
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sps,
                                                         use_tqdm=False)]
    return outs, seen


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory, tokenizer):
    """(a 3-layer target with q/k/v biases, an EAGLE-3 head of bf16 values with its own vocabulary)."""
    target = save_shapes(tmp_path_factory, tokenizer, {"qwen2": {**CONFIGS["qwen2"], "num_hidden_layers": 3}})["qwen2"]
    return target, make_head(target, tmp_path_factory.mktemp("conf-head"), "eagle3", seed=1, draft_vocab_size=200,
                             draft_token_ids=list(range(100, 300)), dtype=torch.bfloat16)


@pytest.mark.parametrize("native", ["1", "0"])
def test_eagle_chains_end_below_the_confidence_and_stay_lossless(eagle_pair, tokenizer, native, monkeypatch):
    """Greedy chains (the native op on a head of bf16 values, or the Python loops) end at the first
    draft below the confidence: the recorded path confidences say so for every step, lengths vary,
    and greedy output is the target's alone; sampled requests in the batch draft full chains."""
    target, head = eagle_pair
    prompts = prompts_of(tokenizer, 4)
    greedy = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    sps = [greedy, greedy, greedy, SamplingParams(temperature=0.8, seed=3, max_tokens=MAX, ignore_eos=True)]
    ref, free = _eagle_run(target, head, native, monkeypatch, prompts, sps, None)
    # the setting: the median path confidence of the second drafts (a random head's are low), so
    # chains end at every depth
    conf = statistics.median(s[1] for _, s, k, g in free if g and s is not None and len(s) >= 2)
    outs, seen = _eagle_run(target, head, native, monkeypatch, prompts, sps, conf)
    lengths = []
    # sampled requests draft their full chains: the drafts they draw without the setting
    assert [t for t, _, _, g in seen if not g] == [t for t, _, _, g in free if not g]
    for toks, scores, k, greedy_req in seen:
        if not toks or not greedy_req:
            continue
        assert all(c >= conf for c in scores[:-1]) and len(scores) == len(toks)
        assert scores[-1] < conf or len(toks) == k
        lengths.append(len(toks))
    assert 1 in lengths and max(lengths) >= 3 and len(lengths) > 10, lengths
    assert outs[:3] == ref[:3]   # greedy: lossless (as without the setting)
    plain = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=4)
    assert outs[:3] == [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                                                                       greedy, use_tqdm=False)]


def test_native_chain_stops_early_with_the_python_loops_drafts(eagle_pair, tokenizer, monkeypatch):
    """The native chain runs no head forward once every chain has ended (fewer columns back than
    levels asked), and drafts what the Python loop drafts."""
    from leapfrog.model.native_draft import NativeHeadForward
    from leapfrog.model.native_linear import native_linear_supported
    if not native_linear_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("the op serves heads on the bf16 linear kernel")
    target, head = eagle_pair
    prompts = prompts_of(tokenizer, 2)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    shapes = []
    fn = NativeHeadForward.chain

    def chain(self, *a, **kw):
        out = fn(self, *a, **kw)
        shapes.append((out[0].shape[1], a[10]))   # (columns drafted, levels asked)
        return out
    monkeypatch.setattr(NativeHeadForward, "chain", chain)
    runs = {n: _eagle_run(target, head, n, monkeypatch, prompts, sp, 0.2) for n in ("0", "1")}
    assert runs["0"] == runs["1"]
    assert shapes and any(cols < steps for cols, steps in shapes), shapes


@pytest.mark.parametrize("k", [4, 8])
def test_draft_model_chains_end_below_the_confidence_and_stay_lossless(llama_dir, draft_dir, tokenizer, k):
    """An unrelated draft (mostly rejected) on the one-forward-per-token loop: greedy chains of
    varying lengths, none longer than K, and greedy output the target's alone."""
    prompts = prompts_of(tokenizer, 5)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    lengths = {}
    for conf in (None, 0.3):
        llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=5,
                  speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k,
                                      **({} if conf is None else {"min_draft_confidence": conf})})
        seen, propose = [], llm.engine.proposer.propose
        llm.engine.proposer.propose = lambda reqs, ks: seen.extend((d := propose(reqs, ks)).num_draft) or d
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                             use_tqdm=False)]
        lengths[conf] = [n for n in seen if n]
        if conf is None:
            ref = outs
    assert outs == ref
    plain = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=5)
    assert ref == [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                  use_tqdm=False)]
    short = lengths[0.3]
    assert max(short) <= k and min(short) < k and sum(short) / len(short) < sum(lengths[None]) / len(lengths[None])


def test_auto_sizes_stop_the_batchs_chains_together_and_stay_lossless(eagle_pair, tokenizer):
    """"auto" tree sizes hand the fused chain loop a stop confidence (SpecController.stop_confidence):
    no level runs once every chain of the batch is below it, and every row keeps all the levels run
    (verification is padded to the longest row: cutting one would lose tokens for nothing). Greedy
    output stays the target's alone."""
    target, head = eagle_pair
    prompts = prompts_of(tokenizer, 3)
    greedy = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    llm = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=4,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": K,
                                  "eagle_topk": 1, "num_draft_tokens": "auto"})
    ctl, prop = llm.engine.spec_controller, llm.engine.proposer
    choose, propose, seen = ctl.choose, prop.propose, []
    conf = 0.05   # (a random head's second drafts sit around here: chains stop at every depth)

    def chains(reqs, **kw):   # every step a chain of the depth (capped near the end), with the stop
        choose(reqs, **kw)
        ctl.stop_confidence = conf
        return [ctl.cap(r, K) for r in reqs]

    def record(reqs, ks, stop_confidence=None):
        d = propose(reqs, ks, stop_confidence=stop_confidence)
        seen.append((stop_confidence, [prop._levels(r, k) for r, k in zip(reqs, ks)], d.num_draft,
                     d.candidate_scores))
        return d
    ctl.choose, ctl.drafting_off, prop.propose = chains, (lambda batch_size, sampled=None: False), record
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                         use_tqdm=False)]
    plain = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=4)
    assert outs == [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   greedy, use_tqdm=False)]
    assert all(stop == conf for stop, *_ in seen)
    stopped = 0
    for _, levels, nums, scores in seen:
        if len(set(levels)) > 1 or levels[0] < K:
            continue   # (rows near their end ask for fewer levels)
        ran = max(nums)
        assert nums == [ran] * len(nums)   # every row keeps the levels run
        if ran < K:   # stopped early: every chain below the confidence at its last level
            stopped += 1
            assert all(sc[-1] < conf for sc in scores), scores
        # (a level ran only while some chain was at or above the confidence)
        assert all(max(sorted(sc, reverse=True)[d] for sc in scores) >= conf for d in range(ran - 1))
    assert stopped >= 3, seen
