"""The EAGLE-3 level op (model/native_head.py): eager chains drafted with it are the chains the
Python forward drafts, bit for bit (the same tokens and draft probabilities every step), for
greedy, seeded and unseeded sampled requests, on heads with GQA, q/k/v biases and a sliding
window, in float32 and bf16; and greedy output stays the target's."""

from __future__ import annotations

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.model.compiled import CompiledChain
from leapfrog.model.native_linear import native_linear_supported
from tests.conftest import BASE, CONFIGS, prompts_of, save_shapes
from tests.spec_decode.test_eagle import make_head

pytestmark = pytest.mark.skipif(not native_linear_supported(torch.bfloat16, torch.device("cpu")),
                                reason="the level op serves heads on the bf16 linear kernel (AVX-512 BF16 or AVX2)")

SHAPES = {
    "qwen2": {**CONFIGS["qwen2"], "num_hidden_layers": 3},   # q/k/v biases
    "gqa_window": dict(arch="mistral", num_hidden_layers=3, num_key_value_heads=2, sliding_window=6),
}
MAX = 24


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tokenizer):
    """{shape: (target dir, EAGLE-3 head dir)}; the head's weights bf16 values (the op's linears)."""
    return {name: (t, make_head(t, tmp_path_factory.mktemp(f"{name}-head"), "eagle3", draft_vocab_size=200,
                                dtype=torch.bfloat16))
            for name, t in save_shapes(tmp_path_factory, tokenizer, SHAPES).items()}


def _run(target, head, dtype, native: str, monkeypatch, prompts, params):
    with monkeypatch.context() as m:
        m.setenv("LEAPFROG_NATIVE_HEAD", native)
        llm = LLM(model=str(target), dtype=dtype, max_model_len=128, max_num_seqs=3, seed=3,
                  speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 4,
                                      "eagle_topk": 1})
    prop = llm.engine.proposer
    levels = [c.level for c in (prop.runner.chain, prop.runner.sampled_chain)]
    seen, propose = [], prop.propose

    def record(reqs, ks):
        d = propose(reqs, ks)
        q = None if d.draft_probs is None else d.draft_probs.clone()
        seen.append((d.lists(), q))
        return d
    prop.propose = record
    outs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
            for ps, sp in params(prompts)]
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    return levels, seen, outs


def _params(prompts):
    greedy = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=MAX, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.8, max_tokens=MAX, ignore_eos=True)
    return [(prompts, greedy), (prompts[:2], [seeded, greedy]), (prompts[:2], unseeded)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_levels_draft_what_the_python_forward_drafts(heads, tokenizer, shape, dtype, monkeypatch):
    target, head = heads[shape]
    prompts = prompts_of(tokenizer, 3)
    calls = []
    level = CompiledChain.__init__

    def spy(self, *a, **kw):
        level(self, *a, **kw)
        if self.level is not None:
            fn = self.level
            self.level = lambda *x: calls.append(1) or fn(*x)
    monkeypatch.setattr(CompiledChain, "__init__", spy)
    ref_levels, ref, ref_outs = _run(target, head, dtype, "0", monkeypatch, prompts, _params)
    assert ref_levels == [None, None] and not calls
    levels, got, outs = _run(target, head, dtype, "1", monkeypatch, prompts, _params)
    assert all(lv is not None for lv in levels) and len(calls) > 20
    assert outs == ref_outs
    assert len(got) == len(ref) > 10
    for (toks, q), (ref_toks, ref_q) in zip(got, ref):
        assert toks == ref_toks
        assert (q is None) == (ref_q is None) and (q is None or torch.equal(q, ref_q))
    if dtype == "float32":   # lossless: greedy output is the target's alone
        plain = LLM(model=str(target), dtype=dtype, max_model_len=128, max_num_seqs=3)
        sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
        assert outs[0] == [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts],
                                                                          sp, use_tqdm=False)]
