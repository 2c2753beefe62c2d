"""The native drafting ops (model/native_draft.py): eager EAGLE-3 chains and dynamic trees, and a
draft model's greedy chains, drafted with them are the drafts the Python loops draft, bit for bit
(the same tokens, parents, draft probabilities and scores every step), for greedy, seeded and
unseeded sampled requests, on targets and drafts with GQA, q/k/v biases and a sliding window, heads
with their own embedding, an fc bias, norm_before_residual, a greedy calibration and a vocabulary
out of order, in float32 and bf16; and greedy output stays the target's."""

from __future__ import annotations

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.model.native_draft import NativeHeadForward
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


def _variant_head(target, out_dir):
    """An EAGLE-3 head with the options the ops read besides the shapes: its own embedding, an fc
    bias, norm_before_residual, a greedy calibration (sampled drafts divide it out) and a draft
    vocabulary in descending target-id order (not ascending: sampled chains pick over the target's
    vocabulary, in Python)."""
    from dataclasses import replace

    from leapfrog.model.eagle import init_eagle_head, save_eagle_head
    from leapfrog.model.loader import load_model, read_checkpoint
    t = load_model(read_checkpoint(target), None, "cpu", 256)
    head = init_eagle_head("eagle3", t.args, seed=2, init_std=0.3, draft_token_ids=list(range(299, 99, -1)),
                           fc_bias=True, own_embedding=True, dtype=torch.bfloat16)
    head.cfg = replace(head.cfg, norm_before_residual=True, greedy_logit_scale=2.0)
    head.layers[0].norm_before_residual = True
    head.bind_target(t)
    return save_eagle_head(head, out_dir)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tokenizer):
    """{shape: (target dir, EAGLE-3 head dir)}; the head's weights bf16 values (the op's linears)."""
    assert len(tokenizer) >= 300
    # (a draft vocabulary that is not the target's first ids: draft id != target id)
    out = {name: (t, make_head(t, tmp_path_factory.mktemp(f"{name}-head"), "eagle3", draft_vocab_size=200,
                               draft_token_ids=list(range(100, 300)), dtype=torch.bfloat16))
           for name, t in save_shapes(tmp_path_factory, tokenizer, SHAPES).items()}
    out["variant"] = (out["qwen2"][0], _variant_head(out["qwen2"][0], tmp_path_factory.mktemp("variant-head")))
    return out


SPECS = {"chain": {"num_speculative_tokens": 4, "eagle_topk": 1},
         "tree": {"num_speculative_tokens": 4, "eagle_topk": 3, "num_draft_tokens": 10}}


def _run(target, head, dtype, native: str, monkeypatch, prompts, params, tree, quant=None):
    with monkeypatch.context() as m:
        m.setenv("LEAPFROG_NATIVE_DRAFTS", native)
        llm = LLM(model=str(target), dtype=dtype, max_model_len=128, max_num_seqs=3, seed=3,
                  speculative_config={"method": "eagle3", "model": str(head), "draft_quantization": quant,
                                      **SPECS[tree]})
    r = llm.engine.proposer.runner
    graphs = [g for g in (r.chain, r.sampled_chain, r.tree) if g is not None]
    assert len(graphs) == 2
    seen, propose = [], llm.engine.proposer.propose

    def record(reqs, ks):
        d = propose(reqs, ks)
        q = None if d.draft_probs is None else d.draft_probs.clone()
        seen.append((d.lists(), d.parent_lists(), q, d.candidate_scores))
        return d
    llm.engine.proposer.propose = record
    outs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
            for ps, sp in params(prompts)]
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    return [g.native_draft for g in graphs], seen, outs


def _params(prompts):
    greedy = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=MAX, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.8, max_tokens=MAX, ignore_eos=True)
    # (the last: one chain call whose rows stream, race and take the argmax)
    return [(prompts, greedy), (prompts[:2], [seeded, greedy]), (prompts[:2], unseeded),
            (prompts, [unseeded, seeded, greedy])]


def _w8a8() -> bool:
    from leapfrog.model.native_linear import w8a8_supported
    return w8a8_supported()


W8A8 = pytest.mark.skipif(not _w8a8(), reason="w8a8 heads need leapfrog's native CPU kernel")


@pytest.mark.parametrize("shape,dtype,tree,quant", [
    ("qwen2", "float32", "chain", None), ("qwen2", "bfloat16", "tree", None), ("gqa_window", "float32", "tree", None),
    ("gqa_window", "bfloat16", "chain", None), ("variant", "float32", "chain", None),
    ("variant", "bfloat16", "tree", None),
    # a head whose linears are w8a8 (quant.W8A8Linear: its fc, layer and LM head in int8: AMX-INT8, VNNI or AVX2)
    pytest.param("qwen2", "bfloat16", "chain", "w8a8", marks=W8A8),
    pytest.param("variant", "float32", "tree", "w8a8", marks=W8A8)])
def test_native_forwards_draft_what_the_python_forward_drafts(heads, tokenizer, shape, dtype, tree, quant,
                                                              monkeypatch):
    target, head = heads[shape]
    prompts = prompts_of(tokenizer, 3)
    calls = []
    for name in ("chain", "sampled_chain", "tree"):   # (count the ops' calls)
        fn = getattr(NativeHeadForward, name)
        monkeypatch.setattr(NativeHeadForward, name,
                            lambda self, *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(self, *a, **kw))
    ref_ops, ref, ref_outs = _run(target, head, dtype, "0", monkeypatch, prompts, _params, tree, quant)
    assert ref_ops == [None, None] and not calls
    ops, got, outs = _run(target, head, dtype, "1", monkeypatch, prompts, _params, tree, quant)
    assert all(op is not None for op in ops) and len(calls) > 10
    # chains and trees in one call each (greedy chains, sampled chains, greedy trees); a head whose
    # vocabulary is not ascending draws its sampled chains in Python
    sampled = set() if shape == "variant" else {"sampled_chain"}
    assert set(calls) == ({"chain"} if tree == "chain" else {"tree"}) | sampled
    assert outs == ref_outs
    assert len(got) == len(ref) > 10
    for (toks, parents, q, scores), (ref_toks, ref_parents, ref_q, ref_scores) in zip(got, ref):
        assert toks == ref_toks and parents == ref_parents and scores == ref_scores
        assert (q is None) == (ref_q is None) and (q is None or torch.equal(q, ref_q))
    if tree == "tree":
        assert any(p != list(range(-1, len(p) - 1)) for _, ps, _, _ in got for p in ps)   # (branching drafts)
    if dtype == "float32":   # lossless: greedy output is the target's alone
        plain = LLM(model=str(target), dtype=dtype, max_model_len=128, max_num_seqs=3)
        sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
        assert outs[0] == [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts],
                                                                          sp, use_tqdm=False)]


@pytest.mark.parametrize("shape,dtype,conf", [("qwen2", "float32", None), ("gqa_window", "bfloat16", None),
                                              ("qwen2", "float32", 0.04), ("gqa_window", "bfloat16", 0.01)])
def test_native_draft_model_chains_draft_what_the_python_loop_drafts(heads, tokenizer, shape, dtype, conf,
                                                                     monkeypatch):
    """A draft model (the target's bf16-valued copy: accepting, yet not always) drafts greedy chains
    with llama_chain: the drafts of its one-forward-per-token loop (LEAPFROG_NATIVE_DRAFTS=0, no
    eager chain), the same output, and greedy output the target's alone; with min_draft_confidence
    (``conf``, low: a random model's probabilities are) chains ended early where the loop ends
    them."""
    from leapfrog.model.native_draft import NativeLlamaForward
    target, _ = heads[shape]
    prompts = prompts_of(tokenizer, 3)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    calls = []
    fn = NativeLlamaForward.chain
    monkeypatch.setattr(NativeLlamaForward, "chain", lambda self, *a, **kw: calls.append(1) or fn(self, *a, **kw))
    runs = {}
    for native in ("0", "1"):
        with monkeypatch.context() as m:
            m.setenv("LEAPFROG_NATIVE_DRAFTS", native)
            llm = LLM(model=str(target), dtype=dtype, max_model_len=128, max_num_seqs=3,
                      speculative_config={"method": "draft_model", "model": "self", "draft_dtype": "bfloat16",
                                          "num_speculative_tokens": 3,
                                          **({} if conf is None else {"min_draft_confidence": conf})})
        prop = llm.engine.proposer
        assert (prop.runner.chain is not None) == (native == "1")
        seen, propose = [], prop.propose
        prop.propose = lambda reqs, ks: seen.append((d := propose(reqs, ks)).lists()) or d
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                             use_tqdm=False)]
        m = llm.get_metrics()
        assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
        runs[native] = (seen, outs)
        assert (len(calls) >= len(seen)) == (native == "1")   # (every step's chain one op call)
    assert runs["0"] == runs["1"] and len(runs["1"][0]) > 5
    lengths = [len(d) for step in runs["1"][0] for d in step if d]
    if conf is not None:   # (more short chains than the requests' ends make, and long ones)
        assert sum(n < 3 for n in lengths) > 2 * len(prompts) and 2 in lengths, lengths
    if dtype == "float32":
        plain = LLM(model=str(target), dtype=dtype, max_model_len=128, max_num_seqs=3)
        assert runs["1"][1] == [o.outputs[0].token_ids for o in plain.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


def test_native_draft_model_chains_run_only_the_tokens_asked_for(heads, tokenizer, monkeypatch):
    """An eager draft-model chain drafts as many tokens as the step's longest draft (a request near
    its max_tokens asks for fewer), not the chain's K as a compiled graph must, with the output of
    the one-forward-per-token loop."""
    from leapfrog.model.native_draft import NativeLlamaForward
    target, _ = heads["qwen2"]
    prompts = prompts_of(tokenizer, 2)
    # (max_tokens 3: the first step may draft one token before the request ends)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 16)]
    spec = {"method": "draft_model", "model": "self", "draft_dtype": "bfloat16", "num_speculative_tokens": 4}
    steps = []
    fn = NativeLlamaForward.chain
    monkeypatch.setattr(NativeLlamaForward, "chain", lambda self, *a, **kw: steps.append(a[10]) or fn(self, *a, **kw))
    outs = {}
    for native in ("0", "1"):
        with monkeypatch.context() as m:
            m.setenv("LEAPFROG_NATIVE_DRAFTS", native)
            llm = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=2, speculative_config=spec)
        outs[native] = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                      sp, use_tqdm=False)] for sp in sps]
    assert outs["0"] == outs["1"]
    assert steps[0] == 1 and 4 in steps, steps


def test_native_sampled_chains_follow_the_target_law(tmp_path_factory):
    """Unseeded and temperature-only sampled requests drafting through eagle3_sampled_chain (a head
    of bf16 values on the kernel): tokens 2 and 3 of 2000 requests follow the target's exact law
    (chi-square through the whole engine, tests/spec_decode/test_sampling_lossless.py)."""
    from leapfrog.demo import save_random_llama
    from leapfrog.model.native_draft import NativeHeadForward
    from tests.spec_decode.test_sampling_lossless import SETTINGS, SMALL, assert_follows_target
    target = save_random_llama(tmp_path_factory.mktemp("tiny3"), None, seed=3, **{**SMALL, "num_hidden_layers": 3})
    head = make_head(target, tmp_path_factory.mktemp("head"), "eagle3", seed=1, draft_vocab_size=9,
                     draft_token_ids=[1, 2, 3, 5, 6, 7, 8, 10, 11], dtype=torch.bfloat16)

    def native(llm):
        assert isinstance(llm.engine.proposer.runner.sampled_chain.native_draft, NativeHeadForward)
    calls = []
    fn = NativeHeadForward.sampled_chain
    with pytest.MonkeyPatch.context() as m:
        m.setattr(NativeHeadForward, "sampled_chain", lambda self, *a, **kw: calls.append(1) or fn(self, *a, **kw))
        assert_follows_target(target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2,
                                       "eagle_topk": 1}, SETTINGS[1], seed=4, after=native,
                              max_num_seqs=32)   # (batches the eager loops take: up to 85 sequences of 3 tokens)
    assert len(calls) >= 2000 // 32


def test_the_ops_need_the_norm_ops_instruction_set(monkeypatch):
    """The drafting ops compile native_ops' row kernels; built for another instruction set than the
    norm/RoPE ops (one of the two fell back to generic), their lanes round differently, so the ops
    stand down and the Python loops serve."""
    import leapfrog.model.native_draft as nd
    import leapfrog.model.native_ops as no
    assert nd.load_native_draft() and nd._LIBRARY.build == no.native_ops_build()
    monkeypatch.setitem(no._STATE, "build", "generic" if nd._LIBRARY.build != "generic" else "avx2")
    monkeypatch.setattr(nd, "_MISMATCH", [])
    assert not nd.load_native_draft()
