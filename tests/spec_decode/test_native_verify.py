"""The native chain verification (spec_decode/verify/native.py): unseeded temperature-only sampled
chains verified by one C++ call draw bitwise what the Python path draws (sampler.temperature_probs,
verify/rejection.py, sampler.inverse_cdf_draw), with draft distributions and with point masses;
through the engine the same output with the op on and off, and the target's exact law."""

from __future__ import annotations

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import save_random_llama
from leapfrog.sampling import sampler
from leapfrog.spec_decode.verify import native
from leapfrog.spec_decode.verify.rejection import rejection_accept
from tests.conftest import prompts_of
from tests.spec_decode.test_sampling_lossless import SMALL, assert_follows_target

pytestmark = pytest.mark.skipif(not native.load_native_verify(), reason="the op could not be built here")


def _python(logits, temps, q, draft_ids, num_draft, u, w):
    p = sampler.temperature_probs(logits, temps)
    out = rejection_accept(p, q, draft_ids, num_draft, u)
    return out.num_accepted, sampler.inverse_cdf_draw(out.final_probs, w).tolist()


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("seed,V", [*((s, 50) for s in range(6)), (6, 8192), (7, 8192), (8, 4099)])
def test_op_draws_what_the_python_path_draws(point_mass, seed, V):
    """(V 8192: ATen's softmax, sum and cumsum at the built-in model's width, where they
    vectorise and cascade; the op's loops must still give their bits.)"""
    g = torch.Generator().manual_seed(seed)
    num_draft = [3, 0, 5, 1, 4]
    B, T = len(num_draft), sum(num_draft)
    logits = torch.randn(T + B, V, generator=g) * 3
    temps = [t for k, t in zip(num_draft, (0.7, 1.0, 0.5, 1.3, 0.9)) for _ in range(k + 1)]
    q = None if point_mass else torch.softmax(torch.randn(T, V, generator=g) * 2, -1)
    # drafts: the target's likeliest tokens (accepted often) or random ones (rejected often)
    rows = [s + j for s, k in zip([0, 4, 5, 11, 13], num_draft) for j in range(k)]
    likely = logits[rows].argmax(-1)
    draft_ids = torch.where(torch.rand(T, generator=g) < 0.6, likely, torch.randint(V, (T,), generator=g))
    u = torch.rand(T, generator=g)
    w = torch.rand(B, generator=g, dtype=torch.float64)
    draw = native.chain_rejection(logits, torch.tensor(temps), q, draft_ids, num_draft, u, w)
    n, tokens = _python(logits, temps, q, draft_ids, num_draft, u, w)
    assert draw.num_accepted == n and draw.tokens == tokens
    assert set(n) != {0} or seed  # (some acceptances)


def test_op_residuals_at_a_large_vocabulary_are_the_python_paths():
    """Three rejected rows at V = 151936 (Qwen's) with two threads, where ATen sums a [1, V] row in
    per-thread chunks but the Python path's [R, V] residuals row by row: their float32 masses, so
    the normalised residuals, differ in the last bits. With each w placed between the two
    candidate CDFs' values at a column where they differ, only the Python path's own residuals
    draw its tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(1)
        V, B = 151936, 3
        logits = torch.randn(2 * B, V, generator=g) * 3
        q = torch.softmax(torch.randn(B, V, generator=g) * 3, -1)
        temps = [0.7] * (2 * B)
        p = sampler.temperature_probs(logits, temps)
        ids = torch.stack([(q[b] - p[2 * b]).argmax() for b in range(B)])   # q(x) >> p(x): rejected
        u = torch.full((B,), 0.999)
        final = rejection_accept(p, q, ids, [1] * B, u).final_probs                # [B, V]
        per_row = torch.stack([(p[2 * b] - q[b]).clamp_min(0) / (p[2 * b] - q[b]).clamp_min(0)[None].sum(-1)
                               for b in range(B)])
        c1, c2 = final.double().cumsum(-1), per_row.double().cumsum(-1)
        r1, r2 = c1 / c1[:, -1:], c2 / c2[:, -1:]
        w = torch.rand(B, generator=g, dtype=torch.float64)
        split = 0
        for b in range(B):
            for i in (r1[b] != r2[b]).nonzero().flatten()[:200].tolist():
                lo, hi = sorted((r1[b, i].item(), r2[b, i].item()))
                wb = w.clone()
                wb[b] = (lo + hi) / 2
                if sampler.inverse_cdf_draw(final, wb)[b] != sampler.inverse_cdf_draw(per_row, wb)[b]:
                    w, split = wb, split + 1
                    break
        assert split >= 1   # (the two residuals really draw differently somewhere)
        draw = native.chain_rejection(logits, torch.tensor(temps), q, ids, [1] * B, u, w)
        assert draw.num_accepted == [0] * B
        assert draw.tokens == sampler.inverse_cdf_draw(final, w).tolist()
    finally:
        torch.set_num_threads(threads)


def test_op_final_draw_at_the_boundaries_of_the_cdf():
    """The inverse CDF's loops against sampler.inverse_cdf_draw where t lands exactly on a partial
    sum (softmax of equal logits: quarters and halves, exact), at w = 0, and just below 1: the
    same token (the first sum above t), never one of zero mass."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-float("inf"), 0.0, -float("inf"), 0.0]]).repeat(6, 1)
    w = torch.tensor([v for v in (0.0, 0.25, 0.5, 0.75, 1 - 2 ** -53, 0.3) for _ in range(2)], dtype=torch.float64)
    t = torch.ones(len(logits))
    none = torch.empty(0, dtype=torch.long)
    draw = native.chain_rejection(logits, t, None, none, [0] * len(logits), torch.empty(0), w)
    expect = sampler.inverse_cdf_draw(sampler.temperature_probs(logits, [1.0] * len(logits)), w).tolist()
    assert draw.tokens == expect and draw.num_accepted == [0] * len(logits)
    assert all(x in (1, 3) for x in draw.tokens[1::2])   # (zero mass never drawn)


def test_op_all_accepted_and_non_finite():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 10.0
    draft_ids = torch.tensor([4, 4])
    u = torch.full((2,), 0.5)
    w = torch.tensor([0.3], dtype=torch.float64)
    t = torch.ones(3)
    draw = native.chain_rejection(logits, t, None, draft_ids, [2], u, w)
    assert draw.num_accepted == [2] and draw.tokens == _python(logits, [1.0] * 3, None, draft_ids, [2], u, w)[1]
    assert native.chain_rejection(logits, torch.tensor([1.0, 1e-40, 1.0]), None, draft_ids, [2], u, w) is None
    logits[1, 3] = float("nan")
    assert native.chain_rejection(logits, t, None, draft_ids, [2], u, w) is None
    with pytest.raises(RuntimeError, match="chain_rejection"):   # (shapes checked: 3 drafts counted, 2 given)
        native.chain_rejection(logits, t, None, draft_ids, [3], u, w)


def test_non_finite_logits_fail_the_request_before_any_draw(pair, tokenizer, monkeypatch):
    """A verify step whose logits are not finite raises the sampler's error, and the requests'
    generators are where the Python path leaves them (it raises before drawing any uniform): the
    op's caller puts back what it drew, so a batch's retry draws the same."""
    llm = LLM(model=str(pair), dtype="float32", max_model_len=128, max_num_seqs=2, seed=7,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    eng = llm.engine
    from leapfrog.spec_decode.draft import DraftBatch
    reqs = []
    for i, p in enumerate(prompts_of(tokenizer, 2)):
        eng.add_request(str(i), None, p, SamplingParams(temperature=0.8, max_tokens=4))
    reqs = list(eng.requests.values())
    states = [r.generator.get_state() for r in reqs]
    logits = torch.zeros(4, eng.vocab_size)   # [T + B, V]
    logits[1, 0] = float("inf")
    drafts = DraftBatch.from_lists([[1, 2], []])
    with pytest.raises(FloatingPointError, match="non-finite"):
        eng.verify(reqs, logits, drafts)
    assert all(torch.equal(s, r.generator.get_state()) for s, r in zip(states, reqs))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    t = save_random_llama(tmp_path_factory.mktemp("nv-t"), tokenizer, seed=1, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, initializer_range=0.2)
    return t


@pytest.mark.parametrize("spec", [{"method": "draft_model", "model": "self", "num_speculative_tokens": 3,
                                   "draft_quantization": "int4"},
                                  {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}])
def test_engine_output_is_the_same_with_the_op_on_and_off(pair, tokenizer, spec, monkeypatch):
    """Unseeded temperature-only requests (the LLM's seed makes their streams reproducible), batched
    with ragged drafts: the op verifies every step (draft distributions, or n-gram point masses),
    and the output is the Python path's token for token."""
    calls = []
    fn = native.chain_rejection
    monkeypatch.setattr("leapfrog.engine.engine.chain_rejection", lambda *a: calls.append(1) or fn(*a))
    prompts = prompts_of(tokenizer, 4)
    sp = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("LEAPFROG_NATIVE_VERIFY", on)
        llm = LLM(model=str(pair), dtype="float32", max_model_len=128, max_num_seqs=4, seed=7,
                  speculative_config=spec)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                 use_tqdm=False)]
        m = llm.get_metrics()
        assert m["num_accepted_tokens"] < m["num_draft_tokens"]   # (rejections; a random model's n-grams: all)
        assert m["num_accepted_tokens"] > 0 or spec["method"] == "ngram"
        assert (len(calls) > 5) == (on == "1"), len(calls)
    assert outs["0"] == outs["1"]


def test_plain_decode_draws_through_the_op_what_the_python_path_draws(pair, tokenizer, monkeypatch):
    """Without speculation, unseeded temperature-only requests take their tokens from the op too
    (chains of no drafts: softmax, the finiteness check, the inverse-CDF draw): token for token
    the Python sampler's output, batched."""
    calls = []
    fn = native.chain_rejection
    monkeypatch.setattr("leapfrog.engine.engine.chain_rejection", lambda *a: calls.append(a[4]) or fn(*a))
    prompts = prompts_of(tokenizer, 3)
    sp = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True)
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("LEAPFROG_NATIVE_VERIFY", on)
        llm = LLM(model=str(pair), dtype="float32", max_model_len=128, max_num_seqs=3, seed=11)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                 use_tqdm=False)]
        assert (len(calls) >= 19) == (on == "1"), len(calls)
    assert all(set(k) == {0} for k in calls) and any(len(k) == 3 for k in calls)   # (batches of 3, no drafts)
    assert outs["0"] == outs["1"] and len(set(map(tuple, outs["1"]))) == 3


def test_only_batches_of_unseeded_temperature_only_requests_take_the_op(pair, tokenizer, monkeypatch):
    """A seeded, greedy or top-k request in the batch keeps the whole step on the Python path (the
    op draws from streams only, softmax(logits / T) only); and a failure inside the op puts the
    streams back, as the Python path raises before it draws."""
    calls = []
    fn = native.chain_rejection
    monkeypatch.setattr("leapfrog.engine.engine.chain_rejection", lambda *a: calls.append(1) or fn(*a))
    llm = LLM(model=str(pair), dtype="float32", max_model_len=128, max_num_seqs=2, seed=3)
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 2)]
    unseeded = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)
    for other in (SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_k=5, max_tokens=6, ignore_eos=True)):
        llm.generate(prompts, [unseeded, other], use_tqdm=False)
    assert not calls
    llm.generate(prompts, [unseeded, unseeded], use_tqdm=False)
    assert calls
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"f{i}", None, p["prompt_token_ids"], unseeded)
    reqs = list(eng.requests.values())
    states = [r.generator.get_state() for r in reqs]

    def broken(*a):
        raise RuntimeError("chain_rejection: broken")
    monkeypatch.setattr("leapfrog.engine.engine.chain_rejection", broken)
    from leapfrog.spec_decode.draft import DraftBatch
    with pytest.raises(RuntimeError, match="broken"):
        eng.verify(reqs, torch.zeros(2, eng.vocab_size), DraftBatch.from_lists([[], []]))
    assert all(torch.equal(s, r.generator.get_state()) for s, r in zip(states, reqs))


def test_op_verified_sampling_follows_the_target_law(tmp_path_factory):
    """Tokens 2 and 3 of 2000 requests at temperature 0.7, every verify step through the op: the
    target's exact law (chi-square through the whole engine)."""
    from tests.spec_decode.test_sampling_lossless import SETTINGS
    target = save_random_llama(tmp_path_factory.mktemp("nv-tiny"), None, seed=3, **SMALL)
    draft = save_random_llama(tmp_path_factory.mktemp("nv-draft"), None, seed=11, **SMALL)
    calls = []
    fn = native.chain_rejection
    with pytest.MonkeyPatch.context() as m:
        m.setattr("leapfrog.engine.engine.chain_rejection", lambda *a: calls.append(1) or fn(*a))
        assert_follows_target(target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2},
                              SETTINGS[1], seed=5)
    assert len(calls) >= 2


def _random_drafts(g, num_draft, V, p, tree, likely=None):
    """Drafts per request: chains, or trees (each node's parent any earlier node or the root), a
    node's token often the likeliest of its parent's row (``likely(b, row, depth)``, else the
    argmax: so paths run deep); siblings are distinct tokens (draft.py's rule). -> (draft ids
    [T], parents [T] local, each row's depth [T + B])"""
    ids, parents, depths, s = [], [], [], 0
    likely = likely or (lambda b, row, depth: int(p[row].argmax()))
    for b, k in enumerate(num_draft):
        d, kids = [0], {}
        for j in range(k):
            par = int(torch.randint(-1, j, (1,), generator=g)) if tree and j else j - 1
            x = (likely(b, s + 1 + par, d[par + 1]) if torch.rand(1, generator=g) < 0.7
                 else int(torch.randint(V, (1,), generator=g)))
            while x in kids.setdefault(par, set()):
                x = (x + 1) % V
            kids[par].add(x)
            ids.append(x)
            parents.append(par)
            d.append(d[par + 1] + 1)
        depths += d
        s += k + 1
    return torch.tensor(ids), parents, depths


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("seed,V", [*((s, 50) for s in range(5)), (5, 8192), (6, 4099)])
def test_race_match_finds_what_racing_every_row_finds(tree, seed, V):
    """Seeded rows (kept position noise) and greedy rows (E = 1) in one batch: the op's tokens on
    the rows it races are sampler.sample's, the match over them is the match over every row's
    token, and it races only the rows that match reads (each request's accepted path and the
    row after it)."""
    from leapfrog.spec_decode.verify.greedy import greedy_accept
    from leapfrog.spec_decode.verify.tree import tree_match_accept
    g = torch.Generator().manual_seed(seed)
    num_draft = [3, 0, 6, 1, 4]
    B, T = len(num_draft), sum(num_draft)
    # peaked rows, so the race's winner is often the argmax and drafts of it are accepted
    p = torch.softmax(torch.randn(T + B, V, generator=g) * 4, -1)
    p[4] = torch.full((V,), 1.0 / V)   # (a greedy row of equal values: the first, as torch.argmax)
    kept = [sampler.NoiseRows() for _ in num_draft]   # (per request, as Request.noise_rows)
    greedy = {1, 3}   # requests without randomness

    def rng(b, depth):
        return None if b in greedy else sampler.PositionKey(1000 + b, 5 + depth, kept[b])
    draft_ids, parents, depths = _random_drafts(
        g, num_draft, V, p, tree, lambda b, row, depth: int(sampler.sample(p[row:row + 1], [rng(b, depth)])))
    owner = [b for b, k in enumerate(num_draft) for _ in range(k + 1)]
    rngs = [rng(b, d) for b, d in zip(owner, depths)]
    every = sampler.sample(p, rngs).tolist()
    got = native.race_match(p, sampler.noise_keys(rngs), draft_ids,
                            torch.tensor(parents), num_draft)
    raced = [i for i, t in enumerate(got) if t >= 0]
    assert all(got[i] == every[i] for i in raced)
    ids = draft_ids.tolist()
    if tree:
        want, res = tree_match_accept(every, ids, parents, num_draft), tree_match_accept(got, ids, parents, num_draft)
    else:
        want, res = greedy_accept(every, ids, num_draft), greedy_accept(got, ids, num_draft)
    assert res == want and sum(want.num_accepted) > 0
    assert len(raced) == sum(n + 1 for n in want.num_accepted) < T + B


def test_race_match_ties_go_to_the_first_column_across_blocks():
    """A greedy row (E = 1) with equal p at columns 10 and 300 (two of the op's 256-column blocks):
    the first, as torch.argmax; a larger p at 300 wins."""
    for p300, want in ((0.5, 10), (0.6, 300)):
        p = torch.zeros(1, 600)
        p[0, 10], p[0, 300] = 0.5, p300
        got = native.race_match(p, sampler.noise_keys([None]), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), [0])
        assert got == [want] == p.argmax(-1).tolist()


def test_race_match_refuses_bad_trees_and_rows():
    p = torch.full((3, 8), 0.125)
    with pytest.raises(RuntimeError, match="parent after its child"):
        native.race_match(p, sampler.noise_keys([None] * 3), torch.tensor([1, 2]), torch.tensor([1, -1]), [2])
    with pytest.raises(RuntimeError, match="keys \\[T \\+ B, 2\\]"):
        native.race_match(p, sampler.noise_keys([None] * 2), torch.tensor([1, 2]), torch.tensor([-1, 0]), [2])


@pytest.mark.parametrize("spec", [{"method": "draft_model", "model": "self", "num_speculative_tokens": 3,
                                   "draft_quantization": "int4"},
                                  {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, None])
def test_seeded_output_is_the_same_with_the_race_op_on_and_off(pair, tokenizer, spec, monkeypatch):
    """Seeded requests (temperature only, and with top-p) beside a greedy one, batched: the op
    races their verification rows (plain decode's too) and the output is the Python race's, token
    for token, and the output without speculation."""
    calls = []
    fn = native.race_match
    monkeypatch.setattr("leapfrog.engine.engine.race_match", lambda *a: calls.append(1) or fn(*a))
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 4)]
    sps = [SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True),
           SamplingParams(temperature=1.1, seed=4, top_p=0.9, max_tokens=20, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
           SamplingParams(temperature=0.6, seed=5, max_tokens=20, ignore_eos=True)]
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("LEAPFROG_NATIVE_VERIFY", on)
        llm = LLM(model=str(pair), dtype="float32", max_model_len=128, max_num_seqs=4, speculative_config=spec)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        assert (len(calls) > 5) == (on == "1"), len(calls)
        calls.clear()
    assert outs["0"] == outs["1"]
    if spec is not None:
        llm = LLM(model=str(pair), dtype="float32", max_model_len=128, max_num_seqs=4)
        assert outs["1"] == [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
