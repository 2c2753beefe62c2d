"""Tree verification (``spec_decode/verify/tree.py``): chains reduce to the chain verifiers,
hand-worked trees, and exact losslessness of recursive rejection sampling by chi-square tests
(fixed seeds, false-alarm rate 1e-3 per test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfrog.spec_decode.verify.greedy import greedy_accept
from leapfrog.spec_decode.verify.rejection import rejection_accept
from leapfrog.spec_decode.verify.tree import tree_match_accept, tree_rejection_accept
from tests.stats import chisq_pvalue

PROP = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def chains(num_draft: list[int]) -> list[int]:
    return [j for k in num_draft for j in range(-1, k - 1)]


def onehot(i: int, V: int = 6) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), V).float()


# --- chains: the tree functions are the chain functions -------------------------------------------

@PROP
@given(st.data())
def test_chain_match_equals_greedy_accept(data):
    num_draft = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    tok = st.integers(0, 2)   # a small alphabet, so that runs of matches happen
    drafts = data.draw(st.lists(tok, min_size=sum(num_draft), max_size=sum(num_draft)))
    target = data.draw(st.lists(tok, min_size=sum(num_draft) + len(num_draft),
                                max_size=sum(num_draft) + len(num_draft)))
    want = greedy_accept(target, drafts, num_draft)
    got = tree_match_accept(target, drafts, chains(num_draft), num_draft)
    assert got.num_accepted == want.num_accepted
    assert got.output_ids == want.output_ids
    assert got.num_draft == want.num_draft
    assert got.accepted_nodes == [list(range(n)) for n in want.num_accepted]


def random_probs(g: torch.Generator, n: int, V: int, sharp: bool) -> torch.Tensor:
    logits = torch.randn(n, V, generator=g) * (4.0 if sharp else 1.0)
    if sharp:   # exact zeros, one-hot rows and ties in the ratio p/q
        logits = logits.masked_fill(torch.rand(n, V, generator=g) < 0.4, float("-inf"))
        logits[:, 0] = logits[:, 0].clamp_min(0.0)   # keep a finite entry per row
    return torch.softmax(logits, -1)


@PROP
@given(num_draft=st.lists(st.integers(0, 5), min_size=1, max_size=4), V=st.integers(2, 7),
       seed=st.integers(0, 2**31), with_q=st.booleans(), sharp=st.booleans())
def test_chain_rejection_equals_rejection_accept(num_draft, V, seed, with_q, sharp):
    g = torch.Generator().manual_seed(seed)
    T, B = sum(num_draft), len(num_draft)
    p = random_probs(g, T + B, V, sharp)
    q = random_probs(g, T, V, sharp) if with_q else None
    drafts = torch.randint(0, V, (T,), generator=g)
    if q is not None:   # drafts the draft model could have drawn (q > 0)
        drafts = torch.multinomial(q, 1, generator=g)[:, 0] if T else drafts
    u = torch.rand(T, generator=g)
    p0, q0 = p.clone(), None if q is None else q.clone()
    want = rejection_accept(p, q, drafts, num_draft, u)
    got = tree_rejection_accept(p, q, drafts, chains(num_draft), num_draft, u)
    assert got.num_accepted == want.num_accepted
    assert got.accepted_nodes == [list(range(n)) for n in want.num_accepted]
    torch.testing.assert_close(got.final_probs, want.final_probs)
    assert torch.equal(p, p0) and (q is None or torch.equal(q, q0))   # pure


# --- hand-worked trees ----------------------------------------------------------------------------

def test_match_accepts_along_a_later_branch():
    # root -> 5 (node 0) | 7 (node 1); node 1 -> 8 (node 2) | 9 (node 3). Rows: root, n0, n1, n2, n3.
    r = tree_match_accept([7, 1, 9, 2, 4], [5, 7, 8, 9], [-1, -1, 1, 1], [4])
    assert r.num_accepted == [2] and r.accepted_nodes == [[1, 3]]
    assert r.output_ids == [[7, 9, 4]]   # bonus from node 3's row
    # the same, but node 1's row wants 6: stop after node 1, the correction comes from its row
    r = tree_match_accept([7, 1, 6, 2, 4], [5, 7, 8, 9], [-1, -1, 1, 1], [4])
    assert r.accepted_nodes == [[1]] and r.output_ids == [[7, 6]]


def test_match_stops_at_the_root():
    r = tree_match_accept([3, 5, 7, 8, 9], [5, 7, 8, 9], [-1, -1, 1, 1], [4])
    assert r.num_accepted == [0] and r.accepted_nodes == [[]] and r.output_ids == [[3]]


def test_match_ragged_batch():
    # request 0: the tree above; request 1: no drafts; request 2: root -> 1 (n0) -> 2 (n1) | 3 (n2);
    # request 3: a chain given as a tree; rows start at 0, 5, 6, 10
    drafts = [5, 7, 8, 9] + [] + [1, 2, 3] + [4, 4]
    parents = [-1, -1, 1, 1] + [] + [-1, 0, 0] + [-1, 0]
    target = ([5, 8, 0, 0, 0]      # accept node 0 (5); its row wants 8: node 0 has no children
              + [6]                # no drafts: the target's token
              + [1, 3, 0, 0]       # accept n0 (1), then n2 (3); n2's row: 0
              + [4, 4, 2])         # accept both, bonus 2
    r = tree_match_accept(target, drafts, parents, [4, 0, 3, 2])
    assert r.accepted_nodes == [[0], [], [0, 2], [0, 1]]
    assert r.num_accepted == [1, 0, 2, 2]
    assert r.output_ids == [[5, 8], [6], [1, 3, 0], [4, 4, 2]]
    assert r.accepted(2) == [0, 2]


def test_rejection_point_mass_siblings_by_hand():
    # root p = [.5, .3, .2, 0, 0, 0] with children 0 (node 0) and 1 (node 1); rows: root, n0, n1
    p = torch.stack([torch.tensor([0.5, 0.3, 0.2, 0, 0, 0]), onehot(4), onehot(5)])
    drafts, parents = torch.tensor([0, 1]), [-1, -1]
    # u0 = .6 >= .5 rejects token 0; p_2 = [0, .6, .4]; u1 = .55 < .6 accepts token 1 -> bonus row n1
    out = tree_rejection_accept(p, None, drafts, parents, [2], torch.tensor([0.6, 0.55]))
    assert out.accepted_nodes == [[1]] and out.num_accepted == [1]
    torch.testing.assert_close(out.final_probs[0], onehot(5))
    # u1 = .65 rejects token 1 too: final = [0, 0, 1]
    out = tree_rejection_accept(p, None, drafts, parents, [2], torch.tensor([0.6, 0.65]))
    assert out.accepted_nodes == [[]]
    torch.testing.assert_close(out.final_probs[0], onehot(2))
    # u0 = .4 accepts token 0 at once; node 1 is never tried
    out = tree_rejection_accept(p, None, drafts, parents, [2], torch.tensor([0.4, 0.99]))
    assert out.accepted_nodes == [[0]]
    torch.testing.assert_close(out.final_probs[0], onehot(4))


def test_rejection_with_q_siblings_by_hand():
    # q = [.5, .4, .1], p = [.2, .3, .5]; children 0 then 1 drawn without replacement from q.
    p = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0, 0], [0, 1.0, 0]])
    q = torch.tensor([[0.5, 0.4, 0.1], [0.5, 0.4, 0.1]])
    # x1 = 0: ratio .2/.5 = .4, u = .5 rejects; p_2 = norm(max(p - q, 0)) = [0, 0, .4] / .4 = [0, 0, 1];
    # x2 = 1: q_2 = [0, .8, .2], ratio p_2(1) / q_2(1) = 0 -> reject; p_3 = [0, 0, 1]
    out = tree_rejection_accept(p, q, torch.tensor([0, 1]), [-1, -1], [2], torch.tensor([0.5, 0.0]))
    assert out.accepted_nodes == [[]]
    torch.testing.assert_close(out.final_probs[0], torch.tensor([0.0, 0.0, 1.0]))
    # p = [.2, .5, .3]: p_2 = norm([0, .1, .2]) = [0, 1/3, 2/3]; q_2(1) = .8: ratio 5/12 ~ .417
    p2 = p.clone()
    p2[0] = torch.tensor([0.2, 0.5, 0.3])
    out = tree_rejection_accept(p2, q, torch.tensor([0, 1]), [-1, -1], [2], torch.tensor([0.5, 0.41]))
    assert out.accepted_nodes == [[1]]
    out = tree_rejection_accept(p2, q, torch.tensor([0, 1]), [-1, -1], [2], torch.tensor([0.5, 0.42]))
    assert out.accepted_nodes == [[]]
    # p_3 = norm(max(p_2 - q_2, 0)) = norm([0, 0, 2/3 - .2]) = [0, 0, 1]
    torch.testing.assert_close(out.final_probs[0], torch.tensor([0.0, 0.0, 1.0]))


def test_rejection_ragged_batch_and_no_drafts():
    V = 6
    p = torch.stack([onehot(3), onehot(2),              # request 0: one draft (token 3), accepted
                     torch.full((V,), 1 / V),            # request 1: no drafts, the root row
                     onehot(1), onehot(0), onehot(4)])   # request 2: root -> 5 | 1; accept node 1
    out = tree_rejection_accept(p, None, torch.tensor([3, 5, 1]), [-1, -1, -1], [1, 0, 2],
                                torch.tensor([0.9, 0.0, 0.9]))
    assert out.accepted_nodes == [[0], [], [1]]
    torch.testing.assert_close(out.final_probs, torch.stack([onehot(2), torch.full((V,), 1 / V), onehot(4)]))


# --- valid distributions on random trees ----------------------------------------------------------

def random_tree(g: torch.Generator, k: int, V: int) -> tuple[list[int], list[int]]:
    """parents (each before its children) and sibling-distinct tokens."""
    parents = [int(torch.randint(-1, j, (1,), generator=g)) if j else -1 for j in range(k)]
    perm = {par: torch.randperm(V, generator=g).tolist() for par in range(-1, k)}
    seen: dict[int, int] = {}
    tokens = []
    for par in parents:
        tokens.append(perm[par][seen.get(par, 0)])
        seen[par] = seen.get(par, 0) + 1
    return parents, tokens


@PROP
@given(num_draft=st.lists(st.integers(0, 7), min_size=1, max_size=3), seed=st.integers(0, 2**31),
       with_q=st.booleans(), sharp=st.booleans())
def test_final_probs_are_distributions_without_rejected_siblings(num_draft, seed, with_q, sharp):
    V = 8
    g = torch.Generator().manual_seed(seed)
    parents, tokens = [], []
    for k in num_draft:
        par, tok = random_tree(g, k, V)
        parents += par
        tokens += tok
    T, B = sum(num_draft), len(num_draft)
    p = random_probs(g, T + B, V, sharp)
    q = random_probs(g, T, V, sharp) if with_q else None
    u = torch.rand(T, generator=g)
    p0 = p.clone()
    out = tree_rejection_accept(p, q, torch.tensor(tokens, dtype=torch.long), parents, num_draft, u)
    assert torch.equal(p, p0)
    f = out.final_probs
    assert f.shape == (B, V) and bool((f >= 0).all())
    torch.testing.assert_close(f.sum(-1), torch.ones(B))
    o = 0
    for b, k in enumerate(num_draft):
        path = out.accepted_nodes[b]
        for a, c in zip([-1] + path, path):   # a path of parent -> child links
            assert parents[o + c] == a
        last = path[-1] if path else -1
        rejected = [tokens[o + j] for j in range(k) if parents[o + j] == last]
        # every child of the last node was tried and rejected: none keeps mass (q given: a rejected
        # x has p_i(x) < q_i(x), so max(p_i - q_i, 0) is 0 there, and later q_i are 0 there)
        assert float(f[b, rejected].sum()) == 0.0
        o += k


# --- exact losslessness ---------------------------------------------------------------------------

V = 6
N = 20000
# depth-2 tree: root -> 3 children; each child -> 2 children
PARENTS = [-1, -1, -1, 0, 0, 1, 1, 2, 2]
K = len(PARENTS)


def target_tables(g: torch.Generator, adversarial: bool):
    """p1 [V] at the root, p2 [V, V] after each first token, q1 [V], q2 [V, V] of the drafter.
    Adversarial: q puts most of its mass where p has little (p's top tokens 0, 1; q's 4, 5)."""
    if adversarial:
        lp = torch.tensor([0.45, 0.35, 0.1, 0.05, 0.03, 0.02]).log()
        lq = torch.tensor([0.01, 0.01, 0.03, 0.05, 0.3, 0.6]).log()
    else:
        lp, lq = torch.zeros(V), torch.zeros(V)
    noise = 0.3 if adversarial else 1.5
    p1, q1 = (torch.softmax(base + noise * torch.randn(V, generator=g), -1) for base in (lp, lq))
    p2, q2 = (torch.softmax(base + noise * torch.randn(V, V, generator=g), -1) for base in (lp, lq))
    return p1, p2, q1, q2


def draft_tokens(g: torch.Generator, q1: torch.Tensor, q2: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """[N, K] tokens of the tree per run: Gumbel-top-k (without replacement) from q1 at the root and
    from q2[token] under each child; or, point mass, q's top 3 (top 2) tokens, a fixed tree."""
    if not stochastic:
        first = q1.argsort(descending=True)[:3]
        second = q2[first].argsort(-1, descending=True)[:, :2]
        return torch.cat([first, second.flatten()]).expand(N, K)

    def top(logq: torch.Tensor, k: int) -> torch.Tensor:
        gumbel = -torch.log(-torch.log(torch.rand(logq.shape, generator=g).clamp_min(1e-12)))
        return (logq + gumbel).topk(k, -1).indices

    first = top(q1.log().expand(N, V), 3)                           # [N, 3]
    second = top(q2.log()[first], 2)                                # [N, 3, 2]
    return torch.cat([first, second.flatten(1)], 1)


def run_tree(p1, p2, q1, q2, stochastic: bool, seed: int):
    """N independent verifications of the depth-2 tree in one ragged batch -> (token1, token2,
    whether token1 was an accepted draft) [N] each, token2 drawn as the engine would next."""
    g = torch.Generator().manual_seed(seed)
    tok = draft_tokens(g, q1, q2, stochastic)                        # [N, K]
    p3 = torch.softmax(torch.randn(V, generator=g), -1)              # rows after depth-2 nodes
    rows = torch.cat([p1.expand(N, 1, V), p2[tok[:, :3]], p3.expand(N, 6, V)], 1)   # [N, K + 1, V]
    q = torch.cat([q1.expand(N, 3, V), q2[tok[:, :3]].repeat_interleave(2, 1)], 1)  # [N, K, V]
    out = tree_rejection_accept(rows.reshape(-1, V), q.reshape(-1, V) if stochastic else None,
                                tok.reshape(-1), PARENTS * N, [K] * N, torch.rand(N * K, generator=g))
    final = torch.multinomial(out.final_probs, 1, generator=g)[:, 0].tolist()
    tok_l = tok.tolist()
    emitted = [[tok_l[b][j] for j in path] + [final[b]] for b, path in enumerate(out.accepted_nodes)]
    t1 = [e[0] for e in emitted]
    # off the tree (only token1 emitted), the next step samples p2[token1] afresh
    fresh = torch.multinomial(p2[torch.tensor(t1)], 1, generator=g)[:, 0].tolist()
    t2 = [e[1] if len(e) > 1 else f for e, f in zip(emitted, fresh)]
    on_tree = [bool(path) for path in out.accepted_nodes]
    return np.array(t1), np.array(t2), np.array(on_tree), out


@pytest.mark.parametrize("stochastic", [False, True], ids=["point_mass", "without_replacement"])
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
def test_rrs_is_lossless(stochastic, adversarial):
    g = torch.Generator().manual_seed(7 + 2 * adversarial)
    p1, p2, q1, q2 = target_tables(g, adversarial)
    t1, t2, on_tree, out = run_tree(p1, p2, q1, q2, stochastic, seed=11 + stochastic + 2 * adversarial)
    # (i) the first token follows p1
    assert chisq_pvalue(np.bincount(t1, minlength=V), p1.double().numpy()) > 1e-3
    # the joint law of (token1, token2) is p1(a) p2(b | a)
    joint = (p1[:, None] * p2).double().flatten().numpy()
    assert chisq_pvalue(np.bincount(t1 * V + t2, minlength=V * V), joint) > 1e-3
    # (ii) given token1 = a was an accepted draft, the next token follows p2[a]
    tested = 0
    for a in range(V):
        sel = on_tree & (t1 == a)
        if sel.sum() >= 200:
            tested += 1
            assert chisq_pvalue(np.bincount(t2[sel], minlength=V), p2[a].double().numpy()) > 1e-3
    assert tested >= 1 and 0.02 < on_tree.mean() < 0.98   # not vacuous: both branches happen
    assert max(out.num_accepted) == 2                      # depth 2 was reached
