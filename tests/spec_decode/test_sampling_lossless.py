"""Sampling with speculation follows the target's distribution, through the whole engine.

A tiny-vocabulary target (V = 12) lets us compute the exact distribution of the 2nd and 3rd
generated tokens (each, and jointly) by enumeration, and compare the engine's samples with
chi-square tests (false-alarm rate 1e-3 per test). Drafts: an unrelated random draft model, an n-gram
(point-mass) proposer, and an adversarial proposer whose q over-predicts the target's
unlikely tokens. K = 1 with max_tokens = 3 makes the 3rd token a bonus token whenever the
draft is accepted.
"""

from __future__ import annotations

import itertools
from unittest.mock import patch

import numpy as np
import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import save_random_llama
from leapfrog.model import compiled
from leapfrog.sampling import sampler
from leapfrog.sampling.sampler import RowSpec
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.proposers.base import PROPOSERS, StatelessProposer
from tests.stats import chisq_pvalue

V = 12
PROMPT = [3, 1, 4, 1, 5]
N = 2000
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.6, bos_token_id=0,
             eos_token_id=None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    t = save_random_llama(tmp_path_factory.mktemp("tinyv"), None, seed=3, **SMALL)
    d = save_random_llama(tmp_path_factory.mktemp("tinyd"), None, seed=11, **SMALL)
    return t, d


def exact_law(llm, sp: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """P(token 2) [V], P(token 3) [V] and their joint law P(token 2, token 3) [V, V] under the
    target with sp's processing, by enumeration."""
    model = llm.engine.model

    def dist(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([PROMPT + p for p in prefixes])
            h = model(ids, torch.arange(ids.shape[1]).expand_as(ids)).hidden[:, -1]
            logits = model.compute_logits(h)
        rows = sampler.build_rows([RowSpec(sp, PROMPT, p) for p in prefixes], V)
        return sampler.probs(logits, rows).double()

    p1 = dist([[]])[0]
    p2 = dist([[a] for a in range(V)])                              # [V(t1), V(t2)]
    p3 = dist([[a, b] for a, b in itertools.product(range(V), range(V))]).view(V, V, V)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)         # [V(t2), V(t3)]
    return joint.sum(1).numpy(), joint.sum(0).numpy(), joint.numpy()


def assert_tokens_follow(llm, sp: SamplingParams, toks: np.ndarray) -> None:
    """Generated tokens [n, >= 3] of PROMPT: tokens 2 and 3, each and jointly (a pair of V x V
    cells: noise reused between the two positions leaves the marginals right but not this),
    follow the target's exact law (chi-square, false-alarm rate 1e-3 each)."""
    m2, m3, joint = exact_law(llm, sp)
    assert chisq_pvalue(np.bincount(toks[:, 1], minlength=V), m2) > 1e-3
    assert chisq_pvalue(np.bincount(toks[:, 2], minlength=V), m3) > 1e-3
    assert chisq_pvalue(np.bincount(toks[:, 1] * V + toks[:, 2], minlength=V * V), joint.flatten()) > 1e-3


def assert_follows_target(target, spec: dict, sp: SamplingParams, seed: int, after=None, **engine) -> dict:
    """N requests of PROMPT with speculation: tokens 2 and 3 follow the target's exact law (the
    target as the engine loaded it, e.g. quantized), and the drafts were neither all accepted nor
    all rejected. ``engine``: more LLM arguments; ``after(llm)``: more checks after the run.
    -> the engine's speculation metrics."""
    llm = LLM(model=str(target), dtype="float32", skip_tokenizer_init=True, max_model_len=16,
              seed=seed, speculative_config=spec, **{"max_num_seqs": 256, **engine})
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, sp, use_tqdm=False)
    if after is not None:
        after(llm)
    m = llm.get_metrics()
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert_tokens_follow(llm, sp, np.array([o.outputs[0].token_ids for o in outs]))
    return m


class AdversarialProposer(StatelessProposer):
    """q = softmax(-target logits): puts most mass on the target's unlikely tokens."""

    def __init__(self, cfg, target):
        self.model = target.model

    def propose(self, reqs, ks):
        drafts, qs = [], []
        for r, k in zip(reqs, ks):
            d = []
            for _ in range(k):
                ids = torch.tensor([r.all_ids + d])
                with torch.no_grad():
                    h = self.model(ids, torch.arange(ids.shape[1])[None]).hidden[0, -1:]
                    q = torch.softmax(-self.model.compute_logits(h)[0], -1)
                d.append(int(torch.multinomial(q, 1, generator=r.generator)))
                qs.append(q)
            drafts.append(d)
        return DraftBatch.from_lists(drafts, torch.stack(qs) if qs else None)


SETTINGS = [
    SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.7, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.1, max_tokens=3, ignore_eos=True),
]


def _spec(kind, draft_dir):
    if kind == "draft_model":
        return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 1}
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1}
    PROPOSERS["adversarial_test"] = AdversarialProposer
    return {"method": "adversarial_test", "num_speculative_tokens": 1}


# Every proposer with every setting; a covering subset runs by default, the rest under -m slow.
FAST = {("draft_model", 0), ("ngram", 0), ("adversarial", 0), ("adversarial", 1), ("draft_model", 2),
        ("adversarial", 3), ("ngram", 3), ("draft_model", 4), ("adversarial", 4)}
CASES = [pytest.param(kind, i, marks=() if (kind, i) in FAST else pytest.mark.slow, id=f"{kind}-{i}")
         for kind in ("draft_model", "ngram", "adversarial") for i in range(len(SETTINGS))]


@pytest.mark.parametrize("kind, i", CASES)
def test_speculative_sampling_follows_target(tiny, kind, i):
    target, draft = tiny
    sp = SETTINGS[i]
    llm = LLM(model=str(target), dtype="float32", skip_tokenizer_init=True, max_num_seqs=256, max_model_len=16,
              seed=i, speculative_config=_spec(kind, draft))
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, sp, use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0
    assert metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]  # the residual path ran
    if i == 0:  # unfiltered distributions overlap: the bonus path ran too
        assert metrics["num_accepted_tokens"] > 0
    assert_tokens_follow(llm, sp, np.array([o.outputs[0].token_ids for o in outs]))


def test_verifier_p_is_the_samplers_probs(tiny):
    """The p the verifier uses is exactly sampler.probs for the same rows (no second implementation)."""
    from leapfrog.spec_decode.verify.rejection import rejection_accept
    logits = torch.randn(3, V)
    sp = SamplingParams(temperature=0.8, top_k=5)
    rows = sampler.build_rows([RowSpec(sp, PROMPT, [])] * 3, V)
    p = sampler.probs(logits, rows)
    drafts = torch.tensor([int(p[0].argmax()), int(p[1].argmax())])
    out = rejection_accept(p, None, drafts, [2], torch.zeros(2))
    assert out.num_accepted == [2]
    torch.testing.assert_close(out.final_probs[0], p[2])


def test_seeded_speculative_sampling_reproducible(tiny):
    target, draft = tiny
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=1.0, max_tokens=20, seed=5, ignore_eos=True)
    runs = [LLM(model=str(target), dtype="float32", skip_tokenizer_init=True, speculative_config=spec)
            .generate([{"prompt_token_ids": PROMPT}] * 3, sp, use_tqdm=False) for _ in range(2)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


@pytest.mark.parametrize("quant", [None, "int8"])
def test_quantized_self_draft_sampling_follows_target(tiny, quant):
    """The quantized self-draft (int4 copy of the target) under sampling, on a float and on an
    int8-quantized target: tokens follow the (quantized) target's law."""
    target, _ = tiny
    spec = {"method": "draft_model", "model": "self", "draft_quantization": "int4", "num_speculative_tokens": 1}
    assert_follows_target(target, spec, SETTINGS[0], seed=5, quantization=quant)


@pytest.mark.slow
def test_fast_path_sampling_follows_target(tiny):
    """The compiled fast path (enforce_eager=False): sampled requests verify in padded bucket graphs
    and draft step by step with the draft model's graphs; the law is still the target's."""
    target, draft = tiny
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    assert_follows_target(target, spec, SETTINGS[1], seed=4, enforce_eager=False, max_num_seqs=2)   # T=0.7


@pytest.mark.slow
def test_sampled_speculation_rounds_follow_target(tiny):
    """Multi-step speculation with unseeded sampled requests (num_scheduler_steps: rounds of draft,
    verify and accept in one graph each, verified by matching the target's race winner under
    fresh noise of the request's generator): tokens 2 and 3 follow the target's law; seeded
    requests batched and padded to a larger bucket give what each gives alone."""
    target, draft = tiny
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 1}

    def ran_rounds(llm):
        g = llm.engine.runner.sampled_round
        assert sum(d.calls for d in g.direct.values()) >= N // 4   # (max_tokens 3: two rounds for most)
        batches, run = [], llm.engine.runner.spec_rounds   # each rounds step's batch size, on its way
        llm.engine.runner.spec_rounds = lambda rows, *a, **kw: batches.append(len(rows)) or run(rows, *a, **kw)
        sps = [SamplingParams(temperature=0.7, seed=s, max_tokens=8, ignore_eos=True) for s in range(3)]
        together = llm.generate([{"prompt_token_ids": PROMPT}] * 3, sps, use_tqdm=False)
        assert 3 in batches   # (three sequences padded to the bucket of four)
        alone = [llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0] for sp in sps]
        assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]

    with patch.dict(compiled.INDUCTOR_OPTIONS, {"max_autotune": False}):
        assert_follows_target(target, spec, SETTINGS[1], seed=6, after=ran_rounds, enforce_eager=False,
                              max_num_seqs=4, num_scheduler_steps=3)
