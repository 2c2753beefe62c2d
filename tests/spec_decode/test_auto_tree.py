"""num_draft_tokens "auto": the tree size follows goodput (spec_decode/adaptive.py): big trees
while verifying many tokens is cheap and the drafter is confident, small or none when not."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from leapfrog.spec_decode import adaptive
from leapfrog.spec_decode.adaptive import (_HOLD_FROM, _PLAIN_BURST_STEPS, _PLAIN_FIRST, _PLAIN_REFRESH, _PLAIN_SETTLE,
                                           _PLAIN_STALE_COST,
                                           _REPROBE_STEPS, _REWEIGH_OFF_STEPS, _SPEC_SETTLE, _REWEIGH_SETTLED,
                                           _REWEIGH_STEPS, _STALE_STEPS, _START_HOLD, SpecController, _bucket, _ContextFit, _curve,
                                           shortest_near_best)
from leapfrog.spec_decode.confidence import GAMMAS
from leapfrog.spec_decode.rate import geometric_tokens

from .test_confidence import accepted_counts
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.verify.result import AcceptanceResult

PLAIN = [0] * _PLAIN_FIRST   # plain decode is measured first at a batch size (the last of these steps stands)
CFG = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 4,
                                   "eagle_topk": 4, "num_draft_tokens": "auto"})


@pytest.fixture(autouse=True)
def _weighed_chains_as_weighed(request, monkeypatch):
    """These tests check the weighing's own choice at a batch of 1: the chain of the depth in its
    place where it sets a stop (adaptive._STOP_AT_DEPTH) only in the tests marked ``stop_at_depth``."""
    if "stop_at_depth" not in request.keywords:
        monkeypatch.setattr(adaptive, "_STOP_AT_DEPTH", 0)


class _Req:
    _ids = itertools.count()
    num_speculative_tokens = None
    max_tokens = 1000
    output_ids = [1]
    num_computed = 10
    unseeded_sampled = False
    sampled = False

    def __init__(self):
        self.request_id = f"req{next(self._ids)}"


def _step(ctl: SpecController, n: int, confidences: list[float], accepted: int, t_draft: float, t_verify: float):
    drafts = DraftBatch(torch.zeros(n, dtype=torch.long), [n], None, torch.full((n,), -1), [confidences])
    ctl.observe([_Req()], drafts, AcceptanceResult([accepted], [[0] * (accepted + 1)], [n]), t_draft, t_verify)


def _converge(cost_per_token: float, confidences: list[float], accept_of, steps: int = 60) -> list[int]:
    ctl = SpecController(CFG, 4096)
    chosen = []
    for _ in range(steps):
        n = ctl.choose([_Req()])[0]
        chosen.append(n)
        t_verify = 1.0 + cost_per_token * n     # t(B, n + 1), in units of a plain step
        if n == 0:
            ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, t_verify)
        else:
            _step(ctl, n, confidences, accept_of(n), 0.3, t_verify)
    return chosen


def test_cheap_verification_and_a_confident_drafter_verify_a_big_tree():
    conf = [0.9 ** (i // 4 + 1) for i in range(64)]           # four candidates per depth, slowly decaying
    chosen = _converge(0.01, conf, lambda n: min(n, 4))
    assert CFG.draft_budget == 64
    # plain decode measured (the first steps after a prefill run slow: the last stands), then a probe tree
    assert chosen[:len(PLAIN) + 2] == PLAIN + [16, 16]
    assert min(chosen[-20:]) >= 12


def test_expensive_verification_shrinks_the_tree_or_turns_it_off():
    conf = [0.5 ** (i + 1) for i in range(64)]                # unsure: the best node is a coin flip
    chosen = _converge(0.5, conf, lambda n: 0, steps=100)
    assert max(chosen[-20:]) <= 2
    assert chosen[-20:].count(0) >= 15
    # the first probe turned it off: probed once more after _REPROBE_STEPS plain steps, then off
    first_off = chosen.index(0, chosen.index(16))
    assert chosen[first_off:first_off + 32] == [0] * 32 and chosen[first_off + 32] == 16


def test_calibration_follows_measured_acceptance():
    ctl = SpecController(CFG, 4096)
    for _ in range(40):
        _step(ctl, 8, [1.0] * 64, 2, 0.1, 1.0)                 # says 8, gets 2
    assert abs(ctl.calibration - 0.25) < 0.02


def test_a_cold_first_measurement_does_not_stick():
    """The first forward of a new shape is slow (kernel set-up); that sample must not make the
    size look expensive forever."""
    ctl = SpecController(CFG, 4096)
    for t in [3.0] * (_PLAIN_FIRST - 1) + [1.0]:     # (after a prefill: slow, then steady)
        ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, t)
    assert ctl.choose([_Req()]) == [16]                # the probe
    _step(ctl, 16, [0.9] * 64, 4, 0.3, 9.0)            # cold: 9x a plain step
    assert ctl.verify_cost[1] == {1: 1.0}
    assert ctl.choose([_Req()]) == [16]                # measured again, warm
    _step(ctl, 16, [0.9] * 64, 4, 0.3, 1.1)            # verifying 17 tokens costs ~ one step
    assert ctl.verify_cost[1] == {1: 1.0, 17: 1.1}
    assert ctl.choose([_Req()])[0] >= 16


def test_probe_shrinks_with_the_batch_and_costs_extrapolate():
    ctl = SpecController(CFG, 4096)
    assert [ctl._probe_size(b) for b in (1, 4, 16, 32)] == [16, 4, 1, 1]
    ctl.verify_cost = {32: {1: 1.0, 2: 1.5}}
    assert _curve(ctl._verify_table(32), [17])[0] == 1.5 + 0.5 * 15   # along the measured slope, not flat


def test_first_draft_cost_is_replaced():
    """The first drafting step also catches the drafter up on the prompt: its time must not
    stand for the per-step draft cost; later spikes count for at most twice the estimate."""
    ctl = SpecController(CFG, 4096)
    _step(ctl, 4, [0.9] * 64, 2, 50.0, 1.2)            # a chain (width 1)
    _step(ctl, 4, [0.9] * 64, 2, 0.4, 1.2)
    assert ctl.tree_draft_cost[1] == {(4, 1): 0.4}
    _step(ctl, 4, [0.9] * 64, 2, 0.6, 1.2)
    assert abs(ctl.tree_draft_cost[1][(4, 1)] - 0.44) < 1e-9
    _step(ctl, 4, [0.9] * 64, 2, 40.0, 1.2)            # a spike: counted as 2 x 0.44
    assert abs(ctl.tree_draft_cost[1][(4, 1)] - (0.8 * 0.44 + 0.2 * 0.88)) < 1e-9


def test_wider_trees_are_costed_at_their_width():
    """A tree of 16 nodes over depth 4 grows 4 children per frontier node: it costs more to draft
    than a chain, and the controller keeps the two apart (so it can pick the chain)."""
    assert [CFG.tree_shape(n) for n in (1, 3, 4, 5, 8, 16, 64)] == [(1, 1), (3, 1), (4, 1), (4, 2), (4, 2),
                                                                    (4, 4), (4, 4)]
    ctl = SpecController(CFG, 4096)
    for _ in PLAIN:
        ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
    conf = [0.8, 0.6, 0.4, 0.3] + [0.01] * 60          # the chain holds nearly all the confidence
    for _ in range(2):
        _step(ctl, 4, conf, 2, 0.3, 1.0)
        _step(ctl, 16, conf, 2, 3.0, 1.0)
    assert ctl.tree_draft_cost[1] == {(4, 1): 0.3, (4, 4): 3.0}
    ctl.cfg = CFG.__class__(**{**CFG.__dict__, "adaptive_explore_interval": 1000})
    # no width-4 tree (10x the drafting for the same acceptance); width 2 is unmeasured, so it may
    # be tried at the chain's cost
    assert 1 <= ctl.choose([_Req()])[0] <= 8


def test_calibration_weighs_steps_by_their_prediction():
    """a = accepted / predicted over recent steps, as a ratio of sums: a step that predicted
    little and got nothing must not halve it."""
    ctl = SpecController(CFG, 4096)
    for i in range(40):
        if i % 2:
            _step(ctl, 1, [1.0] * 64, 0, 0.1, 1.0)      # predicts 1, gets 0
        else:
            _step(ctl, 8, [1.0] * 64, 8, 0.1, 1.0)      # predicts 8, gets 8
    assert 0.8 < ctl.calibration < 0.95                # per-step ratios would average 0.5


def _bad_patch(steps: int, unlucky_first: bool = False, most: int = 64) -> list[int]:
    """Tree sizes chosen over ``steps`` steps when verification is expensive and the drafter gets
    nothing for the first 100, then cheap with a confident drafter; ``unlucky_first``: after the
    patch, the first step of every run of drafting steps accepts nothing and drafts slowly;
    ``most``: the proposer drafts at most this many nodes whatever it is asked for (a sampled
    chain)."""
    ctl = SpecController(CFG, 4096)
    conf = [0.9 ** (i // 4 + 1) for i in range(64)]
    chosen, run = [], 0
    for step in range(steps):
        bad = step < 100
        n = ctl.choose([_Req()])[0]
        chosen.append(n)
        t_verify = 1.0 + (0.5 if bad else 0.01) * n
        if n == 0:
            ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, t_verify)
            run = 0
            continue
        run += 1
        unlucky = unlucky_first and run == 1 and not bad
        n = min(n, most)
        _step(ctl, n, conf[:n], 0 if bad or unlucky else min(n, 4), 3.0 if unlucky else 0.3, t_verify)
    return chosen


def test_speculation_turned_off_is_probed_and_comes_back():
    """Verification got expensive (or the drafter unlucky) for a while and speculation went off;
    when things improve, the periodic probe must notice and turn it back on."""
    chosen = _bad_patch(600)
    assert chosen[80:100].count(0) == 20               # off while it does not pay
    assert min(chosen[-50:]) >= 8                      # and back on once it does


def test_one_unlucky_probe_step_does_not_keep_speculation_off():
    """At T = 0.7 one step's acceptance swings from 0 to the whole tree: a probe must judge by
    several steps, else an unlucky first step (and its drafter catching up on everything it
    skipped) turns speculation off again for another 8 intervals."""
    chosen = _bad_patch(400, unlucky_first=True)
    assert chosen[80:100].count(0) == 20
    # back on at the first probe after the bad patch (but for two plain steps: t_verify(B, 1) kept current)
    assert chosen[-100:].count(0) <= 2 and min(n for n in chosen[-100:] if n) >= 8
    # the same when the proposer drafts fewer nodes than the probe asks for (the probe still runs
    # its four steps rather than being cut short after its unlucky first)
    chosen = _bad_patch(400, unlucky_first=True, most=4)
    assert chosen[-100:].count(0) <= 2 and min(n for n in chosen[-100:] if n) >= 4


def _grown(n: int, conf: list[float]) -> list[float]:
    """The candidates a proposer grows for n verified nodes: the tree of CFG.tree_shape(n)
    (a chain of n levels, or W children per frontier node of width W)."""
    levels, width = CFG.tree_shape(n)
    return conf[:width + (levels - 1) * width * width]


def test_small_trees_do_not_flatten_what_larger_trees_showed():
    """A chain of 2 shows two candidates' confidences; the curve's later positions must keep what
    the larger trees measured (padding them with the chain's total made every larger tree look
    worthless, so the controller never grew the tree back)."""
    ctl = SpecController(CFG, 4096)
    conf = [0.9 ** (i // 4 + 1) for i in range(64)]
    _step(ctl, 16, _grown(16, conf), 4, 0.3, 1.1)
    big = list(ctl.curve)   # (C(n): the sums of the confidences)
    for _ in range(30):
        _step(ctl, 2, _grown(2, conf), 2, 0.1, 1.0)
    assert len(_grown(2, conf)) == 2
    curve = ctl.curve
    assert abs(curve[1] - (conf[0] + conf[1])) < 1e-6
    assert abs(curve[15] - big[15]) < 1e-9 and curve[15] > curve[1] + 5




def test_a_chain_is_tried_when_only_wide_trees_were_measured():
    """Only width-4 trees measured (dear to draft): the chain, unmeasured, must not borrow their
    cost as is (it would never be tried); once tried and cheap, it is kept."""
    ctl = SpecController(CFG, 4096)
    for _ in PLAIN:
        ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
    conf = [0.8, 0.6, 0.4, 0.3] + [0.05] * 60
    for _ in range(2):
        _step(ctl, 16, conf, 2, 3.0, 1.0)
    assert set(ctl.tree_draft_cost[1]) == {(4, 4)}
    chosen = []
    for _ in range(40):
        n = ctl.choose([_Req()])[0]
        chosen.append(n)
        _step(ctl, n, conf[:n] if n <= 4 else conf, 2, 0.3 if n <= 4 else 3.0, 1.0)
    assert 1 <= chosen[0] <= 4 and min(chosen[-10:]) >= 1 and max(chosen[-10:]) <= 4


def _rounds_run(t_round: float, rounds_run: bool = True, steps: int = 40) -> tuple[SpecController, list[int]]:
    """Sizes chosen when the engine has speculation rounds for the chain of the depth (4), which
    take ``t_round`` per round when they run (8 rounds, 3 of 4 drafts accepted in each); a plain
    step takes 1, a tree of n nodes 0.3 to draft and 1 + 0.1 n to verify. ``rounds_run`` False:
    the rounds never fit the batch (the engine ran a one-round step of the chain instead)."""
    ctl = SpecController(CFG, 4096)
    ctl.round_k, ctl.round_sizes = 4, (4,)
    # path confidences: 4 siblings per depth, the first child 0.85 likely, each level 0.8 as sure
    conf = sorted((0.8 ** d * p for d in range(1, 5) for p in (0.85, 0.08, 0.04, 0.03)), reverse=True)
    chosen = []
    for _ in range(steps):
        n = ctl.choose([_Req()])[0]
        chosen.append(n)
        if n == 0:
            ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
        elif n == 4 and rounds_run:
            ctl.observe_rounds(1, 8, 8 * t_round, 24, 32)
        else:
            _step(ctl, n, conf[:n], min(n, 3), 0.3, 1.0 + 0.1 * n)
    return ctl, chosen


def test_rounds_are_weighed_by_their_measured_time():
    """Speculation rounds (num_scheduler_steps with "auto" sizes) run when the controller picks the
    chain of the depth: it tries them once plain decode is measured, weighs them by their expected
    tokens per round over their measured time per round (the first measurement provisional), keeps
    them while they are the fastest and leaves them for trees or no speculation when they are
    not; their acceptance feeds the calibration; rounds that never run stop being tried."""
    ctl, chosen = _rounds_run(1.2)     # about 4 tokens per 1.2
    assert chosen[:len(PLAIN) + 2] == PLAIN + [4, 4] and ctl.round_samples[(1, 4)] >= 2 and abs(ctl.round_time[(1, 4)] - 1.2) < 1e-9
    assert chosen[-20:].count(4) >= 16
    assert 2.5 < ctl._rounds_goodput(1, 4) < 4.0 and ctl._rounds_goodput(1, 5) is None
    # (fed by the rounds: 3 accepted per 4-node chain of C(4) = 2.0; rounds tell no accepted depths,
    # so the linear model stays)
    assert 1.3 < ctl.calibration < 1.7 and ctl.confidence.gamma == 1.0
    ctl, chosen = _rounds_run(6.0)     # slower than plain decode and than trees
    assert chosen[:len(PLAIN) + 2] == PLAIN + [4, 4] and chosen[-20:].count(4) <= 4
    ctl, chosen = _rounds_run(1.2, rounds_run=False)
    assert chosen[_PLAIN_FIRST:_PLAIN_FIRST + 3] == [4, 4, 4]
    assert ctl.round_tries[(1, 4)] == 3 and (1, 4) not in ctl.round_time
    assert not ctl._round_unmeasured(1)   # (the one-round chain's measured cost decides from here on)


def test_rounds_update_the_acceptance_of_an_adaptive_k():
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
    ctl.round_k, ctl.round_sizes = 4, (4,)
    for _ in range(30):   # 1 of 4 accepted per round, the second rejected: alpha = 1 / 2 (accepted / tried)
        ctl.observe_rounds(2, 8, 0.016, 2 * 8 * 1, 2 * 8 * 4, rejected=2 * 8)
    assert abs(ctl.alpha - 0.5) < 0.01 and abs(ctl.round_time[(2, 4)] - 0.002) < 1e-9
    assert abs(ctl._rounds_goodput(2, 4) - geometric_tokens(ctl.alpha, 4) / 0.002) < 1e-6


def test_multi_step_decode_is_weighed_as_no_speculation():
    """Where the engine also has multi-step decode (size 0 in round_sizes), no speculation is
    weighed by its measured time per decode step once measured (after one-token steps gave
    t_verify(B, 1)): rounds of 4 tokens per 3.0 lose to decode steps of 0.5."""
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
    ctl.round_k, ctl.round_sizes = 4, (4, 0)
    assert not ctl.plain_steps_ready(1)
    chosen = []
    for _ in range(40):
        k = ctl.choose([_Req()])[0]
        chosen.append(k)
        if k == 4:
            ctl.observe_rounds(1, 8, 8 * 3.0, 8 * 3, 8 * 4)
        elif k == 0 and ctl.plain_steps_ready(1):
            ctl.observe_rounds(1, 8, 8 * 0.5, size=0)
        elif k == 0:
            ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
        else:
            ctl.observe([_Req()], DraftBatch.from_lists([[5] * k]), AcceptanceResult([k - 1], [[0] * k], [k]),
                        0.1 * k, 1.0 + 0.2 * k)
    assert chosen[:len(PLAIN) + 4] == PLAIN + [4, 4, 0, 0] and ctl.plain_steps_ready(1)
    assert abs(ctl.round_time[(1, 0)] - 0.5) < 1e-9 and ctl._rounds_goodput(1, 0) == 2.0
    assert chosen[-20:].count(0) >= 16


def _chain_step(ctl: SpecController, k: int, accepted: int, t_draft: float = 0.0, t_verify: float = 1.0,
                scores=None, t_step: float | None = None, req=None):
    drafts = DraftBatch(torch.zeros(k, dtype=torch.long), [k], None, None, scores)
    ctl.observe([req or _Req()], drafts, AcceptanceResult([accepted], [[0] * (accepted + 1)], [k]), t_draft,
                t_verify, t_step=t_step)


def test_plain_decode_is_weighed_at_a_plain_steps_host_time():
    """A drafting step's host time (committing several tokens a sequence, the drafter's
    bookkeeping) is kept apart from a plain step's: verifying two tokens costs 1.5 plain steps,
    alpha is 0.5, a drafting step spends 1.0 outside drafting and verification and a plain step
    nothing. K = 1 makes 1.5 tokens in 2.5 against none's 1 in 1.0: none, where one shared host
    time (0.5 after alternating steps) weighed none at 1 in 1.5 and K = 1 at 1.5 in 2.0."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=1, adaptive=True)
    ctl, r = SpecController(cfg, 4096), _Req()
    for _ in range(6):
        _chain_step(ctl, 1, 1, 0.0, 1.5, t_step=2.5, req=r)
        _chain_step(ctl, 0, 0, 0.0, 1.0, t_step=1.0, req=r)
    ctl.alpha = 0.5
    assert ctl._hosts(1) == pytest.approx((0.0, 1.0))
    assert ctl._adaptive_k(1) == 0
    ctl.plain_host = {}   # (not measured: a drafting step's stands for it, as one shared time did)
    assert ctl._adaptive_k(1) == 1


def test_alpha_is_accepted_over_tried_not_over_drafted():
    """Chains of 4 whose tokens are each accepted with probability 0.8 (until the first
    rejection): alpha comes out near 0.8. Accepted / drafted would say about 0.59, since the
    tokens after a rejection were never tried."""
    import random
    rng = random.Random(0)
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
    for _ in range(400):
        n = 0
        while n < 4 and rng.random() < 0.8:
            n += 1
        _chain_step(ctl, 4, n)
    assert abs(ctl.alpha - 0.8) < 0.06, ctl.alpha


def test_the_steps_host_time_counts_against_every_size():
    """Verifying two tokens costs 1.5 plain steps and alpha is 0.5: without the step's time outside
    drafting and verification (1.0 here) no speculation and K = 1 tie; with it, K = 1 wins."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=1, adaptive=True)
    ctl = SpecController(cfg, 4096)
    ctl.alpha, ctl.verify_cost, ctl.draft_time = 0.5, {1: {1: 1.0, 2: 1.5}}, {1: {1: 0.0}}
    tie = ctl._adaptive_k(1)
    ctl.host_cost = {1: 1.0}
    assert ctl._adaptive_k(1) == 1
    ctl2 = SpecController(cfg, 4096)   # measured from the engine's t_step
    for _ in range(3):
        _chain_step(ctl2, 1, 1, 0.0, 1.5, t_step=2.5)
    assert abs(ctl2.host_cost[1] - 1.0) < 1e-9 and tie in (0, 1)


class _Sampled(_Req):
    unseeded_sampled = True   # chains without confidence: E[tokens] from alpha
    sampled = True


def test_greedy_and_sampled_batches_keep_their_own_costs():
    """A sampled step costs more than a greedy one (the sampler's work: a plain step of a batch of
    16, 7.9 ms at T = 0.7 against 6.0 at T = 0), so one table per batch size trailed a switch of
    temperature ("auto" drafted 30 steps at a batch of 16 after the switch to T = 0.7, where no
    speculation paid). A batch at least half of sampled requests keys tables of its own: it measures
    plain decode first, as a new batch size does, the greedy tables stay as they were, alpha is its
    own, and no speculation is inherited from a smaller batch size of its own kind, or by sampled
    batches from greedy ones as large or smaller."""
    from leapfrog.spec_decode.adaptive import mostly_sampled

    plain = (DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0)
    ctl = SpecController(CFG, 4096)
    for _ in PLAIN:
        ctl.observe([_Req()], *plain, 1.0)
    assert ctl.choose([_Req()]) != [0]   # greedy: plain decode measured, the first probe
    assert ctl.choose([_Sampled()]) == [0] and ctl.sampled   # sampled: its own plain decode first
    for _ in PLAIN:
        ctl.observe([_Sampled()], *plain, 1.3)
    G, S = _bucket(1), _bucket(1, sampled=True)
    assert G != S and ctl.verify_cost == {G: {1: 1.0}, S: {1: 1.3}}
    assert ctl.choose([_Sampled()]) != [0]   # now its first probe
    assert mostly_sampled([_Req(), _Sampled()]) and not mostly_sampled([_Req(), _Req(), _Sampled()])
    ctl.alpha = 0.2   # (the sampled batches' alpha, theirs alone)
    assert ctl._acceptance[True].value == 0.2 and ctl._acceptance[False].value != 0.2
    ctl.best[_bucket(4, sampled=True)] = 0   # sampled batches of 4 settled on none
    assert ctl._inherits_off(_bucket(16, sampled=True)) and not ctl._inherits_off(_bucket(16))
    assert ctl.drafting_off(16) and ctl.choose([_Sampled()] * 16) == [0] * 16
    ctl.choose([_Req()] * 16)
    assert not ctl.sampled and not ctl.drafting_off(16)
    # the engine asks before the step's choose, for the batch about to run (new requests may
    # change its kind): the kind given, not the last chosen
    assert ctl.drafting_off(16, sampled=True) and not ctl.sampled
    # no speculation at a greedy batch size rules it out for sampled batches as large (a sampled
    # chain accepts less and costs more to verify), never the other way round
    ctl.best = {_bucket(32): 0}
    assert ctl._inherits_off(_bucket(32, sampled=True)) and ctl._inherits_off(_bucket(64, sampled=True))
    assert not ctl._inherits_off(_bucket(16, sampled=True))
    ctl.best = {_bucket(16, sampled=True): 0}
    assert not ctl._inherits_off(_bucket(16)) and not ctl._inherits_off(_bucket(32))
    assert ctl._inherits_off(_bucket(32, sampled=True))


def test_sampled_chains_without_confidence_are_weighed_by_alpha():
    """Unseeded sampled requests draft chains whose candidate scores are None: they leave the
    confidence curve and calibration alone, measure alpha, and a batch of them chooses among
    chain lengths (up to the depth) by E[tokens](L) = (1 - alpha^(L+1)) / (1 - alpha)."""
    ctl = SpecController(CFG, 4096)
    for _ in PLAIN:
        ctl.observe([_Sampled()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
    assert ctl.choose([_Sampled()]) == [4]   # the probe: a chain of the depth (no sizes above it)
    for _ in range(30):
        _chain_step(ctl, 4, 4, 0.2, 1.1, scores=[None], req=_Sampled())   # all accepted: alpha -> 1
    assert ctl.curve is None and ctl.calibration == 1.0
    assert ctl.alpha > 0.9 and ctl.free_share == 1.0
    assert ctl.choose([_Sampled()]) == [4]
    for _ in range(60):   # nothing accepted: alpha -> 0, no speculation pays
        _chain_step(ctl, 4, 0, 0.2, 1.1, scores=[None], req=_Sampled())
    assert ctl.alpha < 0.1 and ctl.choose([_Sampled()]) == [0]
    # greedy requests' confidences stay their own: a mixed batch's None entries are skipped
    two = DraftBatch(torch.zeros(8, dtype=torch.long), [4, 4], None, torch.tensor([-1, 0, 1, 2] * 2),
                     [[0.5, 0.4, 0.3, 0.2], None])
    ctl.observe([_Req(), _Sampled()], two, AcceptanceResult([1, 4], [[0, 0], [0] * 5], [4, 4]), 0.2, 1.1)
    assert ctl.curve[:4] == [0.5, 0.9, 1.2, 1.4]
    assert abs(ctl.confidence.calibration_at(1.0) - 1 / 1.4) < 1e-9


def test_costs_beyond_the_measured_sizes_follow_the_whole_curve():
    """Two close sizes measured out of order by noise (7 tokens cheaper than 6) must not make
    a 65-token verification look as cheap as 7: the slope from the smallest measured size on."""
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost = {4: {1: 4.0, 5: 7.0, 6: 8.0, 7: 7.9}}
    t = _curve(ctl._verify_table(4), [3, 7, 65])
    assert t[0] == 5.5 and t[1] == 7.9 and t[2] > 7.9 + 0.6 * 57


def test_no_size_weighs_dearer_than_a_longer_one():
    """A size measured dearer than a longer one was measured slow (the first steps after the
    prompts, and never run again): it counts at the longer one's time, and so do the unmeasured
    sizes interpolated up to it. At a batch of 32 the chain of 9 stood at 46 ms, the chain of 10 at
    36, and the chain of 7, interpolated up to 46 at 38 ms (29 measured in the chain engine), was
    never explored."""
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost = {32: {1: 10.0, 10: 46.0, 11: 36.0}}
    table = ctl._verify_table(32)
    assert table == {1: 10.0, 10: 36.0, 11: 36.0} and ctl.verify_cost[32][10] == 46.0   # (the estimate stays)
    assert _curve(table, [8])[0] == pytest.approx(10.0 + 7 / 9 * 26.0)


def test_the_first_drafts_at_a_batch_size_are_judged_together():
    """The first drafting steps at a batch size form one probe: first steps that accept nothing
    (a prompt cut mid-word) are pooled with the next ones, not judged alone."""
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
    chosen = []
    for i in range(len(PLAIN) + 8):
        k = ctl.choose([_Req()])[0]
        chosen.append(k)
        if k:
            _chain_step(ctl, k, 0 if i - len(PLAIN) in (0, 1) else k, 0.0, 1.0 + 0.05 * k)
        else:
            ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
    assert chosen == PLAIN + [4] * 8


def test_an_adaptive_k_probes_less_at_large_batches():
    """An adaptive K's first drafts at a batch size draft K at small batches, fewer at large ones
    (16 // B tokens, as a tree's first size): K = 4 at a batch of 32 cost 4.1 plain steps a step,
    and its 8 steps took the first 48-token run to 0.83x no speculation."""
    for B, k in ((1, 4), (4, 4), (8, 2), (32, 1)):
        ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
        reqs = [_Req() for _ in range(B)]
        for _ in PLAIN:   # plain decode is measured first
            assert ctl.choose(reqs) == [0] * B
            ctl.observe(reqs, DraftBatch.empty(B), AcceptanceResult([0] * B, [[0]] * B, [0] * B), 0.0, 1.0)
        assert ctl.choose(reqs) == [k] * B and ctl.probes[B].steps == 8


def test_a_first_probe_cut_short_keeps_the_acceptance_measured_elsewhere():
    """A batch size's first probe adds to the acceptance other batch sizes measured: cut short
    after one step that accepted nothing (the batch moved on), it must not leave alpha at 0."""
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
    for _ in range(60):
        k = ctl.choose([_Req()])[0]
        if k:   # all but one in five steps accept everything
            _chain_step(ctl, k, k if ctl.steps % 5 else 0, 0.01 * k, 1.0 + 0.2 * k)
        else:
            ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
    before = ctl.alpha
    two = [_Req(), _Req()]
    for _ in PLAIN:
        ctl.observe(two, DraftBatch.empty(2), AcceptanceResult([0, 0], [[0], [0]], [0, 0]), 0.0, 1.1)
    ks = ctl.choose(two)
    assert ks == [4, 4] and 2 in ctl.probes
    ctl.observe(two, DraftBatch.from_lists([[0] * 4] * 2), AcceptanceResult([0, 0], [[0], [0]], [4, 4]), 0.04, 2.0)
    assert before > 0.8 and ctl.alpha > 0.7   # (the probe's one step alone: 0)
    assert ctl.choose([_Req()]) != [0]   # back at batch 1: still speculating


def test_a_first_probe_never_takes_the_rounds_size():
    """With speculation rounds of the depth, the engine runs that size as rounds, which measure no
    one-round drafting cost nor confidences: a first probe of that size came back every step and
    the (slow) rounds ran forever. The probe takes another size, and goodput decides from there."""
    ctl = SpecController(CFG, 4096)
    ctl.round_k, ctl.round_sizes = 4, (4,)
    chosen = []
    for _ in range(40):
        n = ctl.choose([_Sampled()])[0]
        chosen.append(n)
        if n == 0:
            ctl.observe([_Sampled()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
        elif n == 4:   # as rounds: 6 plain steps' time per round, one of four accepted
            ctl.observe_rounds(1, 8, 8 * 6.0, 8, 8 * 4, rejected=8)
        else:
            _chain_step(ctl, n, 1, 0.3, 1.0 + 0.1 * n, scores=[None], req=_Sampled())
    assert chosen[:len(PLAIN) + 2] == PLAIN + [4, 4] and chosen[len(PLAIN) + 2] == 3
    assert chosen[-20:].count(4) <= 2


def test_a_tree_tries_one_more_token_only_where_its_path_stopped_at_children():
    """alpha from trees (adaptive with a static or suffix tree): a path accepted down to a leaf
    tried only its own tokens; one that stopped at a node with children tried one more."""
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
    tree = DraftBatch(torch.zeros(8, dtype=torch.long), [4, 4], None, torch.tensor([-1, 0, 0, 1] * 2))
    # request 0: path 0 -> 1 -> 3 (a leaf): 3 tried, 3 accepted; request 1: path 0 -> 2 (a leaf
    # too): 2 and 2; so far alpha 1. Then a path stopping at node 1 (child 3 rejected): 2 of 3.
    ctl.observe([_Req(), _Req()], tree, AcceptanceResult([3, 2], [[0] * 4, [0] * 3], [4, 4], [[0, 1, 3], [0, 2]]),
                0.1, 1.0)
    assert ctl.alpha == 1.0
    ctl.observe([_Req(), _Req()], tree, AcceptanceResult([2, 0], [[0] * 3, [0]], [4, 4], [[0, 1], []]), 0.1, 1.0)
    keep = min((1 - 1 / 64) ** 4, 1 - 1 / 16)   # (the window forgets per tried token, and per step at most)
    acc, tried = 5 * keep + 2, 5 * keep + 4
    assert abs(ctl.alpha - acc / tried) < 1e-9


def test_drafting_cost_is_a_curve_in_k_once_two_k_are_measured():
    """A draft model's step costs a catch-up forward whatever K plus K draft forwards: measured
    at K = 1 and K = 2 (0.5 + 0.1 K), K = 4 costs 0.9, not K times the cost per token (about 0.48
    here, 1.9 for K = 4)."""
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), 4096)
    for k in (1, 1, 1, 2, 2, 2):
        _chain_step(ctl, k, k, 0.5 + 0.1 * k, 1.0)
    assert ctl.draft_time[1] == {1: 0.6, 2: 0.7}
    ctl.verify_cost = {1: {1: 1.0, 5: 1.0}}
    ctl.alpha = 0.6
    # goodput(4) = E(0.6, 4) / (0.9 + 1.0) = 2.31 / 1.9 = 1.22 > goodput(0) = 1: K = 4
    # (with K times the cost per token, K = 1 would win: 1.6 / 1.48 = 1.08 against 2.31 / 2.9)
    assert ctl._adaptive_k(1) == 4


def test_sizes_past_the_flat_confidence_are_never_weighed():
    """Past the first size whose confidence C(n) is within _FLAT_TOKENS of the largest's, a bigger
    tree expects no more tokens: with verification so cheap that any size would otherwise pay,
    the choice never goes past it (nor does exploration), and only those sizes are weighed."""
    conf = [0.9, 0.9, 0.9, 0.9, 0.9, 0.9] + [1e-4] * 58   # six confident candidates, then nothing
    chosen = _converge(0.001, conf, lambda n: min(n, 5))
    assert chosen[_PLAIN_FIRST:_PLAIN_FIRST + 8] == [16] * 8   # (the first probe, before any confidence is known)
    assert set(chosen[_PLAIN_FIRST + 8:]) == {6}    # (before, exploration tried 12 every other interval)
    ctl = SpecController(CFG, 4096)
    weighed = []
    orig = ctl._explore_weighed   # (the sizes a weighing weighed: its goodputs past no speculation's)
    ctl._explore_weighed = lambda bucket, w: weighed.append(len(w.goodput) - 1) or orig(bucket, w)
    for _ in range(_PLAIN_FIRST + 10):
        n = ctl.choose([_Req()])[0]
        _step(ctl, n, conf, min(n, 5), 0.3, 1.0 + 0.001 * n) if n else ctl.observe(
            [_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, 1.0)
    assert weighed and max(weighed) == 6


def _measured(ctl: SpecController, drafting: dict[int, float], bucket: int = 1) -> None:
    """Plain decode and chains of 1..4 measured at ``bucket`` (a batch of 1, greedy unless given):
    verification costs 1.0 whatever the size, each chain length's drafting as given, no host time."""
    ctl.verify_cost = {bucket: {s: 1.0 for s in range(1, 6)}}
    ctl.tree_draft_cost = {bucket: {(n, 1): t for n, t in drafting.items()}}
    ctl.host_cost = {bucket: 0.0}


def test_a_drafter_unsure_at_depth_is_weighed_by_the_fitted_power():
    """Acceptance at depth i is m_i ** 0.5 (an EAGLE head is under-confident the more, the deeper:
    confidence.py). Calibrated by one linear factor, the chain of 3 looks best; with the fitted
    power the chain of 4 is (and it is: 3.92 tokens for 2.55 against 3.34 for 2.25)."""
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.65, 2: 0.95, 3: 1.25, 4: 1.55})
    chain = [0.8, 0.6, 0.45, 0.34]
    ks = accepted_counts([m ** 0.5 for m in chain])   # (1000 chains a step: the exact frequencies)
    for _ in range(40):
        ctl.confidence.calibrate(sum(ks), ctl.confidence.observe([chain] * len(ks), [4] * len(ks), ks))
    assert ctl.confidence.gamma == 0.5
    assert ctl.choose([_Req()]) == [4]
    ctl.confidence.index = GAMMAS.index(1.0)   # the linear model
    ctl._weighed.clear()
    assert ctl.choose([_Req()]) == [3]


def test_exploration_tries_the_chain_one_level_longer():
    """Chain lengths are close in cost: the best chain's neighbours are one level longer and
    shorter (a spike in the longer chain's drafting time must not keep it unmeasured)."""
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0})
    conf = [0.9, 0.8, 0.3, 0.2]
    for _ in range(10):   # (calibrated at 1 by the linear model: goodputs 1.73, 1.93, 1.76, 1.60)
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([conf], [2]))
    assert ctl.choose([_Req()]) == [2]
    interval = CFG.adaptive_explore_interval
    ctl.steps = interval                       # an exploration step, upwards
    assert ctl.choose([_Req()]) == [3]         # (2 x 2 = 4 before)
    ctl.steps = 2 * interval                   # downwards
    assert ctl.choose([_Req()]) == [1]


def test_the_best_chain_stops_where_another_level_costs_more_than_it_brings():
    """The weighing's best chain comes with a stop confidence (adaptive.stop_confidence): a level's
    drafting and verification time in tokens at the best's goodput, over the calibration, scaled
    by the confidences' ratio of the last two levels; the neighbours explored, a tree and the
    measurement steps draft without one."""
    from leapfrog.spec_decode.adaptive import stop_confidence
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0})
    conf = [0.9, 0.8, 0.3, 0.2]
    for _ in range(10):
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([conf], [2]))
    assert ctl.choose([_Req()]) == [2]
    w = ctl._weighed[1]
    # a level: 0.3 drafting, nothing more to verify
    expect = stop_confidence(0.3 * w.goodput[2], ctl.calibration, ctl.confidence.gamma, 0.8 / 0.9)
    assert ctl.stop_confidence == pytest.approx(expect) and 0.5 < expect < 1
    ctl.steps = CFG.adaptive_explore_interval   # an exploration step: the chain of 3, in full
    assert ctl.choose([_Req()]) == [3] and ctl.stop_confidence is None
    ctl.verify_cost[1] = {s: 1.0 + 0.1 * (s - 1) for s in range(1, 6)}   # a level costs 0.1 more to verify
    ctl._weighed.clear()
    ctl.steps += 1
    k = ctl.choose([_Req()])[0]
    assert 2 <= k <= 4 and ctl.stop_confidence == pytest.approx(stop_confidence(
        (0.3 + 0.1) * ctl._weighed[1].goodput[k], ctl.calibration, ctl.confidence.gamma,
        (ctl.curve[k - 1] - ctl.curve[k - 2]) / (ctl.curve[k - 2] - (ctl.curve[k - 3] if k >= 3 else 0))))
    ctl.tree_draft_cost[1] = {(n, 1): 50.0 for n in range(1, 5)}   # drafting never pays: no chain, no stop
    ctl._weighed.clear()
    ctl.steps += 1
    assert ctl.choose([_Req()]) == [0] and ctl.stop_confidence is None


@pytest.mark.stop_at_depth
def test_one_sequence_runs_the_chain_of_the_depth_under_the_best_chains_stop():
    """At a batch of 1, where the weighing's best is a shorter chain with a stop confidence, the
    chain of the depth runs with that stop (a level past the best is drafted only where the path
    confidence stays above c*); its neighbours are the tree twice the depth (where weighed) and the
    chain one shorter, drafted in full. Not at a batch of 2, and not where the best sets no stop."""
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0})
    conf = [0.9, 0.8, 0.3, 0.2]
    for _ in range(10):
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([conf], [2]))
    assert ctl.choose([_Req()]) == [4]
    w = ctl._weighed[1]
    assert max(range(len(w.goodput)), key=w.goodput.__getitem__) == 2   # (weighed best: the chain of 2)
    expect = adaptive.stop_confidence(0.3 * w.goodput[2], ctl.calibration, ctl.confidence.gamma, 0.8 / 0.9)
    # (up: the tree of 8, past the flat curve here, so never weighed: capped at the chain of 4)
    assert w.best == 4 and ctl.stop_confidence == pytest.approx(expect) and (w.up, w.down) == (4, 3)
    ctl.steps = 2 * CFG.adaptive_explore_interval   # exploration down: the chain of 3, in full
    assert ctl.choose([_Req()]) == [3] and ctl.stop_confidence is None
    two = SpecController(CFG, 4096)            # a batch of 2: the best chain itself
    _measured(two, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0}, bucket=2)
    for _ in range(10):
        two.confidence.calibrate(3.4, two.confidence.observe([conf, conf], [2, 2]))
    assert two.choose([_Req(), _Req()]) == [2, 2] and two.stop_confidence is not None
    ctl.tree_draft_cost[1] = {(n, 1): 50.0 for n in range(1, 5)}   # no stop (none best): nothing promoted
    ctl._weighed.clear()
    ctl.steps += 1
    assert ctl.choose([_Req()]) == [0] and ctl.stop_confidence is None


@pytest.mark.stop_at_depth
def test_a_seeded_request_alone_runs_the_best_chain_itself():
    """A seeded request's chain (a sampled one) drafts every level: no stop would cut the chain of
    the depth, so at a batch of 1 the weighing's best chain runs, where a greedy request's
    measurements, weighed alike, run the chain of the depth under the stop."""
    seeded = _Req()
    seeded.sampled = True   # (a seeded request: sampled, not ``unseeded_sampled``: weighed by its confidences)
    conf = [0.9, 0.8, 0.3, 0.2]
    got = {}
    for req in (_Req(), seeded):
        ctl = SpecController(CFG, 4096)
        ctl.sampled = req.sampled
        _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0}, bucket=ctl._key(1))
        for _ in range(10):
            ctl.confidence.calibrate(1.7, ctl.confidence.observe([conf], [2]))
        got[req.sampled] = (ctl.choose([req]), ctl._weighed[ctl._key(1)], ctl.stop_confidence)
    assert got[False][0] == [4] and got[True][0] == [2]
    assert got[False][1].goodput == got[True][1].goodput and got[True][1].best == 2 and not got[True][1].stops
    # (no stop handed to the proposer for a chain that never stops)
    assert got[False][2] is not None and got[True][2] is None


def test_levels_a_chain_did_not_draft_count_below_its_last():
    """A step whose chain grew fewer levels than the depth counts the levels not drafted at its
    last level's confidence times a child's ratio per level: the ratio the stop confidence assumed
    where the chain stopped early (stop_confidence), else the chain's own last ratio (here one
    level of 0.3: 0.3, taken at least 0.5). So the deep positions of the curve neither move only
    with the steps that stayed confident nor keep what they read before a stretch of short chains."""
    curves = []
    for stopped in (False, True):
        ctl = SpecController(CFG, 4096)
        _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0})
        conf = [0.9, 0.8, 0.7, 0.6]
        for _ in range(10):
            ctl.confidence.calibrate(3.0, ctl.confidence.observe([conf], [4]))
        k = ctl.choose([_Req()])[0]
        assert k >= 2 and ctl.stop_confidence is not None
        if not stopped:
            ctl.stop_confidence = None
        ratio = ctl._weighed[1].ratio
        assert 0.5 <= ratio <= 1
        before = list(ctl.curve)
        _step(ctl, 1, [0.3], 1, 0.1, 1.0)   # one level
        curves.append((before, list(ctl.curve), ratio, k))
    (b0, own, _, _), (b1, pad, ratio, k) = curves
    assert b0 == b1 and ratio != 0.5
    # position 2 moved toward 0.3 + 0.3 * the ratio: the chain's own (0.5), or the stop's
    assert own[1] == pytest.approx(0.8 * b0[1] + 0.2 * (0.3 + 0.3 * 0.5))
    assert pad[1] == pytest.approx(0.8 * b1[1] + 0.2 * (0.3 + 0.3 * ratio))


def test_positions_past_short_chains_recover_when_the_drafter_is_sure_again():
    """After a stretch of unsure drafts, confident chains of 2 move the curve's deeper positions
    back up (their levels extrapolated at the chains' own ratio), and the chain of the depth wins
    the weighing again; kept as they were, those positions stayed where the unsure stretch left
    them and chains of 2 looked best for good."""
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.15, 3: 0.2, 4: 0.25})
    for _ in range(20):   # an unsure stretch: chains of 4, the deep levels hopeless
        _step(ctl, 4, [0.9, 0.05, 0.01, 0.002], 1, 0.25, 1.0)
    low = ctl.curve[3] - ctl.curve[2]
    assert low < 0.01
    for _ in range(20):   # sure again, chains of 2 only
        _step(ctl, 2, [0.95, 0.9], 2, 0.15, 1.0)
    m = [c - p for c, p in zip(ctl.curve, [0.0] + ctl.curve[:-1])]
    assert m[3] > 0.5 > 50 * low and m[2] > m[3]
    ctl._weighed.clear()
    ctl.steps = 1
    assert ctl.choose([_Req()]) == [4]


def test_the_last_weighing_stands_until_steps_pass_or_the_mix_changes():
    """The sizes are weighed again after _REWEIGH_STEPS observed steps (_REWEIGH_OFF_STEPS while
    the last weighing put no speculation first), or at once for another share of unseeded sampled
    requests or another batch size."""
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0})
    for _ in range(3):
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([[0.9, 0.8, 0.3, 0.2]], [2]))
    assert ctl.choose([_Req()]) == [2]
    ctl.tree_draft_cost[1] = {(n, 1): 50.0 for n in range(1, 5)}   # drafting now costs far more than it gains
    assert ctl.choose([_Req()]) == [2]          # the weighing stands (nothing observed since)
    assert ctl.choose([_Sampled()]) == [0]      # another mix of requests: weighed again
    ctl._weighed.clear()
    assert ctl.choose([_Req()]) == [0]
    ctl.tree_draft_cost[1] = {(n, 1): 0.1 * n for n in range(1, 5)}
    ctl.observations += _REWEIGH_STEPS
    assert ctl.choose([_Req()]) == [0]          # a weighing of no speculation stands longer
    ctl.observations += _REWEIGH_OFF_STEPS - _REWEIGH_STEPS - 1
    assert ctl.choose([_Req()]) == [0]
    ctl.observations += 1                       # _REWEIGH_OFF_STEPS observed: weighed again
    assert ctl.choose([_Req()])[0] > 0
    ctl.observations += _REWEIGH_STEPS - 1      # while speculating: every _REWEIGH_STEPS
    ctl.tree_draft_cost[1] = {(n, 1): 50.0 for n in range(1, 5)}
    assert ctl.choose([_Req()])[0] > 0
    ctl.observations += 1
    assert ctl.choose([_Req()]) == [0]          # (at batch 1 no hold: _HOLD_FROM)


def test_at_a_batch_of_one_a_weighing_that_agrees_stands_longer():
    """At a batch of 1 a weighing that agrees with the last one for the same request (the same best
    size) doubles the wait before the next, up to _REWEIGH_SETTLED steps (a weighing of 44-50 sizes
    every 4 steps was about 1 % of the built-in pair's step); another request, or a weighing for
    another size, is weighed again after _REWEIGH_STEPS."""
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0})
    for _ in range(3):
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([[0.9, 0.8, 0.3, 0.2]], [2]))
    r, b = _Req(), ctl._key(1)
    assert ctl.choose([r]) == [2]
    waits = []
    for _ in range(4):
        ctl.observations += ctl._weighed[b].wait
        assert ctl.choose([r]) == [2]
        waits.append(ctl._weighed[b].wait)
    assert waits == [2 * _REWEIGH_STEPS, 4 * _REWEIGH_STEPS, _REWEIGH_SETTLED, _REWEIGH_SETTLED]
    w = ctl._weighed[b]
    ctl.observations += _REWEIGH_SETTLED - 1
    assert ctl.choose([r]) == [2] and ctl._weighed[b] is w          # it stands
    r = _Req()
    assert ctl.choose([r]) == [2] and ctl._weighed[b] is not w   # another request: weighed again
    assert ctl._weighed[b].wait == _REWEIGH_STEPS
    ctl.observations += _REWEIGH_STEPS
    assert ctl.choose([r]) == [2] and ctl._weighed[b].wait == 2 * _REWEIGH_STEPS
    ctl.tree_draft_cost[b] = {(n, 1): 0.1 * n for n in range(1, 5)}   # drafting cheaper: a longer chain
    ctl.observations += 2 * _REWEIGH_STEPS - 1
    assert ctl.choose([r]) == [2]                # (not yet)
    ctl.observations += 1
    k = ctl.choose([r])[0]
    assert k > 2 and ctl._weighed[b].wait == _REWEIGH_STEPS
    # at larger batches every _REWEIGH_STEPS, agreeing or not
    big = [_Req() for _ in range(4)]
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0}, ctl._key(4))
    for _ in range(3):
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([[0.9, 0.8, 0.3, 0.2]], [2]))
    k = ctl.choose(big)[0]
    for _ in range(3):
        ctl.observations += _REWEIGH_STEPS
        w = ctl._weighed.get(ctl._key(4))
        assert ctl.choose(big)[0] == k and ctl._weighed[ctl._key(4)] is not w
        assert ctl._weighed[ctl._key(4)].wait == _REWEIGH_STEPS


def _speculating(B: int) -> tuple[SpecController, list[_Req], int]:
    """A controller drafting size k > 0 for a batch of B: chains of 1..4 measured cheap there, a
    confident drafter."""
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0}, _bucket(B))
    for _ in range(3):
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([[0.9, 0.8, 0.3, 0.2]], [2]))
    batch = [_Req() for _ in range(B)]
    k = ctl.choose(batch)[0]
    assert k > 0
    return ctl, batch, k


def test_speculation_goes_off_only_when_two_weighings_in_a_row_say_so():
    """Speculating, a first weighing for no speculation keeps the last best size until the next
    weighing, after that size's fresh measurements: while off nothing measured moves acceptance or
    the calibration, so one unlucky stretch kept speculation off for hundreds of steps where it
    paid. A second weighing for speculation in between clears the hold."""
    B, b = _HOLD_FROM, _bucket(_HOLD_FROM)
    ctl, batch, k = _speculating(B)
    cheap, dear = dict(ctl.tree_draft_cost[b]), {(n, 1): 50.0 for n in range(1, 5)}
    ctl.tree_draft_cost[b] = dear
    ctl.observations += _REWEIGH_STEPS
    assert ctl.choose(batch)[0] == k            # held
    assert ctl._weighed[b].holding
    ctl.tree_draft_cost[b] = cheap
    ctl.observations += _REWEIGH_STEPS
    assert ctl.choose(batch)[0] == k            # speculation weighed best again: the hold is over
    assert not ctl._weighed[b].holding
    ctl.tree_draft_cost[b] = dear
    ctl.observations += _REWEIGH_STEPS
    assert ctl.choose(batch)[0] == k            # held again
    ctl.observations += _REWEIGH_STEPS
    assert ctl.choose(batch)[0] == 0            # two in a row: off
    assert ctl.best[b] == 0 and ctl.drafting_off(B)
    # below _HOLD_FROM (a probe comes soon after speculation goes off) one weighing turns it off
    small = SpecController(CFG, 4096)
    _measured(small, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0})
    small.confidence = ctl.confidence
    assert small.choose([_Req()])[0] > 0
    small.tree_draft_cost[1] = dear
    small.observations += _REWEIGH_STEPS
    assert small.choose([_Req()]) == [0]


def test_a_batchs_first_steps_never_turn_speculation_off():
    """In the first _START_HOLD steps of a batch whose requests are mostly new (a static batch's
    start, which accepts less for a few steps and still beats none), weighings for no speculation
    hold the last size however many come in a row; from then on two in a row turn it off. A few
    requests joining a running batch start nothing."""
    B, b = _HOLD_FROM, _bucket(_HOLD_FROM)
    plain = (DraftBatch.empty(B), AcceptanceResult([0] * B, [[0]] * B, [0] * B), 0.0, 1.0)

    def weighings_until_off(batch: list) -> int:
        for n in range(1, 3 * _START_HOLD):
            ctl.observations += _REWEIGH_STEPS - 1
            ctl.observe(batch, *plain)   # (a step: the batch ages by one)
            if ctl.choose(batch)[0] == 0:
                return n
        raise AssertionError("speculation never went off")

    def speculating_for_a_while() -> tuple[SpecController, list[_Req]]:
        ctl, batch, k = _speculating(B)
        for _ in range(_START_HOLD):   # (its own start long past)
            ctl.observe(batch, *plain)
        assert ctl.choose(batch)[0] == k
        ctl.tree_draft_cost[b] = {(n, 1): 50.0 for n in range(1, 5)}   # drafting got dear: none weighs best
        return ctl, batch

    ctl, batch = speculating_for_a_while()
    assert weighings_until_off(batch) == 2           # two weighings in a row (the hold, then off)
    ctl, batch = speculating_for_a_while()
    new = [_Req() for _ in range(B)]
    assert weighings_until_off(new) == _START_HOLD + 1   # a new batch: held until _START_HOLD of its steps ran
    ctl, batch = speculating_for_a_while()
    joined = batch[:-B // 2] + [_Req() for _ in range(B // 2)]   # half the batch new: no batch start
    assert weighings_until_off(joined) == 2          # two weighings in a row (the hold, then off)


def _off_after_speculating(B: int) -> tuple[SpecController, list[_Req], int]:
    """A controller at a batch of B that drafted size k, then turned speculation off (drafting got
    dear: two weighings in a row from _HOLD_FROM on, one below)."""
    b = _bucket(B)
    ctl, batch, k = _speculating(B)
    ctl.tree_draft_cost[b] = {(n, 1): 50.0 for n in range(1, 5)}
    while ctl.choose(batch)[0]:
        ctl.observations += _REWEIGH_STEPS
    assert ctl.best[b] == 0
    return ctl, batch, k


def _plain_steps_until_drafts(ctl: SpecController, batch: list, most: int) -> int | None:
    """Plain steps of ``batch`` (each chosen, then observed) until ``choose`` drafts: how many ran
    before (None: none drafted in ``most``)."""
    B = len(batch)
    plain = (DraftBatch.empty(B), AcceptanceResult([0] * B, [[0]] * B, [0] * B), 0.0, 1.0)
    for n in range(most):
        ctl.observe(batch, *plain)
        if ctl.choose(batch)[0]:
            return n + 1
    return None


def test_speculation_turned_off_after_speculating_is_probed_again_soon_with_its_size():
    """From _HOLD_FROM on, speculation that turns off after speculating is probed with the size it
    ran after _REPROBE_STEPS plain steps, once: the weighings that turn it off come mostly at a
    static batch's start (its first steps accept less, the curve still holds the last batch's
    tail), and while off nothing measured moves them; the next probe came 2048 steps later at a
    batch of 16, and "auto" sat out whole batches where the chains ran 1.05-1.1x none. After that
    probe, the usual wait (8 intervals x the batch size, doubling)."""
    ctl, batch, k = _off_after_speculating(_HOLD_FROM)
    assert _plain_steps_until_drafts(ctl, batch, 4 * _REPROBE_STEPS) == _REPROBE_STEPS
    assert ctl.choose(batch)[0] == k            # the probe: the size speculation ran
    assert _plain_steps_until_drafts(ctl, batch, 8 * _REPROBE_STEPS) is None   # (cut short: plain steps)
    # below _HOLD_FROM a probe comes soon anyway (128 steps at batch 1): the usual wait
    small, batch, k = _off_after_speculating(1)
    assert _plain_steps_until_drafts(small, batch, 4 * _REPROBE_STEPS) == 8 * CFG.adaptive_explore_interval


def test_drafting_steps_right_after_a_request_joined_leave_the_costs_alone():
    """The first _SPEC_SETTLE drafting steps after a request joined the batch (its prefill ran)
    run slow (a batch of 16 verifying chains of 3: 5.7, 5.4, 5.0 ms, then 4.7-4.8): they move no
    verify or host time already measured. A request finishing joins nothing; a new one does."""
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost, ctl.host_cost = {2: {1: 1.0, 3: 2.0}}, {2: 0.5}
    drafts = DraftBatch(torch.zeros(4, dtype=torch.long), [2, 2], None, torch.full((4,), -1), [[0.5, 0.2]] * 2)

    def step(reqs: list, t_verify: float) -> None:
        n = len(reqs)
        d = drafts if n == 2 else DraftBatch(torch.zeros(2, dtype=torch.long), [2], None, torch.full((2,), -1),
                                             [[0.5, 0.2]])
        ctl.observe(reqs, d, AcceptanceResult([1] * n, [[0, 0]] * n, [2] * n), 0.1, t_verify, batch_size=2,
                    t_step=t_verify + 0.1 + 0.9)

    a, b, c = _Req(), _Req(), _Req()
    for _ in range(_SPEC_SETTLE):
        step([a, b], 3.0)                       # right after the join: slow, left out
    assert ctl.verify_cost[2][3] == 2.0 and ctl.host_cost[2] == 0.5
    step([a, b], 2.5)                           # settled: averaged in
    assert ctl.verify_cost[2][3] == pytest.approx(0.8 * 2.0 + 0.2 * 2.5)
    assert ctl.host_cost[2] == pytest.approx(0.8 * 0.5 + 0.2 * 0.9)
    before = ctl.verify_cost[2][3]
    step([a], 2.5)                              # b finished: still settled
    assert ctl.verify_cost[2][3] == pytest.approx(0.8 * before + 0.2 * 2.5)
    before = ctl.verify_cost[2][3]
    step([a, c], 3.0)                           # c joined: slow again
    assert ctl.verify_cost[2][3] == before


def test_a_neighbour_whose_verify_time_went_stale_is_explored_and_measured_afresh():
    """A neighbour weighed under _EXPLORE_MARGIN of the best size (never explored) but within
    _STALE_MARGIN is explored once its verify time has gone _STALE_STEPS steps unmeasured, and that
    step's time replaces the estimate: taken in a burst of slow steps (the chain of 4 at a batch of
    16 estimated 8.2 ms where it ran 6.5), it would otherwise stand for good. Its next step is
    averaged in again; no speculation and sizes outside _STALE_MARGIN are never explored so."""
    interval = CFG.adaptive_explore_interval
    ctl = SpecController(CFG, 4096)
    big = _bucket(_HOLD_FROM)
    ctl.verify_cost = {n: {1: 1.0, 3: 2.0, 4: 4.0} for n in (1, 2, big)}
    ctl.verify_at = {n: {1: 0, 3: 0, 4: 0} for n in (1, 2, big)}
    gp = {0: 0.5, 1: 0.5, 2: 1.0, 3: 0.8}.__getitem__
    tokens = lambda n: n + 1   # (a size's verified tokens a sequence)

    def explore(goodput=gp, best=2, bucket=big) -> int:
        ctl.steps = interval   # an exploration step, the size up's turn
        return ctl._explore(bucket, best, goodput, 3, 1, 1, tokens)

    ctl.observations = _STALE_STEPS - 1
    assert explore() == 2                        # 0.8 of the best, measured lately: not explored
    ctl.observations = _STALE_STEPS
    assert explore() == 3                        # gone stale
    assert explore(bucket=1) == 2                # (below a batch of _HOLD_FROM: as before)
    assert explore({0: 0.5, 1: 0.5, 2: 1.0, 3: 0.6}.__getitem__) == 2   # outside _STALE_MARGIN
    a, b = _Req(), _Req()
    ctl._seen_ids, ctl._since_join = {a.request_id, b.request_id}, _SPEC_SETTLE   # (a settled batch)
    drafts = DraftBatch(torch.zeros(6, dtype=torch.long), [3, 3], None, torch.full((6,), -1), [[0.5, 0.3, 0.2]] * 2)
    step = (AcceptanceResult([1, 1], [[0, 0]] * 2, [3, 3]), 0.1)
    ctl.observe([a, b], drafts, *step, 2.5)
    assert ctl.verify_cost[2][4] == 2.5          # replaced (the measurement holds at any batch size)
    assert ctl.verify_at[2][4] == ctl.observations
    ctl.observe([a, b], drafts, *step, 3.0)
    assert ctl.verify_cost[2][4] == pytest.approx(0.8 * 2.5 + 0.2 * 3.0)   # fresh again: averaged in
    ctl.verify_at[big][4] = ctl.observations   # (measured lately at the batch explored)
    assert explore() == 2
    ctl.observations += _STALE_STEPS
    assert explore({0: 0.8, 1: 0.5, 2: 1.0, 3: 0.6}.__getitem__, best=0) == 0   # while off: as before


def test_no_hold_across_another_share_of_unseeded_sampled_requests():
    """The hold keeps the last best size only for the same share of unseeded sampled requests and
    within the sizes weighed now: a tree of 8 held for a batch that turned all sampled (chains up to
    the depth only, sizes 0-4 weighed) looked its neighbours up past the goodputs (IndexError) and
    drafted a size such a batch never weighs."""
    cfg = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 4,
                                       "eagle_topk": 4, "num_draft_tokens": "auto"})
    class _Seeded(_Req):   # sampled with a seed: scored drafts, trees (free share 0)
        sampled = True

    ctl = SpecController(cfg, 4096)
    B, b = _HOLD_FROM, _bucket(_HOLD_FROM, sampled=True)   # (seeded and unseeded: the sampled tables)
    ctl.verify_cost = {b: {s: 1.0 for s in range(1, 18)}}
    ctl.tree_draft_cost = {b: {lw: 0.1 for lw in {cfg.tree_shape(n) for n in range(1, 17)}}}
    ctl.host_cost = {b: 0.0}
    conf = [0.95 ** (i // 4 + 1) for i in range(64)]
    for _ in range(3):
        ctl.confidence.calibrate(12.0, ctl.confidence.observe([conf], [16]))
    assert ctl.choose([_Seeded() for _ in range(B)])[0] > cfg.num_speculative_tokens   # a tree past the depth
    ctl.sampled = True
    ctl.alpha = 0.01                            # unseeded sampled chains: nothing accepted
    ctl.observations += _REWEIGH_STEPS
    ctl.steps = 16                              # (an exploration step: neighbours looked up)
    k = ctl.choose([_Sampled() for _ in range(B)])[0]   # another share: no hold, and no IndexError
    assert ctl.best[b] == 0 and not ctl._weighed[b].holding
    assert k <= cfg.num_speculative_tokens      # (at most exploring a chain: the sizes it weighs)


def test_a_drafting_step_while_off_has_the_sizes_weighed_again():
    """While the last weighing put no speculation first it stands _REWEIGH_OFF_STEPS steps, but a
    drafting step in between (a probe, exploration) measured what the weighing left out: the next
    choice weighs again."""
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 50.0, 2: 50.0, 3: 50.0, 4: 50.0})
    for _ in range(3):
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([[0.9, 0.8, 0.3, 0.2]], [2]))
    assert ctl.choose([_Req()]) == [0]
    ctl.tree_draft_cost[1] = {(n, 1): 0.1 * n for n in range(1, 5)}
    ctl.observations += 1
    assert ctl.choose([_Req()]) == [0]          # (the weighing stands)
    _step(ctl, 2, [0.9, 0.8, 0.3, 0.2], 2, 0.2, 1.0)
    assert ctl.choose([_Req()])[0] > 0


def test_a_larger_batch_first_probes_the_size_a_smaller_one_settled_on():
    """Costs only grow with the batch: the best size at the next smaller batch size measured
    bounds the best size here, so the first drafts at a new batch size probe it (where no smaller
    batch size is measured, 16 // B nodes, and at least the chain of _SEED_CHAIN levels up to the
    depth). Probing 1 at a batch of 16 climbed one level per exploration interval, chains of 1-3
    for a whole run where 7 ran fastest; at a first batch of 32, depth 10, it never climbed."""
    def first_probe(ctl: SpecController, B: int) -> int:
        reqs = [_Req() for _ in range(B)]
        for _ in PLAIN:   # plain decode is measured first
            assert ctl.choose(reqs) == [0] * B
            ctl.observe(reqs, DraftBatch.empty(B), AcceptanceResult([0] * B, [[0]] * B, [0] * B), 0.0, 1.0)
        k = ctl.choose(reqs)[0]
        assert ctl.probes[_bucket(B)].steps == 8
        return k

    ctl = SpecController(CFG, 4096)
    ctl.confidence.calibrate(1.0, ctl.confidence.observe([[0.9] * 64], [16]))
    assert first_probe(ctl, 16) == 4                          # nothing measured below: the chain of 4
    ctl = SpecController(CFG, 4096)
    ctl.confidence.calibrate(1.0, ctl.confidence.observe([[0.9] * 64], [16]))
    ctl.best = {1: 16, 4: 3}
    assert first_probe(ctl, 16) == 3                          # the nearest smaller batch size's
    ctl.best = {1: 16}
    assert ctl._seed_size(4) == 4 and ctl._seed_size(2) == 8  # a tree no wider than depth 4 or 16 // B
    adaptive = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True)
    ctl = SpecController(adaptive, 4096)
    ctl.best = {1: 4}
    assert first_probe(ctl, 32) == 4
    assert SpecController(adaptive, 4096)._seed_size(32) == 1


def test_a_chain_measured_alone_borrows_the_curve_of_another_batch_size():
    """A batch size seeded at its longest chain has measured no shorter one: their drafting costs
    follow the nearest batch size's curve in levels, scaled to the chain measured here (lent
    unscaled, the shorter chains looked as dear as the longest and "auto" took 64 steps to come
    down from the chain of 7 to the chain of 5 at a batch of 32)."""
    ctl = SpecController(CFG, 4096)
    ctl.tree_draft_cost = {1: {(1, 1): 1.0, (4, 1): 2.5, (4, 4): 9.0}, 32: {(2, 1): 0.1},
                           16: {(4, 1): 10.0, (4, 2): 12.0}}
    assert ctl._chain_draft_times(16) == {1: 4.0, 2: 6.0, 3: 8.0, 4: 10.0}   # (32 has one chain: 1's curve)
    ctl.tree_draft_cost[32] = {(2, 1): 0.1, (3, 1): 0.2}                     # 32's, nearer
    # (1's curve for the chain of 1, but never dearer than the chain of 2)
    assert ctl._chain_draft_times(16) == pytest.approx({1: 10 / 3, 2: 10 / 3, 3: 20 / 3, 4: 10.0})
    ctl.tree_draft_cost[8] = {(1, 1): 1.0, (2, 1): 2.0, (4, 1): 4.0}        # as near as 32, smaller
    assert ctl._chain_draft_times(16) == pytest.approx({1: 2.5, 2: 5.0, 3: 7.5, 4: 10.0})
    assert ctl._chain_draft_times(1) == {1: 1.0, 4: 2.5}                     # measured: its own
    assert SpecController(CFG, 4096)._chain_draft_times(16) == {}


def test_chains_shorter_than_those_measured_follow_the_curve_of_another_batch_size():
    """Seeded at its longest chains, a batch size measures two or more of them and none shorter:
    the shorter ones follow the nearest batch size's curve that measured them, from the shortest
    measured here (flat below it, "auto" at depth 10 seeded at 9 at a batch of 32 never tried a
    chain under 8)."""
    ctl = SpecController(CFG, 4096)
    ctl.tree_draft_cost = {16: {(1, 1): 2.0, (2, 1): 3.0, (3, 1): 4.0, (4, 1): 5.0},
                           32: {(3, 1): 9.0, (4, 1): 10.0}}
    assert ctl._chain_draft_times(32) == pytest.approx({1: 4.5, 2: 6.75, 3: 9.0, 4: 10.0})
    ctl.tree_draft_cost[32] = {(1, 1): 4.0, (2, 1): 5.0}                     # longer: from the longest
    assert ctl._chain_draft_times(32) == pytest.approx({1: 4.0, 2: 5.0, 3: 5.0 * 4 / 3, 4: 5.0 * 5 / 3})
    ctl.tree_draft_cost[32] = {(1, 1): 4.0, (4, 1): 8.0}                     # the whole range: its own
    assert ctl._chain_draft_times(32) == {1: 4.0, 4: 8.0}
    ctl.tree_draft_cost = {1: {(1, 1): 1.0, (2, 1): 1.5, (4, 1): 2.5}, 16: {(3, 1): 6.0, (4, 1): 6.0},
                           32: {(3, 1): 9.0, (4, 1): 10.0}}
    # (16 is nearer, but measured nothing under 3: 1's curve, which did)
    assert ctl._chain_draft_times(32) == pytest.approx({1: 4.5, 2: 6.75, 3: 9.0, 4: 10.0})


def test_three_or_more_chains_lie_on_the_line_through_them():
    """A chain's drafting is the head's catch-up plus one forward per level: with three or more
    chains measured twice or more at a batch size, their times are read off the least-squares line
    through those, weighted by samples (up to _LINE_WEIGHT each), never decreasing in levels and
    never under half the least time fitted (at a batch of 4 the chain of 6 measured 2.87 ms
    between 3.40 for 5 and 4.90 for 7, and "auto" kept to it a whole run where the chain of 7 ran
    5 % faster). A first measurement (catch-ups, cold shapes) stays out of the fit."""
    ctl = SpecController(CFG, 4096)
    ctl.tree_draft_cost = {4: {(2, 1): 3.4, (3, 1): 2.87, (4, 1): 4.9, (4, 4): 20.0}}
    ctl.draft_samples = {(4, (lv, 1)): 2 for lv in (2, 3, 4)}
    line = ctl._chain_draft_times(4)
    assert line == pytest.approx({2: 2.973, 3: 3.723, 4: 4.473}, abs=0.001)
    ctl.draft_samples[(4, (3, 1))] = 50                                      # counts for 8, not 50
    assert ctl._chain_draft_times(4) == pytest.approx({2: 2.547, 3: 3.297, 4: 4.047}, abs=0.001)
    ctl.draft_samples[(4, (4, 1))] = 1                                       # measured once: read off the line
    assert ctl._chain_draft_times(4) == {2: 3.4, 3: 2.87, 4: 4.9}           # (two fitted: as measured)
    ctl.tree_draft_cost[4][(1, 1)] = 3.0
    ctl.draft_samples[(4, (1, 1))] = 2
    # (1, 2 and 3 fitted: their line falls, so their weighted mean, and the chain of 4 reads it too)
    assert ctl._chain_draft_times(4) == pytest.approx({1: 2.98, 2: 2.98, 3: 2.98, 4: 2.98})
    ctl.tree_draft_cost = {4: {(2, 1): 5.0, (3, 1): 4.0, (4, 1): 3.0}}      # falling: noise, the mean
    ctl.draft_samples = {(4, (lv, 1)): 2 for lv in (2, 3, 4)}
    assert ctl._chain_draft_times(4) == pytest.approx({2: 4.0, 3: 4.0, 4: 4.0})
    # a steep line read far below its points: never under half the least of them
    ctl.tree_draft_cost = {4: {(3, 1): 1.0, (4, 1): 3.0, (5, 1): 5.0, (1, 1): 9.0}}
    ctl.draft_samples = {(4, (lv, 1)): 2 for lv in (3, 4, 5)}
    assert ctl._chain_draft_times(4)[1] == pytest.approx(0.5)
    ctl.tree_draft_cost = {4: {(2, 1): 3.0, (4, 1): 5.0}}                    # two: as measured
    assert ctl._chain_draft_times(4) == {2: 3.0, 4: 5.0}


def test_plain_decode_is_measured_after_the_slow_steps_and_kept_current_when_the_call_is_close():
    """The first steps after a prefill run slow (a batch of 16: 3.8, 3.5, 2.8, 2.6 ms, then 2.3):
    t_verify(B, 1) is the lesser of the last two of the first _PLAIN_FIRST one-token steps. While
    speculating where no speculation's estimated goodput is within _PLAIN_CLOSE of the best size's, _PLAIN_FIRST
    plain steps every _PLAIN_REFRESH exploration intervals measure it again at the context the
    sizes now run at (a plain step of a batch of 16 grew from 3.2 ms to 4.3 over 100 tokens, and
    the first plain steps after verifying many tokens run slow as well), the lesser of the last
    two replacing the estimate; measured at the start only, it made speculation look 20 % better than it was at a
    batch of 16, T = 0.7. Where speculation is far ahead, no plain step is spent on it."""
    slow = [3.8 - 0.2 * i for i in range(_PLAIN_FIRST - 2)]
    ctl = SpecController(CFG, 4096)
    for i, t in enumerate(slow + [2.8, 2.6]):
        assert ctl.choose([_Req()]) == [0]
        ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, t)
        assert ctl.verify_cost[1].get(1) == (None if i < _PLAIN_FIRST - 1 else 2.6)
    ctl = SpecController(CFG, 4096)
    for t in slow + [2.6, 2.8]:   # (a spike in the last step: the one before stands)
        ctl.choose([_Req()])
        ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, t)
    assert ctl.verify_cost[1][1] == 2.6

    def run(plain: float) -> tuple[SpecController, list[int]]:
        """Chains of 1-4 measured (goodputs 1.73, 1.93, 1.76, 1.60), plain decode at ``plain``;
        plain steps now cost 0.6, 0.8 right after a verification."""
        ctl = SpecController(CFG, 4096)
        _measured(ctl, {1: 0.1, 2: 0.4, 3: 0.7, 4: 1.0})
        ctl.verify_cost[1][1] = plain
        for _ in range(10):
            ctl.confidence.calibrate(1.7, ctl.confidence.observe([[0.9, 0.8, 0.3, 0.2]], [2]))
        chosen = []
        for _ in range(3 * _PLAIN_REFRESH * CFG.adaptive_explore_interval + _PLAIN_FIRST):
            n = ctl.choose([_Req()])[0]
            chosen.append(n)
            if n == 0:
                t = 0.8 if len(chosen) > 1 and chosen[-2] else 0.6
                ctl.observe([_Req()], DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0, t)
        return ctl, chosen

    ctl, chosen = run(0.65)   # (plain decode 1.54, then 1.67: within _PLAIN_CLOSE of the chain of 2)
    zeros = [i for i, n in enumerate(chosen) if n == 0]
    runs = [zeros[i:i + _PLAIN_FIRST] for i in range(0, len(zeros), _PLAIN_FIRST)]
    assert len(runs) == 3 and all(r == list(range(r[0], r[0] + _PLAIN_FIRST)) for r in runs)
    assert ctl.verify_cost[1][1] == 0.6   # the refresh's last plain step, not 0.65 nor 0.8
    ctl, chosen = run(1.0)   # (plain decode 1.0: the chain is far ahead)
    assert chosen.count(0) == 0 and ctl.verify_cost[1][1] == 1.0


def test_a_refresh_of_plain_decode_never_sticks():
    """A refresh measures only what a one-token step observed and unwidened measures: none starts
    where plain steps run as multi-step decode (measured as rounds) or while steps are widened, a
    multi-step decode step ends one, its last step widened measures nothing (the next plain step
    is not taken raw), and the batch moving to another batch size drops it."""
    interval = CFG.adaptive_explore_interval
    period = max(_PLAIN_REFRESH * interval, 64)
    gp = {0: 0.9, 1: 0.95, 2: 1.0, 3: 0.9}.__getitem__
    ctl = SpecController(CFG, 4096)
    ctl.steps = period - 1
    ctl.round_sizes = (4, 0)
    assert ctl._explore(1, 2, gp, 3, 1, 1) == 2          # multi-step decode: none
    ctl.round_sizes = ()
    ctl.widened[1] = True
    assert ctl._explore(1, 2, gp, 3, 1, 1) == 2          # widened: none
    ctl.widened[1] = False
    assert ctl._explore(1, 2, gp, 3, 1, 1) == 0 and ctl.refresh == {1: _PLAIN_FIRST - 1}
    ctl.observe_rounds(1, 8, 8.0, size=0)                 # ran as multi-step decode after all
    assert not ctl.refresh

    ctl = SpecController(CFG, 4096)
    ctl.verify_cost = {1: {1: 1.0}}
    ctl.refresh = {1: 1}
    assert ctl.choose([_Req()]) == [0] and ctl.refresh == {1: 0}   # (its last step)
    plain = (DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0)
    r = _Req()
    ctl.observe([r], *plain, 5.0, verify_tokens=3)  # widened by another proposer's drafts
    assert ctl.verify_cost[1][1] == 1.0 and not ctl.refresh
    for _ in range(_PLAIN_SETTLE - 1):   # (the first plain steps in a row, the widened one not among them)
        ctl.observe([r], *plain, 5.0)
    assert ctl.verify_cost[1][1] == 1.0
    for _ in range(_PLAIN_BURST_STEPS - 1):            # ordinary plain steps: 5x the estimate, left
        ctl.observe([r], *plain, 5.0)                 # out until _PLAIN_BURST_STEPS in a row (_disturbed)
    assert ctl.verify_cost[1][1] == 1.0
    ctl.observe([r], *plain, 5.0)                     # then averaged in: bounded, not raw
    assert ctl.verify_cost[1][1] == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)

    ctl = SpecController(CFG, 4096)
    ctl.refresh = {1: 2, 4: 0}
    ctl.choose([_Req(), _Req()])                          # batch size 2 now
    assert not ctl.refresh


def test_plain_decode_far_off_the_best_is_refreshed_once_its_estimate_is_old():
    """Speculating where no speculation weighs far under the best size (outside _PLAIN_CLOSE), a
    refresh of plain decode still comes once its estimate has stood for as many steps as keep the
    refresh's cost under _PLAIN_STALE_COST of them: an estimate taken in a disturbance (another
    process on a core: plain decode measured at 90 ms a step where it ran 7.7) otherwise stood for
    good, and "auto" drafted at 0.92x none for a whole run. Standing above a longer size's time it
    is due at once."""
    period = max(_PLAIN_REFRESH * CFG.adaptive_explore_interval, 64)
    ratio = 0.5
    gp = {0: ratio, 1: 0.9, 2: 1.0, 3: 0.9}.__getitem__
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost, ctl.verify_at = {1: {1: 1.0}}, {1: {1: 0}}
    ctl.steps = period - 1
    due = math.ceil(_PLAIN_FIRST * (1 - ratio) / _PLAIN_STALE_COST)
    ctl.observations = due - 1
    assert ctl._explore(1, 2, gp, 3, 1, 1) == 2          # measured lately enough: no refresh
    ctl.observations = due
    assert ctl._explore(1, 2, gp, 3, 1, 1) == 0 and ctl.refresh == {1: _PLAIN_FIRST - 1}
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost, ctl.verify_at = {1: {1: 1.0}}, {1: {1: 0}}
    ctl.steps, ctl.observations = period - 1, due
    assert ctl._explore(1, 2, {0: 0.4, 1: 0.9, 2: 1.0, 3: 0.9}.__getitem__, 3, 1, 1) == 2   # farther off: later
    ctl.verify_cost = {1: {1: 3.0, 3: 2.0}}   # dearer than 3 tokens a sequence: measured slow, due now
    ctl.verify_at = {1: {1: ctl.observations, 3: ctl.observations}}
    assert ctl._explore(1, 2, gp, 3, 1, 1) == 0


def test_plain_steps_right_after_drafts_or_a_new_request_leave_plain_decode_alone():
    """The first plain steps after drafting steps run slow (a batch of 16 at T = 0.7: 5.2, 5.2,
    4.4, 4.0, then 3.7 ms), and so do those after a new request's prefill: t_verify(B, 1) averages
    plain steps in only from the fourth (_PLAIN_SETTLE) of the same requests in a row on. Averaged in,
    they held the estimated speed of no speculation 6-17 % under a run of plain steps' while "auto"
    drafted, where turning speculation off would have bought that run's speed."""
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost = {1: {1: 1.0}}
    r = _Req()
    plain = (DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0)
    ctl.observe([r], DraftBatch.from_lists([[5, 5]]), AcceptanceResult([1], [[0, 0]], [2]), 0.2, 1.5)
    for _ in range(3):   # right after the drafting step: slow, left out
        ctl.observe([r], *plain, 1.6)
    assert ctl.verify_cost[1][1] == 1.0
    ctl.observe([r], *plain, 1.2)        # settled: averaged in
    assert ctl.verify_cost[1][1] == pytest.approx(0.8 * 1.0 + 0.2 * 1.2)
    r2 = _Req()
    for _ in range(3):   # another request in r's place: its prefill ran, slow again
        ctl.observe([r2], *plain, 3.0)
    assert ctl.verify_cost[1][1] == pytest.approx(1.04)
    ctl.observe([r2], *plain, 1.25)
    assert ctl.verify_cost[1][1] == pytest.approx(0.8 * 1.04 + 0.2 * 1.25)
    ctl.observe_rounds(1, 4, 4.0, accepted=4, drafted=8, size=2)   # drafting rounds end the run too
    ctl.observe([r2], *plain, 3.0)
    assert ctl.verify_cost[1][1] == pytest.approx(0.8 * 1.04 + 0.2 * 1.25)


def test_one_slow_plain_step_in_a_run_leaves_plain_decode_alone():
    """A settled plain step is averaged in as the median of it and the run's two settled steps
    before it (the lesser of it and the step before while the run has fewer): one slow step among
    steady ones (the OS: 4.4 ms among 2.6-2.9 at a batch of 16) moved t_verify(B, 1) by a fifth of
    itself, and the controller, finding speculation better than the raised estimate, drafted on at
    0.90-0.95x none with no plain step left to bring it back (stop 104). Two slow steps in a row
    are a slower plain step, and move it."""
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost = {1: {1: 1.0}}
    r = _Req()
    plain = (DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0)
    for t in (1.0, 1.0, 1.0, 1.0, 1.7):   # settled from the fourth; the first settled ones' slow
        ctl.observe([r], *plain, t)        # step: the lesser of it and the one before
    assert ctl.verify_cost[1][1] == pytest.approx(1.0)
    for t in (1.0, 1.0, 1.8, 1.0, 1.0):    # one slow step among three: the median
        ctl.observe([r], *plain, t)
        assert ctl.verify_cost[1][1] == pytest.approx(1.0)
    ctl.observe([r], *plain, 1.2)
    assert ctl.verify_cost[1][1] == pytest.approx(1.0)
    ctl.observe([r], *plain, 1.22)         # two in a row: the median, 1.2
    assert ctl.verify_cost[1][1] == pytest.approx(0.8 * 1.0 + 0.2 * 1.2)
    ctl.observe([r], DraftBatch.from_lists([[5]]), AcceptanceResult([1], [[0, 0]], [1]), 0.2, 1.5)
    for t in (2.0, 2.0, 2.0, 1.2, 1.3):    # a new run: the slow first three left out, then the
        ctl.observe([r], *plain, t)        # lesser of each and the step before
    assert ctl.verify_cost[1][1] == pytest.approx(0.8 * (0.8 * 1.04 + 0.2 * 1.2) + 0.2 * 1.2)


def test_a_burst_of_slow_plain_steps_leaves_plain_decode_alone():
    """Settled plain steps more than _PLAIN_BURST x the estimate are left out (``_disturbed``): a
    burst of slow steps (4.1, 6.4, 14.8, 4.4 ms among 3.0-3.3 at a batch of 16: the machine's)
    raised t_verify(B, 1) by 40 % through the medians of three and "auto" drafted chains of 4 for
    73 steps where plain decode was 1.2x faster (stop 105). _PLAIN_BURST_STEPS of them in a row
    are plain decode getting dearer: from then on they are averaged in."""
    assert (adaptive._PLAIN_BURST, _PLAIN_BURST_STEPS) == (1.25, 8)
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost = {1: {1: 1.0}}
    r = _Req()
    plain = (DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0)
    for t in (1.0,) * 6 + (1.3, 2.0, 4.9, 1.4, 1.2) + (1.0,) * 4:
        ctl.observe([r], *plain, t)
        assert ctl.verify_cost[1][1] <= 1.05, t   # (the medians of its tail: 1.2, within the bound)
    before = ctl.verify_cost[1][1]
    for i in range(_PLAIN_BURST_STEPS + 4):   # plain decode 1.6x dearer from here on
        ctl.observe([r], *plain, 1.6)
        moved = ctl.verify_cost[1][1] > before + 1e-9
        assert moved == (i >= _PLAIN_BURST_STEPS), i   # (the first: a median with the 1.0s)
    assert ctl.verify_cost[1][1] > 1.25


def test_context_fit_recovers_the_shared_slope():
    """Verify time against the batch's context: one line per size, a shared slope, fitted within
    sizes (a size measured at one context alone says nothing about the slope); no spread, or a
    falling line, gives no slope."""
    from leapfrog.spec_decode.adaptive import _ContextFit
    fit = _ContextFit()
    for x in range(100, 400, 10):
        fit.add(1, 5000.0, 9.0)                     # plain decode at one context only
        fit.add(3, float(x), 1.2 + 1e-3 * x)
        fit.add(5, float(x + 7), 1.6 + 1e-3 * (x + 7))
    assert fit.slope() == pytest.approx(1e-3)
    for x in (4099.0, 9876.5):   # one context: the sums' cancellation leaves rounding (a slope of
        flat = _ContextFit()     # 244 us a token at 4099, when any positive spread counted)
        for i in range(40):
            flat.add(3, x, 1.0 + 1e-3 * (i % 3))
        assert flat.slope() == 0.0
    falling = _ContextFit()
    for x in range(100, 400, 10):
        falling.add(3, float(x), 2.0 - 1e-3 * x)
    assert falling.slope() == 0.0


def test_context_fit_needs_contexts_spread_by_a_tenth_of_their_mean():
    """Timing noise is no slope: the probe steps of a batch of 32 (contexts 2159-2383, 89.7 ms
    after 85.8 and 100.3) fitted 0.13 ms a token after two, 0.016 after three, and plain decode
    moved along it read 132 ms a step against 26 measured. With the verify times' spread required, no slope until the contexts
    spread by a tenth of their mean; then the line's slope as before."""
    from leapfrog.spec_decode.adaptive import _CONTEXT_SPREAD, _ContextFit
    noisy = [(2159.0, 85.8e-3), (2270.0, 100.3e-3), (2383.0, 89.7e-3)]
    loose, spread = _ContextFit(), _ContextFit(min_spread=_CONTEXT_SPREAD)
    for x, t in noisy:
        loose.add(5, x, t)
        spread.add(5, x, t)
    assert loose.slope() > 1e-5 and spread.slope() == 0.0
    line = _ContextFit(min_spread=_CONTEXT_SPREAD)   # a true slope of 2 us a token, without noise
    for i in range(20):   # the contexts grow 118 tokens a step from 2159: a tenth of their mean by the 8th
        line.add(5, 2159.0 + 118 * i, 80e-3 + 2e-6 * (2159 + 118 * i))
        assert line.slope() == (pytest.approx(2e-6) if i >= 7 else 0.0)


def test_verify_costs_move_no_steeper_than_in_proportion_to_the_context():
    """However steep the fitted growth, a measured time moves to another context at most in
    proportion to it (as if attention were the whole step): plain decode measured at 26 ms at a
    context of 2011 reads at most 26 x 3100 / 2011 at 3100."""
    ctl = SpecController(CFG, 4096)
    ctl.verify_cost = {32: {1: 26e-3, 5: 90e-3}}
    ctl.verify_context = {32: {1: 2011.0, 5: 2270.0}}
    fit = _ContextFit()
    for i in range(10):
        fit.add(5, 2000.0 + 100 * i, math.log(60e-3 + 1.3e-4 * 100 * i))   # 0.13 ms a token: x 1.2 per 100
    ctl.context_fit = {32: fit}
    ctl.context = 3100.0
    table = ctl._verify_table(32)
    assert table[1] == pytest.approx(26e-3 * 3100 / 2011)
    assert table[5] == pytest.approx(90e-3 * 3100 / 2270)


def test_verify_costs_are_compared_at_the_current_context():
    """A step's time grows with the batch's context (attention reads every sequence's keys and
    values). Plain decode measured near the end of long requests (context 1000) must not look as
    dear at the start of the next ones (context 100-400), nor a size measured early look cheap
    later: each measured time moves to the context of the step being chosen by the growth
    fitted within sizes. Measured as is, plain decode (2.0) made a tree of 2 (1.5 expected tokens
    for 1.58) look 1.9x better than none; at context 400 none costs 1.32, and none wins."""
    ctl, r = SpecController(CFG, 4096), _Req()

    def reqs(ctx: int) -> list[_Req]:
        r.num_computed = ctx
        return [r]

    plain = (DraftBatch.empty(1), AcceptanceResult([0], [[0]], [0]), 0.0)
    for _ in range(_PLAIN_FIRST):
        ctl.choose(reqs(1000))
        ctl.observe(reqs(1000), *plain, 2.0 ** (1000 / 1000))   # every size doubles per 1000 tokens
    for ctx in range(100, 401, 10):   # a tree of 2 nodes: 3 tokens verified
        ctl.choose(reqs(ctx))
        drafts = DraftBatch(torch.zeros(2, dtype=torch.long), [2], None, torch.full((2,), -1), [[0.5, 0.2]])
        ctl.observe(reqs(ctx), drafts, AcceptanceResult([0], [[0]], [2]), 0.1, 1.2 * 2.0 ** (ctx / 1000))
    assert ctl.verify_cost[1][1] == 2.0    # as measured
    ctl.choose(reqs(400))
    table = ctl._verify_table(1)
    assert table[1] == pytest.approx(2.0 ** 0.4, rel=0.02) and table[3] == pytest.approx(1.2 * 2.0 ** 0.4, rel=0.02)
    ctl.choose(reqs(1000))
    assert ctl._verify_table(1)[1] == pytest.approx(2.0, rel=0.02)
    # a step shared with other proposers' requests (predictions): the whole forward's context
    ctl.choose(reqs(100), batch_size=2, context=1000.0)
    assert ctl.context == 1000.0


def test_larger_sizes_grow_with_the_context_in_proportion_to_their_time():
    """Attention works for every verified token, so a size's time grows with the context in
    proportion to it, not by the same time as plain decode's. A batch of 16 at T = 0.7 (35 to
    160 tokens a sequence): plain decode grew 2.5 us a token of context, five tokens a sequence
    7.6, at three times the time; moved along plain decode's growth in time, the five tokens
    measured early looked 20 % cheaper two thousand tokens later, and "auto" turned speculation
    back on where it lost. Here plain decode is measured along the way (5 ms at a context of
    560, x 1.5 by 1560) and 5 tokens a sequence once at 816: at 1800 they still cost 3x plain."""
    ctl = SpecController(CFG, 4096)
    t1 = lambda x: 5e-3 * 1.5 ** ((x - 560) / 1000)   # noqa: E731
    fit = _ContextFit(min_spread=0.1)
    for x in range(560, 1561, 100):
        fit.add(1, x, math.log(t1(x)))
    ctl.verify_cost = {16: {1: t1(1560), 5: 3 * t1(816)}}
    ctl.verify_context = {16: {1: 1560.0, 5: 816.0}}
    ctl.context_fit = {16: fit}
    ctl.context = 1800.0
    table = ctl._verify_table(16)
    assert table[1] == pytest.approx(t1(1800), rel=1e-6)
    assert table[5] == pytest.approx(3 * t1(1800), rel=1e-6)
    additive = 3 * t1(816) + (t1(1560) - t1(560)) / 1000 * (1800 - 816)   # the shared slope in time
    assert additive < 0.85 * table[5]


def test_speculation_must_beat_none_by_the_margin():
    """What the step model leaves out costs speculation (the drafter's prefill, requests finishing
    apart), so speculation is chosen only where
    it is estimated _SPEC_MARGIN times none's goodput: a chain estimated 1.01x none is not drafted
    (at a batch of 32, T = 0.7, sizes estimated 1.07x none ran 0.94x), one estimated 1.08x is."""
    from leapfrog.spec_decode.adaptive import _SPEC_MARGIN
    assert 1.01 < _SPEC_MARGIN < 1.08

    for alpha, chosen in ((0.26, 0), (0.35, 1)):   # the chain of 1: 1.26 / 1.25 = 1.01x, 1.35 / 1.25 = 1.08x
        ctl = SpecController(CFG, 4096)
        _measured(ctl, {1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0}, _bucket(1, sampled=True))
        ctl.sampled = True   # (alpha: the sampled batches')
        ctl.alpha = alpha
        assert ctl.choose([_Sampled()]) == [chosen]


def test_a_tree_wider_than_any_measured_is_as_much_dearer_as_where_it_was_measured():
    """A shape wider than any measured at a batch size borrows a narrower one's drafting time scaled
    by how much dearer such a shape measured than borrowed at the nearest batch size that measured
    both: at face value, a tree of 11 nodes (10 levels, 2 wide) looked as cheap as the chain of 10
    at a batch of 16, and drafted 4 steps at 22 ms against the chain's 8."""
    ctl = SpecController(CFG, 4096)
    chains16 = {(n, 1): 2.0 + 0.5 * n for n in range(1, 5)}
    ctl.tree_draft_cost = {16: dict(chains16)}
    assert ctl._widening(16, (4, 2)) == 1.0   # nothing to go by: tried at the chain's cost
    ctl.tree_draft_cost[1] = {(2, 1): 0.5, (4, 1): 1.0, (4, 2): 3.5}
    ctl.tree_draft_cost[32] = {(4, 1): 6.0, (4, 4): 30.0}
    assert ctl._widening(16, (4, 2)) == 1.0   # first samples (cold, the prompt's catch-up) are not gone by
    ctl.draft_samples = {(b, lw): 2 for b, costs in ctl.tree_draft_cost.items() for lw in costs}
    assert ctl._widening(16, (4, 2)) == pytest.approx(3.5)   # (32 is nearer, but measured wider)
    assert ctl._widening(16, (4, 4)) == pytest.approx(5.0)   # only 32 measured 4 wide
    assert ctl._widening(8, (3, 2)) == pytest.approx(3.5)
    del ctl.tree_draft_cost[32]   # 4 wide measured nowhere: at least as dear as 2 wide, relative to a chain
    assert ctl._widening(16, (4, 4)) == pytest.approx(3.5)
    ctl.tree_draft_cost[32] = {(4, 1): 6.0, (4, 4): 30.0}
    # in the weighing: with a confident sibling at the first level, the 5-node tree (4 levels, 2 wide)
    # was picked at the chain of 4's drafting cost; at 3.5x it is not
    reqs = [_Req() for _ in range(16)]
    conf = [0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4] + [0.01] * 56
    for _ in range(8):
        ctl.confidence.calibrate(16 * 4, ctl.confidence.observe([conf] * 16, [8] * 16, [4] * 16))
    ctl.verify_cost = {16: {1: 1.0, 5: 1.2, 9: 1.4}}
    ctl.host_cost = {16: 0.0}
    ctl.tree_draft_cost[16] = {(n, 1): 0.05 * n for n in range(1, 5)}
    ctl.cfg = CFG.__class__(**{**CFG.__dict__, "adaptive_explore_interval": 1000})
    assert ctl.choose(reqs)[0] == 4
    del ctl.tree_draft_cost[1], ctl.tree_draft_cost[32]
    ctl._weighed.clear()
    assert ctl.choose(reqs)[0] > 4


def test_a_chain_explored_after_longer_ones_is_costed_at_its_own_catch_up():
    """A step's drafting starts with the head catching up on what the last step committed: a chain
    of 2 drafted after chains of 4 pays for their acceptance. Its time is moved along the fitted
    slope to what the chain of 2 itself commits, so an explored short chain does not look dearer
    than it runs (nor a longer one cheaper)."""
    class R(_Req):
        def __init__(self, i):
            self.request_id = f"r{i}"

    def t_draft(levels, caught):   # seconds: a forward per level, plus 0.05 per token caught up on
        return 1.0 + 0.1 * levels + 0.05 * caught

    ctl = SpecController(CFG, 4096)
    reqs = [R(0), R(1)]
    last = None
    conf = [0.9, 0.8, 0.7, 0.6] + [0.01] * 60

    def step(levels, accepted, chosen=None):
        nonlocal last
        ctl.last_k = chosen or levels   # (as choose sets it)
        drafts = DraftBatch(torch.zeros(2 * levels, dtype=torch.long), [levels] * 2, None,
                            torch.tensor(list(range(-1, levels - 1)) * 2), [conf, conf])
        caught = 2 * 4 if last is None else sum(1 + a for a in last)
        ctl.observe(reqs, drafts, AcceptanceResult(list(accepted), [[0] * (a + 1) for a in accepted], [levels] * 2),
                    t_draft(levels, caught), 1.0)
        last = accepted

    for acc in [(4, 2), (3, 3), (4, 4), (2, 3)] * 3:   # the chain of 4, commits varying
        step(4, acc)
    for acc in [(2, 1), (1, 1), (2, 2)] * 3:            # the chain of 2 step after step: about 2.7 committed a sequence
        step(2, acc)
    steady = ctl.tree_draft_cost[2][(2, 1)]
    assert ctl.catch_up_fit[2].slope() == pytest.approx(0.05, rel=0.05)
    for _ in range(3):
        step(4, (4, 4))
    step(2, (2, 2))                                     # explored after the chain of 4: caught up on 10 tokens
    assert t_draft(2, 10) > t_draft(2, 2 * 2.7) + 0.2
    assert ctl.tree_draft_cost[2][(2, 1)] == pytest.approx(steady, abs=0.02)
    sums, tokens = {k: list(v) for k, v in ctl.catch_up_fit[2].sums.items()}, dict(ctl.chain_tokens)
    step(2, (1, 1), chosen=4)   # the chain of 4 chosen, cut short at 2 levels (the stop confidence): out of the fit
    assert ctl.catch_up_fit[2].sums == sums and ctl.chain_tokens == tokens
    ctl.observe(reqs, DraftBatch.empty(2), AcceptanceResult([0, 0], [[0], [0]], [0, 0]), 0.0, 1.0)
    assert ctl.committed == {"r0": 3, "r1": 3}   # a plain step: the next catch-up also covers its token
    last = (2, 2)   # (this helper's tokens caught up on: the 2 x 3)
    weight = ctl.catch_up_fit[2].sums[4][0]
    step(4, (4, 4))
    assert ctl.catch_up_fit[2].sums[4][0] > weight   # in the fit, at 6 tokens
    assert ctl.catch_up_fit[2].slope() == pytest.approx(0.05, rel=0.05)
    ctl.observe_rounds(2, 8, 0.1, size=0, committed={"r0": 0, "r1": 0})   # multi-step decode: 8 tokens each
    assert ctl.committed == {"r0": 13, "r1": 13}
    ctl.observe_rounds(2, 3, 0.1, size=4, committed={"r0": 2, "r1": 5})   # rounds: the last round's tokens
    assert ctl.committed == {"r0": 2, "r1": 5}
    ctl.observe_rounds(2, 8, 0.1, size=0)   # (not told: none known)
    assert ctl.committed == {}


def test_switching_speculation_on_pays_for_the_drafters_catch_up():
    """While speculation is off, the first drafting step catches the drafter up on every token
    since it last drafted: the weighing charges that, at the fitted catch-up slope, spread over the
    steps the requests have left (at least an exploration interval). The chain of 1 estimated
    1.16x none is drafted while on, and from off with 100 tokens to catch up on when the requests
    have 999 tokens left, not when they have 39 (0.05 s x 98.5 tokens over 27 steps: 1.01x)."""
    from leapfrog.spec_decode.adaptive import _ContextFit

    def chosen(off: bool, max_tokens: int) -> int:
        ctl = SpecController(CFG, 4096)
        S = _bucket(1, sampled=True)
        _measured(ctl, {1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0}, S)
        ctl.sampled = True   # (alpha: the sampled batches')
        ctl.alpha = 0.45   # the chain of 1: 1.45 tokens for 1.25, 1.16x none
        fit = ctl.catch_up_fit[S] = _ContextFit()
        for x in range(2, 12):
            fit.add(1, float(x), 0.2 + 0.05 * x)
        req = _Sampled()
        req.max_tokens = max_tokens
        ctl.committed = {req.request_id: 100}
        if off:
            ctl.best[S] = 0
        return ctl.choose([req])[0]

    assert chosen(off=False, max_tokens=40) == 1
    assert chosen(off=True, max_tokens=1000) == 1
    assert chosen(off=True, max_tokens=40) == 0


def test_while_off_the_size_up_is_explored_less_often_at_larger_batches():
    """While speculation is off at a batch size, the size up is explored every 2 x bucket
    exploration intervals (every 2 at a batch of 1, as while drafting; every 32 at a batch of 16):
    that step first catches the drafter up on every token since it last drafted, B per step."""
    interval = CFG.adaptive_explore_interval
    gp = {0: 1.0, 1: 0.9, 2: 0.8}.__getitem__

    def explored(bucket: int, intervals: int) -> list[int]:
        ctl = SpecController(CFG, 4096)
        ctl.probe_wait[bucket] = 10 ** 9   # (no probe due)
        out = []
        for n in range(1, intervals + 1):
            ctl.steps = n * interval
            if ctl._explore(bucket, 0, gp, 1, 0, 1) == 1:
                out.append(n)
        return out

    assert explored(1, 8) == [1, 3, 5, 7]
    assert explored(16, 64) == [1, 33]
    ctl = SpecController(CFG, 4096)   # drafting: the neighbours every interval, whatever the batch
    ctl.steps = 2 * interval
    assert ctl._explore(16, 2, gp, 3, 1, 1) == 1


class _Live(_Req):
    """A request whose context grows with what it commits (the leased steps' contexts follow it)."""
    max_tokens = 10 ** 6

    def __init__(self):
        super().__init__()
        self.num_computed = 64
        self.output_ids = [1]


def _drive(cfg: SpeculativeConfig, leasing: bool, steps: int = 700, B: int = 2,
           per_token: float = 0.6, accepted: int = 1, best: dict[int, int] | None = None
           ) -> tuple[SpecController, list[int], int]:
    """``steps`` steps of a batch of B where drafting does not pay (verifying costs ``per_token`` a
    token more, drafting half that, ``accepted`` of the drafter's candidates accepted), run as the
    engine runs them: leased steps
    (``leasing``) without ``choose``, their times to ``lease_step``; else every step chosen and
    observed; ``best``: the controller's best sizes at other batch sizes to start from. -> the
    controller, the size of every step, the steps ``choose`` was asked."""
    ctl = SpecController(cfg, 10 ** 6)
    ctl.best.update(best or {})
    batch = [_Live() for _ in range(B)]
    for i, r in enumerate(batch):
        r.request_id = f"r{i}"   # (the same in every drive)
    conf = [0.9 ** (i // 4 + 1) for i in range(64)]
    sizes, asked = [], 0
    for step in range(steps):
        t_plain = 1.0 + 1e-4 * sum(r.num_computed for r in batch) + 0.05 * (step % 7)   # (context, jitter)
        if leasing and ctl.leased(batch):
            k = 0
            ctl.lease_step(t_plain, (t_plain + 0.1) - t_plain)   # (as observe takes it from t_step)
        else:
            asked += 1
            k = ctl.choose(batch)[0]
            if k:
                drafts = DraftBatch(torch.zeros(B * k, dtype=torch.long), [k] * B, None, None, [conf[:k]] * B)
                result = AcceptanceResult([min(k, accepted)] * B, [[0] * (1 + min(k, accepted))] * B, [k] * B)
                ctl.observe(batch, drafts, result, 0.5 * per_token * k, t_plain + per_token * k,
                            t_step=t_plain + 1.5 * per_token * k + 0.2)
            else:
                ctl.observe(batch, DraftBatch.empty(B), AcceptanceResult([0] * B, [[0]] * B, [0] * B), 0.0,
                            t_plain, t_step=t_plain + 0.1)
        sizes.append(k)
        for r in batch:
            n = 1 + min(k, accepted)
            r.num_computed += n
            r.output_ids = r.output_ids + [0] * n
    return ctl, sizes, asked


def _state(ctl: SpecController) -> tuple:
    return (ctl.verify_cost, ctl.verify_context, {b: f.sums for b, f in ctl.context_fit.items()}, ctl.plain_host,
            ctl.host_cost, ctl.observations, ctl.steps, dict(ctl.off_steps), ctl.probe_wait, ctl.best,
            ctl.committed, ctl.context, {b: (w.at, w.best, w.goodput) for b, w in ctl._weighed.items()},
            ctl._plain_run)


@pytest.mark.parametrize("extra, per_token, accepted, explore, B", [
    ({}, 0.6, 1, False, 2), ({}, 0.6, 1, True, 2), ({}, 0.21, 2, False, 2),
    ({"disable_by_batch_size": 1}, 0.6, 1, False, 2),
    ({}, 0.6, 1, False, 1), ({}, 0.6, 1, True, 1)])
def test_leased_plain_steps_choose_and_measure_as_steps_chosen_one_by_one(extra, per_token, accepted, explore, B,
                                                                           monkeypatch):
    """Where the controller drafts nothing (no speculation weighed best at a batch size, or
    disable_by_batch_size), it promises the engine the next steps of the same batch that it would
    certainly choose no drafts for (a lease: no ``choose``, no ``observe``, 0.04 ms of a 3.9 ms
    plain step at a batch of 16), up to its next weighing, probe or exploration: the sizes chosen
    and everything measured are those of choosing and observing every step. Drafting that does
    not pay (and explored whatever its estimate, ``explore``), that goes on and off, and drafting
    turned off."""
    if explore:
        monkeypatch.setattr(adaptive, "_EXPLORE_MARGIN", 0.0)
    cfg = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 4, "eagle_topk": 4,
                                       "num_draft_tokens": "auto", "adaptive_explore_interval": 4, **extra})
    ref, ref_sizes, ref_asked = _drive(cfg, leasing=False, per_token=per_token, accepted=accepted, B=B)
    ctl, sizes, asked = _drive(cfg, leasing=True, per_token=per_token, accepted=accepted, B=B)
    assert not ctl.leased([]) and ctl._lease is None   # (a lease left open ends: its steps measured)
    assert sizes == ref_sizes and _state(ctl) == _state(ref)
    assert ref_asked == len(sizes)
    plain = sizes.count(0)
    if extra:
        assert plain == len(sizes) and asked < len(sizes) / 10
    elif accepted == 1:   # (off, but probed and explored: drafting steps end the leases; at a batch of
        # one exploration comes every 2 intervals while off)
        assert 0 < len(sizes) - plain < len(sizes) / (5 if explore else 10)
        assert asked < len(sizes) / (3 if explore and B == 1 else 4)
    else:   # (on and off: the plain stretches leased)
        assert len(sizes) / 4 < plain < len(sizes) * 3 / 4 and asked < len(sizes) - plain / 2


def test_at_a_batch_of_one_an_off_weighing_that_agrees_stands_longer():
    """At a batch of one, a weighing for no speculation that agrees with the last one doubles the
    wait for the next, up to _REWEIGH_OFF_SETTLED steps (and the lease up to it: with a head that
    accepted nothing, the built-in target at batch 1, "auto" had weighed, granted and ended a
    lease every 11 steps, 1.4 % of its time); at larger batches it stays _REWEIGH_OFF_STEPS. A
    drafting step in between (a probe) has the sizes weighed again from _REWEIGH_OFF_STEPS."""
    cfg = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 4, "eagle_topk": 4,
                                       "num_draft_tokens": "auto", "adaptive_explore_interval": 4})
    ctl, sizes, asked = _drive(cfg, leasing=True, per_token=0.6, accepted=1, B=1, steps=1000)
    assert len(sizes) - sizes.count(0) < len(sizes) / 10 and asked < len(sizes) / 8
    w = ctl._weighed[1]
    assert not w.best and w.wait == adaptive._REWEIGH_OFF_SETTLED
    ctl, sizes, asked2 = _drive(cfg, leasing=True, per_token=0.6, accepted=1, B=2, steps=1000)
    assert ctl._weighed[_bucket(2)].wait == _REWEIGH_OFF_STEPS and asked2 > asked
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 50.0, 2: 50.0, 3: 50.0, 4: 50.0})
    for _ in range(3):
        ctl.confidence.calibrate(1.7, ctl.confidence.observe([[0.9, 0.8, 0.3, 0.2]], [2]))
    assert ctl.choose([_Req()]) == [0] and ctl._weighed[1].wait == _REWEIGH_OFF_STEPS
    for n in (2, 4, 4):
        ctl.observations += ctl._weighed[1].wait
        assert ctl.choose([_Req()]) == [0] and ctl._weighed[1].wait == min(n * _REWEIGH_OFF_STEPS,
                                                                             adaptive._REWEIGH_OFF_SETTLED)
    _step(ctl, 2, [0.9, 0.8, 0.3, 0.2], 0, 0.2, 1.0)   # a drafting step: weighed again, from the start
    assert 1 not in ctl._weighed
    ctl.tree_draft_cost[1] = {(n, 1): 50.0 for n in range(1, 5)}
    assert ctl.choose([_Req()]) == [0] and not ctl._weighed[1].best
    ctl.observe_rounds(1, 2, 0.5, size=4)               # drafts run as rounds (multi-step decode): the same
    assert 1 not in ctl._weighed


def test_leases_where_no_speculation_is_inherited_choose_as_steps_chosen_one_by_one():
    """A batch size that inherits no speculation from a smaller one (``_inherits_off``) leases
    its plain steps up to its first probe (its sizes up and down are none: no exploration cuts
    a lease), and the sizes and measurements are those of steps chosen one by one."""
    cfg = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 4, "eagle_topk": 4,
                                       "num_draft_tokens": "auto", "adaptive_explore_interval": 4})
    ref, ref_sizes, _ = _drive(cfg, leasing=False, steps=300, B=4, best={1: 0})
    ctl, sizes, asked = _drive(cfg, leasing=True, steps=300, B=4, best={1: 0})
    assert not ctl.leased([]) and sizes == ref_sizes and _state(ctl) == _state(ref)
    first = next(i for i, k in enumerate(sizes) if k)   # (the first probe ends the inheritance)
    assert first >= 8 * 4 * 4 and asked < 300 - first + first / 8


def test_a_lease_ends_when_the_batch_changes():
    """A leased step is one of the very requests the lease was promised for: another batch (a
    request finished or joined) is chosen for, after the leased steps that ran are measured."""
    cfg = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 4, "eagle_topk": 4,
                                       "num_draft_tokens": "auto", "disable_by_batch_size": 1})
    ctl = SpecController(cfg, 4096)
    batch = [_Live(), _Live()]
    assert ctl.choose(batch) == [0, 0]
    ctl.observe(batch, DraftBatch.empty(2), AcceptanceResult([0, 0], [[0], [0]], [0, 0]), 0.0, 1.0, t_step=1.5)
    assert ctl.leased(batch) and ctl.leased(list(batch))
    ctl.lease_step(2.0, 0.5)
    assert not ctl.leased(batch[:1]) and not ctl.leased(batch)   # ended: measured, and chosen for again
    assert ctl.observations == 2 and ctl.steps == 2 and ctl.plain_host[2] == pytest.approx(0.5)


def test_the_smallest_size_near_the_best_runs(monkeypatch):
    """Of sizes estimated within _SIZE_MARGIN of the best, the smallest runs (what the step model
    leaves out grows with the drafts: a longer chain spreads the sequences' lengths, and a static
    batch ends in a longer tail); no speculation only where it weighs best (its own margin
    applied)."""
    assert adaptive._SIZE_MARGIN == 0.97
    assert shortest_near_best([1.0, 1.5, 1.95, 2.0, 1.99]) == 2
    assert shortest_near_best([1.0, 1.5, 1.9, 2.0, 1.99]) == 3
    assert shortest_near_best([1.0, 2.0, 1.99, 1.98]) == 1
    assert shortest_near_best([2.1, 1.5, 2.05]) == 0
    assert shortest_near_best([1.0, 1.5, 1.95, 2.0, 1.99], 1.0) == 3
    # the weighing runs it from a batch of 2 (a batch of 1 has no lengths to spread): with every
    # size near enough, the smallest tree is verified
    conf = [0.9 ** (i // 4 + 1) for i in range(64)]
    monkeypatch.setattr(adaptive, "_SIZE_MARGIN", 0.0)
    assert min(_converge(0.01, conf, lambda n: min(n, 4))[-20:]) >= 12
    ctl = SpecController(CFG, 4096)
    _measured(ctl, {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}, bucket=2)
    for _ in range(3):
        ctl.confidence.calibrate(3.0, ctl.confidence.observe([[0.95, 0.9, 0.85, 0.8]], [4]))
    assert ctl.choose([_Req(), _Req()]) == [1, 1]
    monkeypatch.setattr(adaptive, "_SIZE_MARGIN", 1.0)
    ctl._weighed.clear()
    assert ctl.choose([_Req(), _Req()])[0] > 1
