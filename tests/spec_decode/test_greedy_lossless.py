"""Greedy, fp32, CPU: output with speculation equals output without it, token for token."""

from __future__ import annotations

import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError
from tests.conftest import greedy_baseline, prompts_of

MAX = 40


@pytest.fixture(scope="module")
def baseline(llama_dir, tokenizer):
    _, prompts, outs = greedy_baseline(llama_dir, tokenizer, 8, MAX)
    return prompts, [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


def run(path, spec, prompts, sp, **kw):
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=spec, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("bs", [1, 3, 8])
def test_ngram_equal(llama_dir, baseline, k, bs):
    prompts, ref, _ = baseline
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm, outs = run(llama_dir, spec, prompts[:bs], SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref[:bs]
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_drafting_ends_at_the_draft_models_context(llama_dir, baseline, tmp_path):
    """A draft model trained on a shorter context than the target's max_model_len drafts only at
    positions inside it (vLLM's speculative max_model_len: by default the smaller of the two); a
    sequence past it decodes without speculation, greedy output unchanged. A max_model_len
    beyond the draft's context or the target's is refused."""
    import json
    import shutil
    short = tmp_path / "short"
    shutil.copytree(llama_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 24}))   # (rope: llama3's own)
    prompts, ref, _ = baseline
    spec = {"method": "draft_model", "model": str(short), "num_speculative_tokens": 4}
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=spec)
    assert llm.engine.spec_controller.max_model_len == 24
    ends, prefilled = [], []
    real, real_prefill = llm.engine.proposer.propose, llm.engine.proposer.prefill
    llm.engine.proposer.propose = lambda reqs, ks, **kw: (
        ends.extend(r.num_computed + k for r, k in zip(reqs, ks) if k) or real(reqs, ks, **kw))
    llm.engine.proposer.prefill = lambda reqs: prefilled.extend(len(r.prompt_ids) for r in reqs) or real_prefill(reqs)
    some = [0, 1, 3, 2]   # (prompts of 14, 7, 15 and 36 tokens: the last never drafts, nor prefills the draft)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in some],
                        SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in some]
    assert [len(prompts[i]) for i in some] == [14, 7, 15, 36] and sorted(prefilled) == [7, 14, 15]
    assert 20 <= max(ends) <= 23   # (the last draft's position: under 24)
    for bad, why in ((25, "draft model's context, 24"), (257, "target's max_model_len, 256")):
        with pytest.raises(ConfigError, match=why):
            LLM(model=str(llama_dir), dtype="float32", max_model_len=256,
                speculative_config={**spec, "max_model_len": bad})
    with pytest.raises(ConfigError, match="target's max_model_len"):
        LLM(model=str(llama_dir), dtype="float32", max_model_len=256,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 300})
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256,
              speculative_config={**spec, "max_model_len": 12})
    assert llm.engine.spec_controller.max_model_len == 12


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("bs", [1, 5])
def test_draft_model_unrelated_equal(llama_dir, draft_dir, baseline, k, bs):
    prompts, ref, _ = baseline
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    llm, outs = run(llama_dir, spec, prompts[:bs], SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref[:bs]
    m = llm.get_metrics()
    assert m["acceptance_rate"] < 0.5  # an unrelated random draft is mostly rejected


@pytest.mark.parametrize("k", [1, 3, 6])
def test_target_as_draft_accepts_everything(llama_dir, baseline, k):
    prompts, ref, _ = baseline
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": k}
    llm, outs = run(llama_dir, spec, prompts[:4], SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref[:4]
    for o in outs:
        s = o.metrics.spec
        assert s.num_accepted_tokens == s.num_draft_tokens
        # after the prefill's token, every step drafts k (the last fewer, capped by max_tokens)
        # and takes k + 1 tokens; a last step with room for one token drafts nothing
        left = MAX - 1
        assert o.metrics.num_target_forwards == -(-left // (k + 1))
        assert s.num_drafts == left // (k + 1) + (left % (k + 1) > 1)


@pytest.mark.parametrize("wrong_at", [0, 1, 2, 3])
@pytest.mark.parametrize("bs", [1, 4])
def test_oracle_partial_acceptance(llama_dir, baseline, oracle, wrong_at, bs):
    prompts, ref, _ = baseline
    method = oracle({tuple(p): r for p, r in zip(prompts, ref)}, wrong_at)
    llm, outs = run(llama_dir, {"method": method, "num_speculative_tokens": 4}, prompts[:bs],
                    SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref[:bs]
    for o in outs:
        per_pos = o.metrics.spec.num_accepted_tokens_per_pos
        assert all(v == 0 for v in per_pos[wrong_at:])
        assert all(v == o.metrics.spec.num_drafts for v in per_pos[:min(wrong_at, 1)])


def test_stop_strings_and_max_tokens_mid_draft(llama_dir, baseline):
    prompts, ref, texts = baseline
    stop = texts[0][8:11]
    sp = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, stop=[stop])
    plain = LLM(model=str(llama_dir), dtype="float32", max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts[:4]], sp, use_tqdm=False)
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 5}
    _, outs = run(llama_dir, spec, prompts[:4], sp)
    for a, b in zip(plain, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert outs[0].outputs[0].finish_reason == "stop"
    assert any(len(o.outputs[0].token_ids) == 23 for o in outs)


def test_adaptive_and_disable_by_batch_size_still_lossless(llama_dir, baseline):
    prompts, ref, _ = baseline
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": True,
            "adaptive_explore_interval": 3}
    _, outs = run(llama_dir, spec, prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == ref
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2}
    llm, outs = run(llama_dir, spec, prompts[:6], sp)
    assert [o.outputs[0].token_ids for o in outs] == ref[:6]


@pytest.mark.parametrize("spec, match", [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_speculative_config(llama_dir, spec, match):
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(llama_dir), speculative_config=spec)


def test_incompatible_draft_tokenizer(tmp_path, llama_dir):
    from leapfrog.demo import build_tokenizer, save_random_llama
    other = build_tokenizer("completely different text " * 200 + "zzz yyy xxx", vocab_size=320)
    d = save_random_llama(tmp_path / "d", other, vocab_size=320, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ConfigError, match="vocabulary|token"):
        LLM(model=str(llama_dir), speculative_config={"method": "draft_model", "model": str(d),
                                                     "num_speculative_tokens": 2})
    d2 = save_random_llama(tmp_path / "d2", other, vocab_size=400, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ConfigError, match="vocab_size"):
        LLM(model=str(llama_dir), speculative_config={"method": "draft_model", "model": str(d2),
                                                     "num_speculative_tokens": 2})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_penalties_and_min_tokens_with_speculation(llama_dir, draft_dir, tokenizer, method):
    """Penalties read the draft-extended history at every verified position."""
    prompts = prompts_of(tokenizer, 3)
    sp = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.4,
                        presence_penalty=0.2, min_tokens=10)
    base = LLM(model=str(llama_dir), dtype="float32", max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1} if method == "ngram" else
            {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 4})
    llm, outs = run(llama_dir, spec, prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0
    if method == "draft_model":  # the target drafting for itself: penalised p and q agree
        assert m["num_accepted_tokens"] == m["num_draft_tokens"]
