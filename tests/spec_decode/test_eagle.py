"""EAGLE-1 and EAGLE-3 proposers through the whole engine: greedy output identical to no
speculation (fp32) for chains (eagle_topk 1), dynamic trees and static trees, batched and
ragged, on several target shapes; the sampling law unchanged (chi-square against exact
enumeration) with branching trees; clear errors for mismatched heads."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import save_random_llama
from leapfrog.errors import ConfigError
from leapfrog.model import compiled
from leapfrog.model.eagle import init_eagle_head, save_eagle_head
from leapfrog.model.loader import load_model, read_checkpoint
from tests.conftest import BASE, CONFIGS, prompts_of, save_shapes
from tests.spec_decode.test_sampling_lossless import N, SETTINGS, SMALL, assert_follows_target

MAX = 32
# 3 layers: EAGLE-3 fuses three target layers
HEAD_DIM_32 = dict(arch="llama", head_dim=32, num_attention_heads=4, num_key_value_heads=2)
SHAPES = {k: {**v, "num_hidden_layers": 3} for k, v in {**CONFIGS, "head_dim_32": HEAD_DIM_32}.items()}


def make_head(target_dir, out_dir, kind: str, seed: int = 0, **kw):
    target = load_model(read_checkpoint(target_dir), None, "cpu", 256)
    head = init_eagle_head(kind, target.args, seed=seed, init_std=0.3, **kw)
    head.bind_target(target)
    return save_eagle_head(head, out_dir)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory, tokenizer):
    return {name: (t, {k: make_head(t, tmp_path_factory.mktemp(f"{name}-{k}"), k,
                                    **({"draft_vocab_size": 200} if k == "eagle3" else {}))
                       for k in ("eagle", "eagle3")})
            for name, t in save_shapes(tmp_path_factory, tokenizer, SHAPES).items()}


def _generate(target, spec, prompts, sp, **kw):
    llm = LLM(model=str(target), dtype="float32", max_model_len=256, speculative_config=spec, **{"max_num_seqs": 8, **kw})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


TREES = {
    "chain": {"num_speculative_tokens": 4, "eagle_topk": 1},
    "dynamic": {"num_speculative_tokens": 4, "eagle_topk": 3, "num_draft_tokens": 10},
    "auto": {"num_speculative_tokens": 3, "eagle_topk": 3, "num_draft_tokens": "auto"},
    "static": {"num_speculative_tokens": 3,
               "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"},
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_equal(shapes, tokenizer, shape, kind):
    target, heads = shapes[shape]
    prompts = prompts_of(tokenizer, 5)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    _, ref = _generate(target, None, prompts, sp)
    for tree, extra in TREES.items():
        spec = {"method": kind, "model": str(heads[kind]), **extra}
        for bs in (1, 5):
            llm, got = _generate(target, spec, prompts[:bs], sp)
            assert got == ref[:bs], (tree, bs)
            assert llm.get_metrics()["num_draft_tokens"] > 0, (tree, bs)


def _w8a8() -> bool:
    from leapfrog.model.native_linear import w8a8_supported
    return w8a8_supported()


W8A8 = pytest.mark.skipif(not _w8a8(), reason="w8a8 heads need leapfrog's native CPU kernel")


@pytest.mark.parametrize("kind, quant", [("eagle", "int8"), ("eagle3", "int8"), ("eagle3", "int4"),
                                         pytest.param("eagle3", "w8a8", marks=W8A8)])
def test_quantized_heads_greedy_equal(shapes, tokenizer, kind, quant):
    """``draft_quantization`` quantizes a head's linears (and an EAGLE-3 head's own LM head): q
    changes, the output does not (chains and trees, batched and ragged)."""
    from leapfrog.model.quant import QUANT_LINEARS
    target, heads = shapes["llama_gqa_llama3"]
    prompts = prompts_of(tokenizer, 5)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    _, ref = _generate(target, None, prompts, sp)
    for tree in ("chain", "dynamic"):   # (a batch of 5 ragged prompts)
        spec = {"method": kind, "model": str(heads[kind]), "draft_quantization": quant, **TREES[tree]}
        llm, got = _generate(target, spec, prompts, sp)
        assert got == ref, tree
        assert llm.get_metrics()["num_draft_tokens"] > 0
    head = llm.engine.proposer.head
    cls = QUANT_LINEARS[quant]
    assert isinstance(head.fc, cls) and isinstance(head.layers[0].w13, cls)
    assert isinstance(head.head.proj, cls) if kind == "eagle3" else head.head is None


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("tiny3"), None, seed=3, **{**SMALL, "num_hidden_layers": 3})


@pytest.mark.parametrize("kind, quant, i", [("eagle", None, 0), ("eagle", None, 1), ("eagle3", None, 0),
                                           ("eagle3", None, 1), ("eagle", "int8", 0), ("eagle3", "int8", 1),
                                           pytest.param("eagle3", "w8a8", 1, marks=W8A8)])
def test_sampling_follows_target(tiny3, tmp_path, kind, quant, i):
    """(quant: a quantized head's q, in the rejection test as everywhere: still the target's law.)"""
    target = tiny3
    head = make_head(target, tmp_path / "h", kind, seed=i, **({"draft_vocab_size": 9} if kind == "eagle3" else {}))
    # full support and flat enough: one prompt means one fixed tree, which must be able to hit
    sp = [SETTINGS[0], SamplingParams(temperature=1.6, top_p=0.98, max_tokens=3, ignore_eos=True)][i]
    assert_follows_target(target, {"method": kind, "model": str(head), "num_speculative_tokens": 2,
                                   "eagle_topk": 3, "num_draft_tokens": 6, "draft_quantization": quant}, sp, seed=i)


HOT = SamplingParams(temperature=1.6, max_tokens=3, ignore_eos=True)   # flat: noise reused between tokens would show


@pytest.mark.slow
def test_sampled_eagle_rounds_follow_target(tiny3, tmp_path):
    """Multi-step speculation with an EAGLE-3 chain and unseeded sampled requests (rounds verified
    by rejection sampling with uniforms of each request's generator; a draft vocabulary of 9 of
    the 12 tokens): tokens 2 and 3 follow the target's exact law."""
    head = make_head(tiny3, tmp_path / "h", "eagle3", seed=2, draft_vocab_size=9)

    def ran_rounds(llm):
        g = llm.engine.runner.sampled_round
        assert sum(d.calls for d in g.direct.values()) >= N // 4   # (max_tokens 3: two rounds for most)
    with patch.dict(compiled.INDUCTOR_OPTIONS, {"max_autotune": False}):
        assert_follows_target(tiny3, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 1,
                                      "eagle_topk": 1}, HOT, seed=7, after=ran_rounds,
                              enforce_eager=False, max_num_seqs=4, num_scheduler_steps=3)


def test_errors(shapes, tmp_path):
    target, heads = shapes["llama_gqa_llama3"]
    with pytest.raises(ConfigError, match="eagle3"):
        LLM(model=str(target), speculative_config={"method": "eagle", "model": str(heads["eagle3"]),
                                                   "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="needs 'model'"):
        LLM(model=str(target), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        LLM(model=str(target), speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                   "num_draft_tokens": 4})
    other = save_random_llama(tmp_path / "o", None, seed=2, **{**BASE, "hidden_size": 32, "vocab_size": 320})
    from leapfrog.errors import CheckpointError
    with pytest.raises((CheckpointError, ConfigError)):
        LLM(model=str(other), skip_tokenizer_init=True,
            speculative_config={"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 2})


def test_static_tree_ranks_past_the_draft_vocabulary_are_refused(shapes, tmp_path):
    target, _ = shapes["llama_gqa_llama3"]
    head = make_head(target, tmp_path / "h", "eagle3", draft_vocab_size=64)
    with pytest.raises(ConfigError, match="child rank 64 but the head drafts from 64 tokens"):
        LLM(model=str(target), speculative_config={"method": "eagle3", "model": str(head),
                                                      "num_speculative_tokens": 1,
                                                      "speculative_token_tree": "[(0,), (64,)]"})


def test_draft_quantization_without_kernels_fails_before_the_head_loads(shapes, tmp_path, monkeypatch):
    """A draft_quantization whose kernel fails here is a ConfigError naming the field, raised before
    the head is read (the head path does not even exist)."""
    from leapfrog.model import quant

    class Broken:
        def __init__(self, *args):
            raise RuntimeError("no kernel for this dtype")
    monkeypatch.setitem(quant.QUANT_LINEARS, "int8", Broken)
    target, _ = shapes["llama_gqa_llama3"]
    with pytest.raises(ConfigError, match="speculative_config.draft_quantization='int8'.*no working int8"):
        LLM(model=str(target), speculative_config={"method": "eagle3", "model": str(tmp_path / "missing"),
                                                   "num_speculative_tokens": 2, "draft_quantization": "int8"})


def test_greedy_seeded_and_sampled_requests_mix_in_one_tree_batch(shapes, tokenizer):
    """Greedy requests keep the exact greedy output and seeded ones their seeded output while
    unseeded sampled requests share their tree-verification steps."""
    target, heads = shapes["qwen2"]
    prompts = prompts_of(tokenizer, 6)
    greedy = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=MAX, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=10, max_tokens=MAX, ignore_eos=True)
    _, ref_greedy = _generate(target, None, prompts[:2], greedy)
    _, ref_seeded = _generate(target, None, prompts[2:4], seeded)
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), **TREES["dynamic"]}
    llm = LLM(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy] * 2 + [seeded] * 2 + [sampled] * 2,
                        use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    assert ids[:2] == ref_greedy
    assert ids[2:4] == ref_seeded
    assert all(len(x) == MAX for x in ids[4:])
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_seeded_speculation_draws_each_positions_noise_once(shapes, tokenizer, tree):
    """A seeded request's drafter (at n+1..n+K) and verifier (at n..n+K) race with the same
    position noise, and the rejected positions come back next step: each position's noise row is
    computed at most once while the request needs it (Request.noise_rows; the C++ races compute
    what they read and keep nothing), so a run computes at most about one position per output
    token, as plain decoding does, and the output is still the seeded one."""
    from leapfrog.sampling import sampler
    target, heads = shapes["llama_gqa_llama3"]
    prompts = prompts_of(tokenizer, 3)
    sp = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=MAX, ignore_eos=True) for i in range(3)]
    _, ref = _generate(target, None, prompts, sp)
    drawn = []
    real = sampler.position_noise

    def counted(keys, vocab_size, exponential):
        drawn.extend((k, exponential) for k in keys)
        return real(keys, vocab_size, exponential)
    with patch.object(sampler, "position_noise", counted):
        llm, ids = _generate(target, {"method": "eagle3", "model": str(heads["eagle3"]), **TREES[tree]}, prompts, sp)
    assert ids == ref
    assert llm.get_metrics()["num_draft_tokens"] > 0
    # each request's MAX positions, and the drafts past its end
    assert len(drawn) == len(set(drawn)) and len(drawn) <= 3 * (MAX + TREES[tree]["num_speculative_tokens"] + 1)


@pytest.mark.parametrize("where", ["verify", "draft"])
def test_failed_batch_keeps_drafting_for_the_others(shapes, tokenizer, where):
    """A batched step that raises (in verification, or inside the head's own forward) is retried
    request by request: the failing request ends with "error", the others keep their exact greedy
    output and keep drafting from the target features they already have."""
    target, heads = shapes["llama_gqa_llama3"]
    prompts = prompts_of(tokenizer, 4)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    _, ref = _generate(target, None, prompts, sp)
    llm = LLM(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=8,
              speculative_config={"method": "eagle3", "model": str(heads["eagle3"]), **TREES["dynamic"]})
    eng, prop = llm.engine, llm.engine.proposer
    drafted_after: dict[str, list[int]] = {}
    state = {"faulted": False}

    def bad_now(reqs) -> bool:
        hit = any(r.request_id == "r0" and len(r.output_ids) >= 3 for r in reqs)
        state["faulted"] |= hit
        return hit

    def fault(reqs):
        if bad_now(reqs):
            raise RuntimeError("injected fault")
    real_propose, real_step = prop.propose, prop.runner.step

    def propose(reqs, ks):
        drafts = real_propose(reqs, ks)
        if state["faulted"]:
            for r, n in zip(reqs, drafts.num_draft):
                drafted_after.setdefault(r.request_id, []).append(n)
        return drafts

    def head_step(chunks, **kw):
        if where == "draft" and len(chunks) > 1 and bad_now(list(eng.requests.values())):
            raise RuntimeError("injected fault")
        return real_step(chunks, **kw)
    prop.propose, prop.runner.step = propose, head_step
    if where == "verify":
        eng.fault_injector = fault
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", None, p, sp)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert state["faulted"]
    for i in range(1, 4):
        assert outs[f"r{i}"].outputs[0].token_ids == ref[i]
        assert drafted_after[f"r{i}"] and all(n > 0 for n in drafted_after[f"r{i}"][:-1]), drafted_after[f"r{i}"]
    assert eng.kv.num_free == eng.kv.num_rows


def test_sampled_requests_draft_sampled_chains_and_seeded_ones_race_chains(shapes, tokenizer, monkeypatch):
    """In a tree batch, greedy requests branch (top tokens, point masses); unseeded sampled
    requests draft one sampled token per level with their q (rejection sampling needs it), each an
    inverse-CDF draw with one uniform of the request's generator (nothing more drawn from it);
    seeded ones draft the chain of the race's winners under q with the target's own (seed,
    position) noise at each depth (the coupling that makes matching accept often), as the fused
    sampled chain loop drafts them."""
    from leapfrog.sampling import sampler
    target, heads = shapes["llama_gqa_llama3"]
    prompts = prompts_of(tokenizer, 3)
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), **TREES["dynamic"]}
    llm = LLM(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=spec)
    eng, prop = llm.engine, llm.engine.proposer
    seen, seeded_positions, drafting, streams = [], [], [], []
    real, real_race = prop.propose, sampler.race_top

    def race_top(p, rngs, k):
        for r in rngs:
            if isinstance(r, sampler.PositionKey) and drafting:
                seeded_positions[-1][1].append(r.position)
        return real_race(p, rngs, k)

    def propose(reqs, ks):
        r2 = [r for r in reqs if r.request_id == "r2"]
        if r2:
            seeded_positions.append((len(r2[0].output_ids), []))
        drafting.append(1)
        r1 = [r for r in reqs if r.request_id == "r1"]
        before = r1[0].generator.get_state() if r1 else None
        drafts = real(reqs, ks)
        drafting.clear()
        seen.append(([r.request_id for r in reqs], drafts))
        if r1:
            streams.append((before, r1[0].generator.get_state()))
        return drafts
    prop.propose = propose
    monkeypatch.setattr(sampler, "race_top", race_top)
    sps = [SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True),
           SamplingParams(temperature=0.9, top_k=20, max_tokens=MAX, ignore_eos=True),
           SamplingParams(temperature=0.9, seed=5, max_tokens=MAX, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        eng.add_request(f"r{i}", None, p, sp)
    while eng.has_unfinished():
        eng.step()
    branched = {"r0": False}
    drew = 0
    for ids, drafts in seen:
        o, parents = drafts.offsets(), drafts.parent_lists()
        for b, rid in enumerate(ids):
            n = drafts.num_draft[b]
            if rid in branched:
                branched[rid] |= parents[b] != list(range(-1, n - 1))
                continue
            assert parents[b] == list(range(-1, n - 1)), parents[b]      # a chain (r1 and the seeded r2)
            if n and rid == "r1":
                q = drafts.draft_probs[o[b]:o[b + 1]]                    # [n, V]
                torch.testing.assert_close(q.sum(-1), torch.ones(n))
                assert bool((q.gather(1, drafts.token_ids[o[b]:o[b + 1], None]) > 0).all())
                assert int((q[0] > 0).sum()) <= 20                       # the request's top_k
                # each token x ~ q by inverse CDF, one float64 uniform of the stream per level
                before, after = streams[drew]
                g = torch.Generator()
                g.set_state(before)
                w = torch.rand(n, generator=g, dtype=torch.float64)
                assert drafts.token_ids[o[b]:o[b + 1]].tolist() == sampler.inverse_cdf_draw(q, w).tolist()
                assert torch.equal(g.get_state(), after)
            if rid == "r1":
                drew += 1
    assert all(branched.values()) and any(d.draft_probs is not None for _, d in seen)
    assert drew == len(streams) > 0
    # the seeded request's nodes at depth d race with the noise of output position n + d - 1
    assert seeded_positions
    for n, p in seeded_positions:
        assert p == sorted(p) and sorted(set(p)) == list(range(n, n + len(set(p)))), (n, p)


def test_seeded_requests_in_a_tree_config_draft_the_fused_race_chain(shapes, tokenizer, monkeypatch):
    """A step of seeded temperature-only requests with tree settings drafts each its chain of the
    race's winners from the fused sampled chain loop (one call a step, as unseeded requests do),
    not a tree grown level by level in Python (at the tree's depth: 0.78x no speculation against
    the chain's 1.56x at batch 1 on the built-in pair, stop 114); the output is the seeded one."""
    target, heads = shapes["llama_gqa_llama3"]
    prompts = prompts_of(tokenizer, 3)
    sp = [SamplingParams(temperature=0.8, seed=21 + i, max_tokens=MAX, ignore_eos=True) for i in range(3)]
    _, ref = _generate(target, None, prompts, sp)
    llm = LLM(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=8,
              speculative_config={"method": "eagle3", "model": str(heads["eagle3"]), **TREES["dynamic"]})
    seen, calls, runner = _recording(llm), [], llm.engine.proposer.runner
    chain = runner.draft_sampled_chain
    monkeypatch.setattr(runner, "draft_sampled_chain", lambda *a, **kw: calls.append(1) or chain(*a, **kw))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    drafted = [(toks, parents) for lists, parent_lists in seen for toks, parents in zip(lists, parent_lists) if toks]
    assert drafted and all(parents == list(range(-1, len(toks) - 1)) for toks, parents in drafted)
    assert max(len(toks) for toks, _ in drafted) == TREES["dynamic"]["num_speculative_tokens"]
    assert len(calls) == sum(any(lists) for lists, _ in seen)   # every drafting step: one fused call


def _recording(llm: LLM) -> list:
    """Record every DraftBatch the LLM's proposer returns, as per-request (tokens, parents) lists."""
    seen, propose = [], llm.engine.proposer.propose

    def record(reqs, ks):
        d = propose(reqs, ks)
        seen.append((d.lists(), d.parent_lists()))
        return d
    llm.engine.proposer.propose = record
    return seen


@pytest.mark.slow
def test_int8_head_in_compiled_rounds(shapes, tokenizer):
    """An int8 EAGLE-3 head (leapfrog's int8 op where the CPU has it) inside the compiled
    speculation rounds (num_scheduler_steps): greedy output equal to no speculation, the rounds
    graph did the decoding."""
    from leapfrog.model.quant import Int8Linear
    target, heads = shapes["llama_gqa_llama3"]
    prompts = prompts_of(tokenizer, 2)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    _, ref = _generate(target, None, prompts, sp)
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), "draft_quantization": "int8", **TREES["chain"]}
    with patch.dict(compiled.INDUCTOR_OPTIONS, {"max_autotune": False}):
        llm, got = _generate(target, spec, prompts, sp, enforce_eager=False, num_scheduler_steps=3, max_num_seqs=2)
    assert got == ref
    head = llm.engine.proposer.head
    assert isinstance(head.layers[0].w13, Int8Linear) and isinstance(head.head.proj, Int8Linear)
    g = llm.engine.runner.round
    assert sum(d.calls for d in g.direct.values()) > 0


@pytest.mark.parametrize("kind,tree", [("eagle3", "chain"), ("eagle", "chain"), ("eagle", "narrow"),
                                       ("eagle3", "dynamic")])
def test_eager_fused_drafts_equal_the_expansion(shapes, tokenizer, kind, tree, monkeypatch):
    """enforce_eager=True (the default) drafts greedy chains and dynamic trees, and seeded and
    unseeded sampled chains, with the fused drafting loops run eagerly (one call per step): the
    same tokens and parents every step as the level-by-level expansion
    (LEAPFROG_EAGER_FUSED_DRAFTS=0), float32, greedy and seeded requests in one batch, unseeded
    ones in another, and the same outputs."""
    from leapfrog.model.compiled import CompiledChain
    target, heads = shapes["llama_untied"]
    prompts = prompts_of(tokenizer, 3)
    shape = {"num_speculative_tokens": 4, "eagle_topk": 3, "num_draft_tokens": 6} if tree == "narrow" else TREES[tree]
    spec = {"method": kind, "model": str(heads[kind]), **shape}

    def make(fused):
        with monkeypatch.context() as m:
            m.setenv("LEAPFROG_EAGER_FUSED_DRAFTS", fused)
            return LLM(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=3, seed=3,
                       speculative_config=spec)
    llms = {fused: make(fused) for fused in ("0", "1")}
    drafts = {fused: _recording(llm) for fused, llm in llms.items()}
    calls = []
    orig = CompiledChain.__call__   # (CompiledTree's and CompiledSampledChain's too)
    monkeypatch.setattr(CompiledChain, "__call__",
                        lambda self, *a, **kw: calls.append(type(self).__name__) or orig(self, *a, **kw))
    sps = [SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True),
           SamplingParams(temperature=0.8, seed=5, max_tokens=MAX, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)]
    unseeded = SamplingParams(temperature=0.8, max_tokens=MAX, ignore_eos=True)   # (no row races)
    outs = {}
    for fused, llm in llms.items():
        outs[fused] = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], s,
                                                                     use_tqdm=False)]
                       for ps, s in ((prompts, sps[0]), (prompts[:2], sps[1:]), (prompts[:2], unseeded))]
        assert llm.get_metrics()["num_draft_tokens"] > 0
    assert outs["0"] == outs["1"]
    assert drafts["0"] == drafts["1"] and len(drafts["1"]) > 4
    assert llms["0"].engine.proposer.runner.chain is None
    want = {"CompiledChain"} if tree == "chain" else {"CompiledTree"}
    assert want <= set(calls), calls
    branching = [p != list(range(-1, len(p) - 1)) for _, ps in drafts["1"] for p in ps]
    assert any(branching) == (tree != "chain")


def test_eager_chains_run_only_the_levels_drafted(shapes, tokenizer, monkeypatch):
    """An eager drafting loop runs as many head forwards as the deepest draft of its step (a
    request near its max_tokens drafts fewer levels), not the whole depth as a compiled graph
    must: greedy and sampled chains, and the same output as the level-by-level expansion."""
    from leapfrog.model.compiled import CompiledChain
    target, heads = shapes["llama_untied"]
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), **TREES["chain"]}

    def make(fused):
        with monkeypatch.context() as m:
            m.setenv("LEAPFROG_EAGER_FUSED_DRAFTS", fused)
            return LLM(model=str(target), dtype="float32", max_model_len=64, max_num_seqs=2, seed=1,
                       speculative_config=spec)
    llm, ref = make("1"), make("0")
    forwards, steps = [], []
    fwd = CompiledChain._forward
    monkeypatch.setattr(CompiledChain, "_forward", lambda self, *a, **kw: forwards.append(1) or fwd(self, *a, **kw))
    propose = llm.engine.proposer.propose

    def counted(reqs, ks):
        forwards.clear()
        d = propose(reqs, ks)
        if forwards:
            steps.append((max(d.num_draft), len(forwards)))
        return d
    llm.engine.proposer.propose = counted
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 2)]
    for sp in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True, seed=2)):
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert outs == [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    assert any(n < 4 for n, _ in steps) and any(n == 4 for n, _ in steps), steps
    assert all(n == f for n, f in steps), steps


def _always_drafting(llm: LLM, at_least: int) -> None:
    """Every step of ``llm``'s "auto" controller drafts at least ``at_least`` nodes: its sizes
    hang on measured times, and a slow or busy machine may settle on no speculation (a CI run did)."""
    ctl = llm.engine.spec_controller
    choose = ctl.choose
    ctl.choose = lambda reqs, **kw: [max(k, at_least) for k in choose(reqs, **kw)]
    ctl.drafting_off = lambda batch_size, sampled=None: False


def test_sampled_chains_carry_no_confidence(shapes, tokenizer):
    """An unseeded sampled request's drafts (a chain drawn from q) give the auto tree size no
    candidate scores (None: what its controller weighs by alpha instead); greedy ones do."""
    target, heads = shapes["llama_untied"]
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), **TREES["auto"]}
    llm = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=2, speculative_config=spec)
    seen, propose = [], llm.engine.proposer.propose
    _always_drafting(llm, 3)

    def record(reqs, ks):
        d = propose(reqs, ks)
        seen.extend((r.unseeded_sampled, n, sc) for r, n, sc in zip(reqs, d.num_draft, d.candidate_scores))
        return d
    llm.engine.proposer.propose = record
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 2)]
    for sp in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
               SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)):
        llm.generate(prompts, sp, use_tqdm=False)
    drafted = [(free, sc) for free, n, sc in seen if n]
    assert {free for free, _ in drafted} == {True, False}
    assert all((sc is None) == free for free, sc in drafted)


def test_eager_loops_stay_small_at_large_batches(shapes, monkeypatch):
    """The eager drafting loops take every batch size while their inputs' masks stay small (larger
    ones grow level by level; the sampled chain's steps' draws small too) and pad no sequence to the bucket's tokens, their "no race" uniforms
    are a broadcast view (no max_num_seqs x steps x V buffer), and LEAPFROG_NATIVE_ATTENTION=0
    reaches them as it reaches other eager forwards."""
    from leapfrog.model.compiled import BUCKET_TOKENS, EAGER_MASK_BYTES, EAGER_STEP_BYTES, Bucket, eager_buckets
    target, heads = shapes["llama_untied"]
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), **TREES["chain"]}
    llm = LLM(model=str(target), dtype="float32", max_model_len=64, max_num_seqs=80, speculative_config=spec)
    runner = llm.engine.proposer.runner
    s = runner.chain.steps + 1
    # (a 64-column mask: every batch size; beyond BUCKET_TOKENS only while the masks stay small)
    assert [b.batch for b in runner.chain.warmed] == list(range(1, runner.kv.num_rows + 1))
    rows = runner.kv.num_rows
    assert runner.chain.bucket_for(rows + 1, 2, 10) is None
    long = EAGER_MASK_BYTES // BUCKET_TOKENS * 4                            # the floor: 256 tokens
    assert [b.batch for b in eager_buckets(1000, s, long)] == list(range(1, BUCKET_TOKENS // s + 1))
    mid = EAGER_MASK_BYTES // (2 * BUCKET_TOKENS)                           # the mask's bound: 512 tokens
    assert [b.batch for b in eager_buckets(1000, s, mid)] == list(range(1, 2 * BUCKET_TOKENS // s + 1))
    # the sampled chain also bounds its steps' [batch, steps, V] draws and probabilities (here
    # small: every batch size), never under 256 tokens
    V = llm.engine.proposer.head.args.vocab_size
    assert [b.batch for b in runner.sampled_chain.warmed] == list(range(1, rows + 1))
    huge = EAGER_STEP_BYTES // (BUCKET_TOKENS // s)   # [steps, V] bytes a sequence that allows 256 tokens
    assert len(eager_buckets(1000, s, 64, seq_bytes=huge)) == BUCKET_TOKENS // s
    assert len(eager_buckets(1000, s, 64, seq_bytes=16 * (s - 1) * V)) == min(1000, EAGER_STEP_BYTES // (16 * (s - 1) * V))
    # nothing padded: a catch-up of 2 tokens for 40 sequences runs 80 rows, not 40 x (depth + 1)
    assert runner.chain.bucket_for(40, 2, 10) == Bucket(40, 2) and runner.chain.bucket_for(60, 2, 10) == Bucket(60, 2)
    # so their persistent inputs (each with a batch x tokens x max_model_len mask) are kept for the
    # latest 16 shapes only
    from leapfrog.model.runner import SeqChunk
    for b in range(1, 21):
        runner._fill([SeqChunk(0, 0, [1], 1)] * b, 2, eager=True)
    assert len(runner._eager_arenas) == 16 and (20, 2) in runner._eager_arenas and (1, 2) not in runner._eager_arenas
    u = runner.sampled_chain.unread(40, torch.device("cpu"))
    assert u.shape == (40, runner.chain.steps, runner.model.args.vocab_size) and u.stride() == (0, 0, 0)
    assert runner.chain.native == runner._native_attention()
    monkeypatch.setenv("LEAPFROG_NATIVE_ATTENTION", "0")
    off = LLM(model=str(target), dtype="float32", max_model_len=64, max_num_seqs=2, speculative_config=spec)
    assert not off.engine.proposer.runner.chain.native


@pytest.mark.slow
@pytest.mark.parametrize("kind,tree", [("eagle3", "chain"), ("eagle", "narrow"), ("eagle3", "dynamic"),
                                       ("eagle3", "auto")])
def test_fast_path_drafts_as_eager(shapes, tokenizer, kind, tree, monkeypatch):
    """Greedy EAGLE chains and dynamic trees come from the fused drafting loops (one call per
    step: CompiledChain / CompiledTree), compiled (enforce_eager=False) and run eagerly
    (enforce_eager=True, the default), draft exactly what the level-by-level eager expansion
    drafts (LEAPFROG_EAGER_FUSED_DRAFTS=0; the same tokens and parents every step, float32) and
    keep the output equal to no speculation; "auto" tree sizes (chains and trees by step, trees
    cut from the full fused tree) too; nothing compiles while serving."""
    from torch._dynamo.utils import counters

    from leapfrog.model.compiled import CompiledChain
    target, heads = shapes["qwen2"]
    inputs = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 3)]
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    # narrow: 6 nodes over depth 4 use 2 of the 3 children per node (SpeculativeConfig.tree_shape)
    shape = {"num_speculative_tokens": 4, "eagle_topk": 3, "num_draft_tokens": 6} if tree == "narrow" else TREES[tree]
    spec = {"method": kind, "model": str(heads[kind]), **shape}
    _, ref = _generate(target, None, prompts_of(tokenizer, 3), sp)

    def make(way):
        with monkeypatch.context() as m:
            m.setenv("LEAPFROG_EAGER_FUSED_DRAFTS", "0" if way == "expansion" else "1")
            return LLM(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=2,
                       speculative_config=spec, enforce_eager=way != "compiled")
    llms = {way: make(way) for way in ("expansion", "eager", "compiled")}
    assert llms["expansion"].engine.proposer.runner.chain is None
    if tree == "auto":   # trees (5 nodes over depth 3) at least, whatever the machine measures
        for llm in llms.values():
            _always_drafting(llm, 5)
    drafts = {way: _recording(llm) for way, llm in llms.items()}
    calls = {way: [] for way in llms}
    orig = CompiledChain.__call__   # (CompiledTree's too)

    def counted(self, *a, **kw):
        way = "compiled" if self.compiled else "eager"
        calls[way].append(type(self).__name__)
        return orig(self, *a, **kw)
    monkeypatch.setattr(CompiledChain, "__call__", counted)
    graphs = counters["stats"]["unique_graphs"]
    outs = {way: [o.outputs[0].token_ids for o in llm.generate(inputs, sp, use_tqdm=False)]
            for way, llm in llms.items()}
    assert counters["stats"]["unique_graphs"] == graphs
    assert outs["expansion"] == outs["eager"] == outs["compiled"] == ref
    assert calls["expansion"] == []
    for way in ("eager", "compiled"):
        llm = llms[way]
        assert llm.get_metrics()["num_draft_tokens"] > 0
        runner = llm.engine.proposer.runner
        fused = [g for g in (runner.chain, runner.tree) if g is not None]
        if tree == "auto":   # the controller's sizes follow measured times: only the output is comparable
            assert runner.chain is not None and runner.tree is not None and "CompiledTree" in calls[way]
        else:
            assert len(fused) == 1 and set(calls[way]) == {"CompiledChain" if tree == "chain" else "CompiledTree"}
            assert drafts[way] == drafts["expansion"]
            branching = [p != list(range(-1, len(p) - 1)) for _, ps in drafts[way] for p in ps]
            assert any(branching) == (tree != "chain")
            if tree == "narrow":   # the loop grows the eager expansion's width, not eagle_topk
                assert runner.tree.topk == 2
    fast = llms["compiled"]
    if tree == "auto":
        # verify buckets for small trees too (depth + 1, 9, 17 tokens), not only the largest: the
        # 3 + 2 x 9 = 21 candidates a depth-3 top-3 tree grows, + 1
        assert {b.tokens for b in fast.engine.runner.compiled.warmed} == {1, 4, 9, 17, 22}
    # the head's fused graphs and the target's verify graphs were called directly (no torch.compile wrappers)
    runner = fast.engine.proposer.runner
    fused = [g for g in (runner.chain, runner.tree) if g is not None]
    assert sum(d.calls for g in fused for d in g.direct.values()) == len(calls["compiled"])
    assert sum(d.calls for d in fast.engine.runner.compiled.direct.values()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_fast_path_samples_chains_as_eager(shapes, tokenizer, tree, monkeypatch):
    """enforce_eager=False at temperature > 0: an EAGLE head's chains come from the sampled chain
    graph (CompiledSampledChain: one call per step). Seeded and greedy requests in one batch draw
    exactly what the eager head's level-by-level expansion draws (LEAPFROG_EAGER_FUSED_DRAFTS=0;
    the same tokens and parents every step, float32), so the
    outputs equal the eager engine's; a request with top_k sends its steps to the eager
    expansion. Unseeded requests draw each level by inverse CDF with the next uniform of their
    generator, replayed here against the graph's own q (one uniform per level, nothing more
    drawn): not compared with the eager engine, whose q differs from inductor's in the last bits,
    which moves an inverse-CDF draw about once in 20,000 (the race's argmax is not moved by
    it). With a tree configured, sampled requests (which draft chains whatever the tree: an
    unseeded one's draws, a seeded one's race winners) use the graph when no greedy request's
    tree is in the step, and the expansion draws the same chain for a seeded one beside a greedy
    tree. Nothing compiles while serving."""
    from torch._dynamo.utils import counters

    from leapfrog.model.compiled import CompiledSampledChain
    from leapfrog.sampling import sampler
    target, heads = shapes["llama_untied"]
    prompts = prompts_of(tokenizer, 3)
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), **TREES[tree]}
    with monkeypatch.context() as m:   # the eager engine grows its chains level by level (the reference)
        m.setenv("LEAPFROG_EAGER_FUSED_DRAFTS", "0")
        llms = {eager: LLM(model=str(target), dtype="float32", max_model_len=256, max_num_seqs=4, seed=11,
                           speculative_config=spec, enforce_eager=eager) for eager in (True, False)}
    seen = {eager: [] for eager in llms}
    streams = []   # compiled engine, unseeded requests: (generator state before, after, tokens, q)
    for eager, llm in llms.items():
        propose = llm.engine.proposer.propose

        def record(reqs, ks, propose=propose, out=seen[eager], eager=eager):
            unseeded = [r for r in reqs if not r.params.greedy and r.seed_key is None]
            before = [r.generator.get_state() for r in unseeded]
            d = propose(reqs, ks)
            out.append((d.lists(), d.parent_lists()))
            if not eager:
                o, ids = d.offsets(), [r.request_id for r in reqs]
                for r, state in zip(unseeded, before):
                    b = ids.index(r.request_id)
                    q = None if d.draft_probs is None else d.draft_probs[o[b]:o[b + 1]].clone()
                    streams.append((state, r.generator.get_state(), d.token_ids[o[b]:o[b + 1]].tolist(), q))
            return d
        llm.engine.proposer.propose = record
    calls = []
    orig = CompiledSampledChain.__call__
    monkeypatch.setattr(CompiledSampledChain, "__call__",
                        lambda self, *a: (self.compiled and calls.append(1)) or orig(self, *a))
    compared = [[SamplingParams(temperature=0.8, seed=5, max_tokens=MAX, ignore_eos=True),
                 SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)],
                [SamplingParams(temperature=0.9, seed=6, max_tokens=MAX, ignore_eos=True),
                 SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=MAX, ignore_eos=True)]]
    if tree == "dynamic":   # a seeded one's chains alone (the graph), then beside a greedy tree (eager)
        compared = [[SamplingParams(temperature=0.8, seed=5, max_tokens=MAX, ignore_eos=True)],
                    [SamplingParams(temperature=0.9, seed=6, max_tokens=MAX, ignore_eos=True),
                     SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)]]
    unseeded = [SamplingParams(temperature=t, max_tokens=MAX, ignore_eos=True) for t in (0.7, 0.9)]
    graphs = counters["stats"]["unique_graphs"]
    outs, alone = {}, None
    for eager, llm in llms.items():
        outs[eager] = []
        for sps in compared:
            outs[eager].append([o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts[:len(sps)]], sps, use_tqdm=False)])
            if not eager and alone is None:
                alone = (len(calls), len(seen[False]))   # the first group's steps on the fast engine
    assert outs[False] == outs[True]
    if tree == "dynamic":   # the seeded request alone: every drafting step one graph call, chains
        assert alone[0] == alone[1] > 0
        assert all(p == list(range(-1, len(p) - 1)) for _, parents in seen[False][:alone[1]] for p in parents)
    assert len(seen[False]) == len(seen[True]) and seen[False] == seen[True]
    fast = llms[False]
    assert fast.engine.proposer.runner.sampled_chain is not None
    assert len(calls) < len(seen[False])                    # the top_k request's steps (or the trees) ran eagerly
    before = len(calls)
    fast.generate([{"prompt_token_ids": p} for p in prompts[:2]], unseeded, use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(calls) > before and len(streams) >= len(calls) - before
    if tree == "dynamic":   # chains verify in a bucket of their own, not padded to the tree's
        assert {b.tokens for b in fast.engine.runner.compiled.warmed} == {1, 5, 11}
    assert any(toks for _, _, toks, _ in streams)
    for state, after, toks, q in streams:
        g = torch.Generator()
        g.set_state(state)
        w = torch.rand(len(toks), generator=g, dtype=torch.float64)
        assert torch.equal(g.get_state(), after)
        if toks:
            assert q is not None and toks == sampler.inverse_cdf_draw(q, w).tolist()
            torch.testing.assert_close(q.sum(-1), torch.ones(len(toks)))


def test_sampled_chains_draw_over_the_heads_own_vocabulary(shapes, tmp_path):
    """An EAGLE-3 head with a reduced vocabulary (the target's odd ids) draws its sampled chains
    over that vocabulary (CompiledSampledChain.vocab, run eagerly: softmax, race and inverse-CDF
    draw over [B, Vd], q spread over the target's V once after the last step): the same tokens,
    race shares and q, to float rounding, as a sampled chain over the whole V (-inf outside the
    head's) with the same uniforms, for a row racing with its position noise and a row drawing
    by inverse CDF; q is zero outside the head's vocabulary."""
    from leapfrog.model.compiled import CompiledSampledChain
    target, _ = shapes["qwen2"]
    odd = list(range(1, 320, 2))
    head_dir = make_head(target, tmp_path / "h", "eagle3", seed=1, draft_token_ids=odd)
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3, "eagle_topk": 1}
    llm = LLM(model=str(target), dtype="float32", max_model_len=64, max_num_seqs=2, speculative_config=spec,
              skip_tokenizer_init=True)
    own = llm.engine.proposer.runner.sampled_chain
    assert not own.compiled and own.vocab is not None and own.vocab.tolist() == odd
    whole = CompiledSampledChain(own.model, own.kv, own.buckets, own.steps, own.want, own.logit_scale,
                                 own.feature_width, own.next_width, compile=False)
    b = next(x for x in own.buckets if x.batch == 2)
    args = list(own._warm_args(b, 20, torch.device("cpu"), own.kv.scratch_row))
    g = torch.Generator().manual_seed(5)
    args[0] = torch.randint(0, 320, args[0].shape, generator=g)        # tokens
    args[7] = torch.randn(args[7].shape, generator=g)                    # the target's features
    assert args[-2].tolist() == [False, True]                            # row 0 races, row 1 inverse CDF
    with torch.inference_mode():
        a, w = own._serve(tuple(args)), whole._serve(tuple(args))
    assert torch.equal(a.tokens, w.tokens) and (a.tokens % 2 == 1).all()
    assert a.q.shape == w.q.shape == (2, own.steps, 320) and not a.q[..., 0::2].any()
    torch.testing.assert_close(a.q, w.q, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.shares, w.shares, rtol=0, atol=1e-5)
    # a head listing its vocabulary out of order draws over the whole V (an inverse-CDF draw
    # over its own order would pick other tokens than the expansion's)
    with pytest.raises(ValueError, match="ascending"):
        CompiledSampledChain(own.model, own.kv, own.buckets, own.steps, own.want, own.logit_scale,
                             own.feature_width, own.next_width, vocab=own.vocab.flip(0), compile=False)
    unordered = make_head(target, tmp_path / "r", "eagle3", seed=1, draft_token_ids=odd[::-1])
    llm = LLM(model=str(target), dtype="float32", max_model_len=64, max_num_seqs=2, skip_tokenizer_init=True,
              speculative_config={**spec, "model": str(unordered)})
    assert llm.engine.proposer.runner.sampled_chain.vocab is None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12 and llm.get_metrics()["num_draft_tokens"] > 0


def test_compiled_chain_picks_over_the_heads_own_vocabulary(shapes, tmp_path):
    """An EAGLE-3 head with a reduced vocabulary (the target's odd ids: a draft id is not its
    target id) drafts its compiled
    chains over that vocabulary (CompiledChain.vocab: logits [B, Vd], each pick mapped to target
    ids): the same tokens, and the same log q to float rounding, as a chain graph picking over
    the target's whole vocabulary (-inf outside the head's) on the same inputs; the ids are
    target ids of the head's vocabulary, not draft ids."""
    from leapfrog.model.compiled import Bucket, CompiledChain
    target, _ = shapes["qwen2"]
    odd = list(range(1, 320, 2))
    head_dir = make_head(target, tmp_path / "h", "eagle3", seed=1, draft_token_ids=odd)
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 2, "eagle_topk": 1}
    with patch.dict(compiled.INDUCTOR_OPTIONS, {"max_autotune": False}):
        llm = LLM(model=str(target), dtype="float32", max_model_len=64, max_num_seqs=1, speculative_config=spec,
                  enforce_eager=False, skip_tokenizer_init=True)
        own = llm.engine.proposer.runner.chain
        assert own.vocab is not None and own.vocab.tolist() == odd
        whole = CompiledChain(own.model, own.kv, [Bucket(1, own.buckets[0].tokens)], own.steps,
                              own.feature_width, own.next_width)
        whole.warm_up(progress=False)
    b = whole.warmed[0]
    args = list(whole._warm_args(b, 20, torch.device("cpu"), own.kv.scratch_row))
    g = torch.Generator().manual_seed(3)
    args[0] = torch.randint(0, 320, args[0].shape, generator=g)        # tokens
    args[7] = torch.randn(args[7].shape, generator=g)                    # the target's features
    with torch.inference_mode():
        a, w = own._serve(tuple(args)), whole._serve(tuple(args))
    assert torch.equal(a.tokens, w.tokens)
    assert (a.tokens % 2 == 1).all()
    torch.testing.assert_close(a.logprobs, w.logprobs, rtol=0, atol=1e-5)


def test_plain_steps_states_reach_the_head_as_handed_request_by_request(shapes):
    """Plain steps' states logged as one [B, F] tensor a step (``on_plain_states``) come out of
    ``feats`` exactly as the same states handed request by request (``on_target_states``): runs of
    steps of the same requests as blocks, a retried step's states sent again kept once, a request
    that finished dropped, a changed batch entry by entry, and all before states handed later."""
    from leapfrog.request import Request
    from leapfrog.spec_decode.proposers import eagle

    target, heads = shapes["llama_gqa_llama3"]
    llm = LLM(model=str(target), dtype="float32", max_model_len=256,
              speculative_config={"method": "eagle3", "model": str(heads["eagle3"]), **TREES["chain"]})
    prop = llm.engine.proposer
    F = 3 * 64   # (any width: the proposer keeps rows as given)
    gen = torch.Generator().manual_seed(0)

    def run(prefix: str, plain: bool, steps: list[tuple[list[int], bool]], states: list[torch.Tensor]) -> None:
        reqs = [Request(f"{prefix}{i}", None, [1, 2], SamplingParams(max_tokens=8), torch.Generator(), None, (), 8)
                for i in range(3)]
        for r, s in zip(reqs, states[:3]):   # (a prompt's states, handed as the engine's prefill hands them)
            prop.start(r)
            prop.on_target_states(r, 0, s)
            r.num_computed = 4
        for (ids, retry), s in zip(steps, states[3:]):
            if ids == "finish":
                prop.finish(reqs[2])
                continue
            if plain:
                prop.on_plain_states([reqs[i] for i in ids], s)
            else:
                for b, i in enumerate(ids):
                    prop.on_target_states(reqs[i], reqs[i].num_computed, s[b:b + 1])
            for i in ids:
                reqs[i].num_computed += not retry
        if plain:
            assert len(prop._log) == len(steps) - 1 and prop._log[-1][0] == [f"{prefix}1"]
        late = torch.randn(2, F, generator=torch.Generator().manual_seed(1))   # (a drafting step's: after them)
        prop.on_target_states(reqs[0], reqs[0].num_computed, late)
        assert not prop._log

    steps = [([0, 1, 2], False)] * 5 + [([0, 1, 2], True)] + [([0, 1, 2], False)] * 3 + [("finish", False)] + [
        ([0, 1], False)] * 2 + [([1], False)]
    states = [torch.randn(4, F, generator=gen) for _ in range(3)] + [
        torch.randn(3 if ids == "finish" else len(ids), F, generator=gen) for ids, _ in steps]
    run("log", True, steps, states)
    run("ref", False, steps, states)
    assert "log2" not in prop.feats and "ref2" not in prop.feats
    for i in (0, 1):
        f, g = prop.feats[f"log{i}"], prop.feats[f"ref{i}"]
        assert (f.start, f.n) == (g.start, g.n) == (0, 4 + 10 + (i == 1) + 2 * (i == 0))
        assert torch.equal(f.rows(), g.rows())
    # with no reader, the log is handed over every _LOG_STEPS steps
    r = Request("long", None, [1, 2], SamplingParams(max_tokens=8), torch.Generator(), None, (), 8)
    prop.start(r)
    rows = torch.randn(eagle._LOG_STEPS, 1, F, generator=gen)
    for n in range(eagle._LOG_STEPS):
        r.num_computed = n
        prop.on_plain_states([r], rows[n])
    assert not prop._log and torch.equal(prop._feats["long"].rows(), rows[:, 0])
