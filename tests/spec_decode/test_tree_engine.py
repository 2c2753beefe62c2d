"""Tree drafts through the whole engine: greedy output identical to no speculation (fp32) with
ragged trees whose correct path hides among wrong siblings, in batches with chain and zero-draft
requests; and with sampling, the law of the first tokens is the target's (chi-square against
exact enumeration) for branching trees of sibling drafts drawn without replacement from q and
of deterministic point-mass siblings."""

from __future__ import annotations

import random

import pytest
import torch

from leapfrog import SamplingParams
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.proposers.base import PROPOSERS, StatelessProposer
from tests.spec_decode.test_greedy_lossless import MAX, baseline, run  # noqa: F401
from tests.spec_decode.test_sampling_lossless import assert_follows_target, tiny  # noqa: F401


class TreeOracle(StatelessProposer):
    """Knows the greedy continuation. Per request and step it builds a random tree of up to k
    nodes: at each level a few wrong siblings around the right token (at a random index), the
    right branch continuing down to a random depth, wrong branches sometimes growing children."""

    def __init__(self, script, seed):
        self.script, self.rnd = script, random.Random(seed)

    def propose(self, reqs, ks):
        toks, parents, nums = [], [], []
        for r, k in zip(reqs, ks):
            cont = self.script[tuple(r.prompt_ids)][len(r.output_ids):]
            t, p = [], []
            depth, parent = 0, -1
            good_depth = self.rnd.randint(0, 5)   # how far down the right tokens go
            while len(t) < k and depth < len(cont):
                right = cont[depth] if depth < good_depth else (cont[depth] + 1) % 320
                sibs = {right} | {self.rnd.randrange(320) for _ in range(self.rnd.randint(0, 2))}
                order = sorted(sibs, key=lambda _: self.rnd.random())
                here = -1
                for x in order:
                    if len(t) == k:
                        break
                    t.append(x)
                    p.append(parent)
                    if x == right:
                        here = len(t) - 1
                    elif self.rnd.random() < 0.3 and len(t) < k:   # a wrong branch with a child
                        t.append(self.rnd.randrange(320))
                        p.append(len(t) - 2)
                if here < 0:
                    break
                parent, depth = here, depth + 1
            toks += t
            parents += p
            nums.append(len(t))
        return DraftBatch(torch.tensor(toks, dtype=torch.long), nums, None, torch.tensor(parents, dtype=torch.long))


@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("k", [4, 12])
def test_greedy_tree_equal(llama_dir, baseline, bs, k):  # noqa: F811
    prompts, ref, _ = baseline
    name = "tree_oracle_test"
    PROPOSERS[name] = lambda cfg, target: TreeOracle({tuple(p): r for p, r in zip(prompts, ref)}, seed=bs * k)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    llm, outs = run(llama_dir, {"method": name, "num_speculative_tokens": k}, prompts[:bs], sp)
    assert [o.outputs[0].token_ids for o in outs] == ref[:bs]
    m = llm.get_metrics()
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["mean_acceptance_length"] > 1.5
    # per-position counters count tree levels: never more accepted at a depth than drafted there
    assert len(m["num_accepted_tokens_per_pos"]) <= k


class TreeSampler(StatelessProposer):
    """Branching trees for sampling tests: at the root 3 siblings, under each 2, drawn without
    replacement (Gumbel top-k) from q = softmax(target logits / 2), flatter than p (or, with
    ``point_mass``, the deterministic top-3 / top-2 of q with q = None)."""

    def __init__(self, target, point_mass: bool):
        self.model, self.point_mass = target.model, point_mass

    def _q(self, seqs: list[list[int]]) -> torch.Tensor:
        """q [len(seqs), V] after each sequence (one forward per sequence length)."""
        out = [None] * len(seqs)
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_len.setdefault(len(s), []).append(i)
        for n, idx in by_len.items():
            x = torch.tensor([seqs[i] for i in idx])
            with torch.no_grad():
                h = self.model(x, torch.arange(n).expand_as(x)).hidden[:, -1]
                q = torch.softmax(self.model.compute_logits(h) * 0.5, -1)  # flatter than p
            for k, i in enumerate(idx):
                out[i] = q[k]
        return torch.stack(out)

    def _children(self, q, m, gen):
        if self.point_mass:
            return q.topk(m).indices.tolist()
        g = -torch.log(-torch.log(torch.rand(q.shape, generator=gen).clamp_min(1e-20)))
        return (q.log() + g).topk(m).indices.tolist()

    def propose(self, reqs, ks):
        q0 = self._q([r.all_ids for r in reqs])
        first = [self._children(q0[b], 3, r.generator) for b, r in enumerate(reqs)]
        q1 = self._q([r.all_ids + [x] for r, xs in zip(reqs, first) for x in xs]).view(len(reqs), 3, -1)
        toks, parents, qs, nums = [], [], [], []
        for b, r in enumerate(reqs):
            t, p, qq = list(first[b]), [-1] * 3, [q0[b]] * 3
            for j in range(3):
                for y in self._children(q1[b, j], 2, r.generator):
                    t.append(y), p.append(j), qq.append(q1[b, j])
            toks += t
            parents += p
            qs += qq
            nums.append(len(t))
        q = None if self.point_mass else torch.stack(qs)
        return DraftBatch(torch.tensor(toks), nums, q, torch.tensor(parents))


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
                                SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=3, ignore_eos=True)],
                         ids=["t1", "t07-topk-topp"])
def test_tree_sampling_follows_target(tiny, point_mass, sp):  # noqa: F811
    target, _ = tiny
    name = f"tree_sampler_test_{point_mass}"
    PROPOSERS[name] = lambda cfg, info: TreeSampler(info, point_mass)
    assert_follows_target(target, {"method": name, "num_speculative_tokens": 9}, sp, seed=7)
