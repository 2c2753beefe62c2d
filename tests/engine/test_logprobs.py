"""logprobs / prompt_logprobs: the target's values at the right rows, with and without
speculation (accepted drafts get the verify forward's values, never the draft's)."""

from __future__ import annotations

import math

import pytest
import torch

from leapfrog import LLM, SamplingParams
from tests.conftest import prompts_of


def _forward_logits(llm, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of one plain forward over ids (the reference)."""
    model = llm.engine.model
    with torch.no_grad():
        t = torch.tensor([ids])
        h = model(t, torch.arange(len(ids))[None]).hidden[0]
        return model.compute_logits(h).float()


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8)


def test_logprobs_match_a_plain_forward(plain, tokenizer):
    prompt = prompts_of(tokenizer, 2)[1]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = plain.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    c = out.outputs[0]
    ref = torch.log_softmax(_forward_logits(plain, prompt + c.token_ids), -1)
    P = len(prompt)
    assert len(c.logprobs) == len(c.token_ids) == 12
    for i, (t, pos) in enumerate(zip(c.token_ids, c.logprobs)):
        want = ref[P - 1 + i]
        assert list(pos)[0] == t and pos[t].rank == 1           # greedy: the chosen token is the argmax
        assert pos[t].logprob == pytest.approx(float(want[t]), abs=1e-4)
        top = want.topk(3)
        assert [k for k in pos] == top.indices.tolist()          # chosen first; it is the top-1
        assert pos[t].decoded_token == tokenizer.decode([t])
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    # prompt logprobs: None for the first token, then the forward's values with the right ranks
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
    for j in range(1, P):
        pos, t = out.prompt_logprobs[j], prompt[j]
        assert pos[t].logprob == pytest.approx(float(ref[j - 1, t]), abs=1e-4)
        assert pos[t].rank == int((ref[j - 1] > ref[j - 1, t]).sum()) + 1
        assert len(pos) in (2, 3)


def test_prompt_logprobs_across_prefill_chunks(llama_dir, tokenizer):
    """A prompt computed in several chunks still gets one entry per token, in order."""
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=8)
    prompt = prompts_of(tokenizer, 6)[5] * 2
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(_forward_logits(llm, prompt), -1)
    got = [out.prompt_logprobs[j][prompt[j]].logprob for j in range(1, len(prompt))]
    torch.testing.assert_close(torch.tensor(got), ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])],
                               atol=1e-4, rtol=0)


def test_processed_mode(llama_dir, tokenizer):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, logprobs_mode="processed_logprobs")
    prompt = prompts_of(tokenizer, 1)[0]
    sp = SamplingParams(temperature=0.5, top_k=2, seed=3, max_tokens=6, ignore_eos=True, logprobs=4)
    c = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    ref = _forward_logits(llm, prompt + c.token_ids)[len(prompt) - 1:-1] / 0.5
    for i, pos in enumerate(c.logprobs):
        kth = ref[i].topk(2).values[-1]
        want = torch.log_softmax(ref[i].masked_fill(ref[i] < kth, -math.inf), -1)
        t = c.token_ids[i]
        assert pos[t].logprob == pytest.approx(float(want[t]), abs=1e-4)
        assert sum(math.isfinite(p.logprob) for p in pos.values()) == 2   # top_k=2 masks the rest


def _specs(llama_dir, draft_dir, tmp_path):
    from tests.spec_decode.test_eagle import make_head
    head = make_head(llama_dir, tmp_path, "eagle")
    return {
        "draft_model": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8},
        "eagle-tree": {"method": "eagle", "model": str(head), "num_speculative_tokens": 3, "eagle_topk": 2,
                       "num_draft_tokens": 6},
    }


def test_logprobs_with_speculation_equal_logprobs_without(llama_dir, draft_dir, tokenizer, plain, tmp_path):
    """fp32: greedy, seeded and unseeded-sampled requests in one batch, every method (and a
    prediction): the same tokens (greedy, seeded) and the same logprobs as without speculation."""
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 4)]
    sps = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
           # (a seed whose drafts the random heads get accepted: the accepted paths' logprobs compare)
           SamplingParams(temperature=0.8, seed=10, max_tokens=20, ignore_eos=True, logprobs=0),
           SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5, prompt_logprobs=1),
           SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, logprobs=1)]
    ref = plain.generate(prompts, sps, use_tqdm=False)
    accepted = {}
    for name, spec in _specs(llama_dir, draft_dir, tmp_path).items():
        llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=spec)
        got = llm.generate(prompts, sps, use_tqdm=False)
        m = llm.get_metrics()
        assert m["num_draft_tokens"] > 0, name
        accepted[name] = m["num_accepted_tokens"]
        for i, (g, r) in enumerate(zip(got, ref)):
            gc, rc = g.outputs[0], r.outputs[0]
            assert len(gc.logprobs) == len(gc.token_ids), name
            if i < 3:   # greedy and seeded: same tokens, same values
                assert gc.token_ids == rc.token_ids, name
                for a, b in zip(gc.logprobs, rc.logprobs):
                    assert list(a) == list(b), name
                    for t in a:
                        assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4), name
            # any request: the values are the target's at that token's position
            ref_lp = torch.log_softmax(_forward_logits(llm, prompts[i]["prompt_token_ids"] + gc.token_ids), -1)
            P = len(prompts[i]["prompt_token_ids"])
            for j, t in enumerate(gc.token_ids):
                assert gc.logprobs[j][t].logprob == pytest.approx(float(ref_lp[P - 1 + j, t]), abs=1e-4), name
        assert got[2].prompt_logprobs is not None and len(got[2].prompt_logprobs) == len(prompts[2]["prompt_token_ids"])
    assert accepted["draft_model"] > 0 and accepted["eagle-tree"] > 0, accepted
    # a prediction (64-token drafts) as well
    own = ref[0].outputs[0].token_ids
    got = plain.generate(prompts[0], SamplingParams(**{**_kw(sps[0]), "prediction": own}), use_tqdm=False)[0]
    assert got.metrics.num_accepted_tokens > 10
    for a, b in zip(got.outputs[0].logprobs, ref[0].outputs[0].logprobs):
        assert list(a) == list(b)
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


def _kw(sp: SamplingParams) -> dict:
    from dataclasses import fields
    return {f.name: getattr(sp, f.name) for f in fields(sp) if f.init}


def test_logprobs_end_with_the_tokens_at_a_stop(plain, tokenizer):
    prompt = prompts_of(tokenizer, 1)[0]
    base = plain.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop = base[4]
    c = plain.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                                    stop_token_ids=[stop], logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert c.token_ids[-1] == stop and len(c.logprobs) == len(c.token_ids) <= 5
