"""Pure pieces of speculation: n-gram matching, the verifiers, the K controller."""

from __future__ import annotations

import numpy as np
import torch

from leapfrog.request import Request
from leapfrog.sampling_params import SamplingParams
from leapfrog.spec_decode.adaptive import SpecController
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.proposers.ngram import ngram_propose
from leapfrog.spec_decode.rate import geometric_tokens
from leapfrog.spec_decode.verify.greedy import greedy_accept
from leapfrog.spec_decode.verify.rejection import rejection_accept


def test_ngram_longest_then_most_recent():
    ctx = np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    assert ngram_propose(ctx, 2, 2, 3).tolist() == [3, 5, 1]
    # a longer match wins over a more recent shorter one: [2 3] at 1 (followed by 4) vs n=3 [1 2 3]
    ctx = np.array([9, 1, 2, 3, 7, 8, 2, 3, 6, 1, 2, 3])
    assert ngram_propose(ctx, 2, 3, 2).tolist() == [7, 8]
    assert ngram_propose(np.array([1, 2, 3, 4]), 1, 3, 2).tolist() == []
    assert ngram_propose(np.array([5, 5]), 1, 1, 4).tolist() == [5]
    assert ngram_propose(ctx, 2, 3, 0).tolist() == []


def test_ngram_on_8k_context_is_cheap():
    import time
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 32000, 8192)
    ctx[-3:] = ctx[100:103]
    t = time.perf_counter()
    for _ in range(100):
        out = ngram_propose(ctx, 1, 4, 5)
    per_call = (time.perf_counter() - t) / 100
    assert out.tolist() == ctx[103:108].tolist()
    assert per_call < 5e-3  # generous bound; typically ~0.1 ms


def test_greedy_accept_cases():
    # perfect match + bonus; early mismatch; empty drafts
    r = greedy_accept([5, 7, 9, 4, 1, 3, 8], [5, 7, 9, 2], [3, 0, 1])
    assert r.num_accepted == [3, 0, 0]
    assert r.output_ids == [[5, 7, 9, 4], [1], [3]]
    assert r.padded(4) == [[5, 7, 9, 4], [1, -1, -1, -1], [3, -1, -1, -1]]


def onehot(i, V=6):
    return torch.nn.functional.one_hot(torch.tensor(i), V).float()


def test_rejection_point_mass_rules():
    p = torch.stack([torch.tensor([0.5, 0.5, 0, 0, 0, 0.]), onehot(3), onehot(4)])  # rows: d0, d1, bonus
    drafts = torch.tensor([1, 3])
    out = rejection_accept(p, None, drafts, [2], torch.tensor([0.49, 0.99]))
    assert out.num_accepted == [2]
    torch.testing.assert_close(out.final_probs[0], onehot(4))
    out = rejection_accept(p, None, drafts, [2], torch.tensor([0.51, 0.0]))
    assert out.num_accepted == [0]
    torch.testing.assert_close(out.final_probs[0], onehot(0))  # p with the rejected token removed


def test_rejection_residual_with_q():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.1, 0.8, 0.1]])
    out = rejection_accept(p, q, torch.tensor([1]), [1], torch.tensor([0.5]))  # 0.5 > 0.3 / 0.8
    assert out.num_accepted == [0]
    torch.testing.assert_close(out.final_probs[0], torch.tensor([1.0, 0.0, 0.0]))
    out = rejection_accept(p, q, torch.tensor([1]), [1], torch.tensor([0.3]))
    assert out.num_accepted == [1]
    torch.testing.assert_close(out.final_probs[0], p[1])


def test_rejection_empty_batch_rows():
    p = torch.softmax(torch.randn(3, 5), -1)
    out = rejection_accept(p, None, torch.empty(0, dtype=torch.long), [0, 0, 0], torch.empty(0))
    assert out.num_accepted == [0, 0, 0]
    torch.testing.assert_close(out.final_probs, p)


def _req(max_tokens=100):
    return Request("r", None, [1, 2], SamplingParams(max_tokens=max_tokens, temperature=0.0), torch.Generator(), None, (),
                   max_tokens)


def test_controller_formula_and_caps():
    assert geometric_tokens(0.0, 4) == 1.0
    fresh = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 64)
    assert fresh.choose([_req()]) == [0]  # plain decode is measured first
    fresh.verify_cost = {1: {1: 1.0}}
    assert fresh.choose([_req()]) == [4]  # unmeasured K looks free: try it once
    assert abs(geometric_tokens(0.5, 2) - 1.75) < 1e-12
    c = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True,
                                         adaptive_explore_interval=1000), max_model_len=64)
    reqs = [_req()]
    # verification nearly free, high acceptance -> full K
    c.alpha, c.verify_cost, c.draft_time = 0.9, {1: {1: 1.0, 5: 1.05}}, {1: {1: 0.0}}
    assert c.choose(reqs) == [4]
    # verification cost grows with every token and acceptance is low -> off
    assert not c.drafting_off(1)
    c.alpha, c.verify_cost = 0.1, {1: {1: 1.0, 2: 2.0, 5: 5.0}}
    assert c.choose(reqs) == [0]
    assert c.drafting_off(1)   # (a new request's drafter prefill waits)
    # caps: max_tokens left, and the per-request limit
    fixed = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=8), max_model_len=64)
    r = _req(max_tokens=5)
    r.output_ids = [1, 2]
    assert fixed.choose([r]) == [2]
    r.num_speculative_tokens = 1
    assert fixed.choose([r]) == [1]
    off = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=2), 64)
    assert off.choose([_req(), _req(), _req()]) == [0, 0, 0]
    assert off.choose([_req(), _req()]) == [3, 3]
    assert off.drafting_off(3) and not off.drafting_off(2)


def test_controller_larger_batches_inherit_no_speculation():
    """Where a smaller batch settled on no speculation, a larger one starts without it: no
    one-token step to measure first (plain steps may run as multi-step decode), no drafter
    prefill, and its first probe (after 8 exploration intervals of decode steps x the batch) ends
    the inheritance."""
    from leapfrog.spec_decode.verify.result import AcceptanceResult
    c = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True,
                                         adaptive_explore_interval=2), max_model_len=64)
    assert c.choose([_req()] * 4) == [0] * 4 and not c.plain_steps_ready(4)   # nothing known: measure plain decode
    c.alpha, c.verify_cost, c.draft_time = 0.1, {1: {1: 1.0, 2: 2.0, 5: 5.0}}, {1: {1: 0.0}}
    assert c.choose([_req()]) == [0]                   # batch 1 settles on none
    assert c.plain_steps_ready(4) and c.drafting_off(4) and c.drafting_off(3)
    ks = []
    for _ in range(9):   # multi-step decode, 8 tokens each: a probe after 64 (8 intervals of 2, x batch 4)
        ks.append(c.choose([_req()] * 4)[0])
        if ks[-1] == 0:
            c.observe_rounds(4, 8, 0.01, size=0)
    assert ks == [0] * 8 + [1]                         # a probe of one draft token, nothing before it
    c.observe([_req()] * 4, DraftBatch.from_lists([[5]] * 4), AcceptanceResult([1] * 4, [[0, 0]] * 4, [1] * 4),
              0.004, 0.5)
    assert not c.plain_steps_ready(4)   # measured: its own estimates from here on (plain decode's cost first)
    assert c.choose([_req()] * 4) == [1] * 4 and not c._inherits_off(4)   # (the probe goes on: 4 steps)


def test_controller_probes_back_off_while_speculation_never_pays():
    """While speculation is off, a probe comes after 8 exploration intervals of decode steps (at
    batch 1), and twice as late after each probe that leaves it off, up to 8 times as late."""
    from leapfrog.spec_decode.verify.result import AcceptanceResult
    c = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True,
                                         adaptive_explore_interval=2), max_model_len=4096)
    c.alpha, c.verify_cost, c.draft_time = 0.1, {1: {1: 1.0, 2: 2.0, 5: 5.0}}, {1: {1: 0.0}}
    starts, prev = [], 0
    for i in range(700):
        k = c.choose([_req()])[0]
        if k and not prev:
            starts.append(i)
        prev = k
        if k:   # nothing accepted, verification dear: speculation stays off
            c.observe([_req()], DraftBatch.from_lists([[5] * k]), AcceptanceResult([0], [[0]], [k]), 0.01, 2.0)
        else:
            c.observe([_req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
    gaps = [b - a - 4 for a, b in zip(starts, starts[1:])]   # off steps between probes (4 steps each)
    assert gaps[:5] == [32, 64, 128, 128, 128] and starts[0] == 16


def test_controller_sees_the_whole_step_beside_predictions():
    """Requests with a prediction share the step with the configured method's: its batch-size rule
    goes by the whole batch; a step widened by a prediction's longer verify teaches nothing about
    this method's widths, and while steps are widened its own drafts are free, so it drafts."""
    from leapfrog.spec_decode.verify.result import AcceptanceResult
    off = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=2), 64)
    assert off.choose([_req()], batch_size=3) == [0]      # 1 own request, 2 with predictions
    assert off.choose([_req()], batch_size=2) == [3]
    c = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
    assert c.choose([_req()], batch_size=3) == [0]        # nothing measured: plain decode first
    plain = AcceptanceResult([0], [[0]], [0])
    for _ in range(5):   # every step widened to 65 tokens by a prediction: drafting costs nothing extra
        c.observe([_req()], DraftBatch.empty(1), plain, 0.0, 0.02, batch_size=3, verify_tokens=65)
        assert c.choose([_req()], batch_size=3) == [4]
    assert c.verify_cost[4] == {} and not c.first_verify[4] and 4 not in c.confirm
    c.observe([_req()], DraftBatch.from_lists([[5, 6, 7, 8]]), AcceptanceResult([2], [[0, 0, 0]], [2]), 0.001, 0.01,
              batch_size=3, verify_tokens=5)   # the predictions are gone: this method's own width
    assert c.first_verify[4] == {5: 0.01} and c.choose([_req()], batch_size=3) == [4]   # confirmed warm
    c.observe([_req()], DraftBatch.from_lists([[5, 6, 7, 8]]), AcceptanceResult([2], [[0, 0, 0]], [2]), 0.001, 0.01,
              batch_size=3, verify_tokens=5)
    assert c.choose([_req()], batch_size=3) == [0]        # plain decode still unmeasured: measure it


def test_draft_batch_layout():
    d = DraftBatch.from_lists([[1, 2], [], [3]])
    assert d.num_draft == [2, 0, 1] and d.offsets() == [0, 2, 2, 3]
    assert d.lists() == [[1, 2], [], [3]] and d.total == 3


def test_rounds_under_keeps_every_draft_under_the_speculative_max_model_len():
    """Multi-step speculation's rounds (engine._spec_rounds): the most rounds of k drafts whose
    drafts all sit under the limit, a round advancing a sequence k + 1 columns at most; checked
    against the rule, round by round."""
    from leapfrog.engine.engine import rounds_under
    for limit in range(2, 40):
        for k in range(1, 6):
            for cols in ([0], [3, 9], [limit - 1], [limit + 4, 1]):
                fits = 0
                while all(c + fits * (k + 1) + k <= limit - 1 for c in cols):
                    fits += 1
                assert rounds_under(limit, cols, k) == fits, (limit, k, cols)
