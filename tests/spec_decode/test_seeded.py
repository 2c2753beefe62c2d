"""Seeded sampling is independent of speculation: same seed, same output alone, in any batch,
with any K, with adaptive K, with disable_by_batch_size, and with speculation off; for
draft_model and ngram. And the seeded (match) verification path keeps the target's law."""

from __future__ import annotations

import numpy as np
import pytest

from leapfrog import LLM, SamplingParams
from tests.conftest import prompts_of
from tests.spec_decode.test_sampling_lossless import PROMPT, SETTINGS, V, _spec, assert_tokens_follow, tiny  # noqa: F401

SP = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)


def _spec_cfg(method: str, draft_dir, **kw) -> dict:
    base = {"method": method, "num_speculative_tokens": kw.pop("k", 4)}
    if method == "draft_model":
        base["model"] = str(draft_dir)
    elif method == "ngram":
        base["prompt_lookup_min"] = 1
    return {**base, **kw}


def _others(tokenizer) -> list[tuple[dict, SamplingParams]]:
    """Company in the batch: greedy, unseeded, other seeds, penalties."""
    ps = prompts_of(tokenizer, 6)
    sps = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
           SamplingParams(temperature=1.0, max_tokens=10),
           SamplingParams(temperature=0.7, seed=7, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=1.0, seed=1234, max_tokens=5, presence_penalty=0.5),
           SamplingParams(temperature=0.5, top_k=3, max_tokens=17)]
    return [({"prompt_token_ids": p}, sp) for p, sp in zip(ps[1:], sps)]


@pytest.mark.parametrize("method", ["draft_model", "ngram", "suffix"])
def test_same_seed_same_output_everywhere(llama_dir, draft_dir, tokenizer, method):
    prompt = {"prompt_token_ids": prompts_of(tokenizer, 1)[0]}

    def run(spec, company=(), max_num_seqs=16):
        llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=max_num_seqs,
                  seed=len(company), speculative_config=spec)
        prompts = [prompt] + [c[0] for c in company]
        outs = llm.generate(prompts, [SP] + [c[1] for c in company], use_tqdm=False)
        return outs[0].outputs[0].token_ids, llm.get_metrics()

    ref, _ = run(None)
    company = _others(tokenizer)
    variants = {
        "off, in a batch": (None, company),
        "K=1": (_spec_cfg(method, draft_dir, k=1), ()),
        "K=4": (_spec_cfg(method, draft_dir, k=4), ()),
        "K=4, in a batch": (_spec_cfg(method, draft_dir, k=4), company),
        "K=7, in a batch": (_spec_cfg(method, draft_dir, k=7), company[::-1]),
        "adaptive": (_spec_cfg(method, draft_dir, k=4, adaptive=True, adaptive_explore_interval=2), ()),
        "adaptive, in a batch": (_spec_cfg(method, draft_dir, k=4, adaptive=True), company),
        "disable_by_batch_size": (_spec_cfg(method, draft_dir, k=3, disable_by_batch_size=2), company),
    }
    drafted = 0
    for name, (spec, comp) in variants.items():
        out, metrics = run(spec, comp)
        assert out == ref, name
        drafted += metrics.get("num_draft_tokens", 0)
    assert drafted > 0
    # a batch that cannot all run at once (queueing changes who decodes with whom)
    out, _ = run(_spec_cfg(method, draft_dir, k=2), company, max_num_seqs=2)
    assert out == ref
    # a different seed gives a different output
    other = LLM(model=str(llama_dir), dtype="float32", max_model_len=256).generate(
        prompt, SamplingParams(**{**{f: getattr(SP, f) for f in ("temperature", "top_p", "max_tokens")},
                                  "seed": 1235, "ignore_eos": True}), use_tqdm=False)[0].outputs[0].token_ids
    assert other != ref


def test_seeded_with_prediction_same_output(llama_dir, draft_dir, tokenizer):
    """A seeded request with a prediction (its own output, or an edited one) gives the output it
    has without one: alone, in a batch, next to a configured method."""
    prompt = {"prompt_token_ids": prompts_of(tokenizer, 1)[0]}
    company = _others(tokenizer)

    def run(pred, spec=None, comp=()):
        llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, seed=len(comp), speculative_config=spec)
        sp = SamplingParams(**{**{f: getattr(SP, f) for f in ("temperature", "top_p", "seed", "max_tokens",
                                                               "ignore_eos")}, "prediction": pred})
        outs = llm.generate([prompt] + [c[0] for c in comp], [sp] + [c[1] for c in comp], use_tqdm=False)
        return outs[0].outputs[0].token_ids, outs[0].metrics

    ref, _ = run(None)
    edited = ref[:8] + [3, 4] + ref[10:]
    drafted = 0
    for pred, spec, comp in ((ref, None, ()), (edited, None, company),
                             (ref, _spec_cfg("draft_model", draft_dir, k=3), company)):
        out, m = run(pred, spec, comp)
        assert out == ref
        drafted += m.num_draft_tokens
    assert drafted > 0


def test_n_choices_use_seed_plus_index(llama_dir, tokenizer):
    prompt = {"prompt_token_ids": prompts_of(tokenizer, 1)[0]}
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256)
    two = llm.generate(prompt, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs
    one = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids for s in (5, 6)]
    assert [c.token_ids for c in two] == one


# The seeded path verifies by matching the target's own seeded draw: its law must still be the
# target's (chi-square over many seeds, exact marginals by enumeration as in test_sampling_lossless).
SEEDED_CASES = [("draft_model", 0), ("ngram", 3), ("adversarial", 4),
                pytest.param("draft_model", 2, marks=pytest.mark.slow), pytest.param("ngram", 1, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind, i", SEEDED_CASES)
def test_seeded_speculative_sampling_follows_target(tiny, kind, i):  # noqa: F811
    target, draft = tiny
    sp = SETTINGS[i]
    N = 2000
    llm = LLM(model=str(target), dtype="float32", skip_tokenizer_init=True, max_num_seqs=256, max_model_len=16,
              speculative_config=_spec(kind, draft))
    sps = [SamplingParams(**{**{f: getattr(sp, f) for f in ("temperature", "top_k", "top_p", "min_p", "max_tokens")},
                             "ignore_eos": True, "seed": 10_000 * i + j}) for j in range(N)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, sps, use_tqdm=False)
    metrics = llm.get_metrics()
    assert 0 < metrics["num_draft_tokens"]
    assert metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]
    assert_tokens_follow(llm, sp, np.array([o.outputs[0].token_ids for o in outs]))


def test_quantized_self_draft_keeps_seeded_output(llama_dir, tokenizer):
    """The int4 self-draft on an int8 target: the seeded output is the quantized target's own,
    alone and in a batch, with any K."""
    prompt = {"prompt_token_ids": prompts_of(tokenizer, 1)[0]}
    company = _others(tokenizer)

    def run(k, comp=()):
        spec = None if k is None else {"method": "draft_model", "model": "self", "draft_quantization": "int4",
                                        "num_speculative_tokens": k}
        llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, quantization="int8",
                  speculative_config=spec)
        outs = llm.generate([prompt] + [c[0] for c in comp], [SP] + [c[1] for c in comp], use_tqdm=False)
        return outs[0].outputs[0].token_ids, llm.get_metrics().get("num_draft_tokens", 0)

    ref, _ = run(None)
    for k, comp in [(1, ()), (4, ()), (4, company), (6, company[::-1])]:
        out, drafted = run(k, comp)
        assert out == ref, (k, len(comp))
        assert drafted > 0
