"""SuffixDecoding: the suffix structures against brute force, the global cache's eviction, and the
proposer through the engine (greedy equality, the sampling law, metrics)."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError
from leapfrog.spec_decode.proposers.suffix import SuffixCache
from leapfrog.spec_decode.proposers.suffix_tree import SuffixTree, expand, local_root, spec_length
from tests.conftest import greedy_baseline
from tests.spec_decode.test_sampling_lossless import SETTINGS, assert_follows_target


def brute_count(seqs: list[list[int]], path: list[int], depth: int) -> int:
    """How many depth-capped suffixes of seqs start with path."""
    n = 0
    for s in seqs:
        for i in range(len(s)):
            suf = s[i:i + depth]
            n += suf[:len(path)] == path
    return n


def path_count(tree: SuffixTree, path: list[int]) -> int:
    cur = tree._find(path, 0)
    return 0 if cur is None else cur.count


seqs_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(seqs_st, st.integers(2, 6), st.data())
def test_suffix_tree_counts_match_brute_force(seqs, depth, data):
    tree = SuffixTree(depth)
    for s in seqs:
        tree.insert(array("i", s))
    for _ in range(10):
        path = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=depth))
        assert path_count(tree, path) == brute_count(seqs, path, depth)
    # removing some sequences leaves exactly the tree of the others
    k = data.draw(st.integers(0, len(seqs)))
    for s in seqs[:k]:
        tree.remove(array("i", s))
    rest = seqs[k:]
    for _ in range(10):
        path = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=depth))
        assert path_count(tree, path) == brute_count(rest, path, depth)
    if not rest:
        assert tree.num_nodes == 0 and tree.root.count == 0 and not tree.root.children


def test_docstring_example():
    tree = SuffixTree(4)
    tree.insert(array("i", [0, 1, 2, 0, 1, 3]))   # a b c a b d
    tree.insert(array("i", [0, 1, 2]))            # a b c
    cur = tree.match([9, 0, 1])
    assert cur.match_len == 2 and cur.count == 3
    out = expand(cur, 10, 0.1)
    assert out.token_ids[:2] == [2, 3] and out.parents[:2] == [-1, -1]
    assert out.probs[:2] == pytest.approx([2 / 3, 1 / 3])
    assert out.token_ids[2] == 0 and out.parents[2] == 0 and out.probs[2] == pytest.approx(1 / 3)


def test_match_prefers_the_longest_suffix():
    tree = SuffixTree(8)
    tree.insert(array("i", [5, 1, 2, 7, 9, 2, 8]))
    cur = tree.match([4, 1, 2])
    assert cur.match_len == 2 and [t for t, _, _ in cur.children()] == [7]
    cur = tree.match([4, 6, 2])   # only "2" matches: two continuations
    assert cur.match_len == 1 and sorted(t for t, _, _ in cur.children()) == [7, 8]
    assert tree.match([4, 6, 3]) is None


def test_local_root_and_expand():
    ctx = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3])
    root = local_root(ctx, 10)
    assert root.match_len == 3 and sorted(root.starts.tolist()) == [3, 8]
    out = expand(root, 8, 0.0)
    assert sorted(out.token_ids[:2]) == [4, 5] and out.parents[:2] == [-1, -1]
    # parents before children, siblings distinct
    for j, p in enumerate(out.parents):
        assert p < j
    kids = {}
    for j, p in enumerate(out.parents):
        kids.setdefault(p, []).append(out.token_ids[j])
    assert all(len(v) == len(set(v)) for v in kids.values())
    assert expand(root, 8, 0.0, max_depth=1).token_ids == out.token_ids[:2]
    assert expand(root, 8, 0.6).token_ids == []     # each branch has probability 1/2
    assert local_root(np.array([1, 2, 3]), 5) is None


def test_spec_length():
    assert spec_length(3, 24, 1.0, 0.0) == 3
    assert spec_length(30, 24, 1.0, 0.0) == 24
    assert spec_length(2, 24, 0.5, 1.0) == 2
    assert spec_length(0, 24, 1.0, 0.0) == 0


def test_cache_evicts_oldest_and_bounds_memory():
    cache = SuffixCache(max_depth=4, max_requests=2)
    cache.add("a", [1, 2, 3])
    cache.add("b", [4, 5, 6])
    cache.add("c", [7, 8, 9])
    assert list(cache.seqs) == ["b", "c"] and cache.evictions == 1
    assert cache.tree.match([1, 2]) is None and cache.tree.match([4, 5]) is not None
    fresh = SuffixTree(4)
    fresh.insert([4, 5, 6])
    fresh.insert([7, 8, 9])
    assert cache.tree.num_nodes == fresh.num_nodes
    s = cache.stats()
    assert s["requests"] == 2 and s["tokens"] == 6 and s["bytes"] > 0
    off = SuffixCache(max_depth=4, max_requests=0)
    off.add("a", [1, 2, 3])
    assert off.stats()["requests"] == 0 and off.tree.num_nodes == 0


MAX = 48


@pytest.fixture(scope="module")
def baseline(llama_dir, tokenizer):
    _, prompts, outs = greedy_baseline(llama_dir, tokenizer, 6, MAX)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k, bs, factor", [(24, 1, 1.0), (8, 3, 4.0), (3, 6, 1.0)])
def test_suffix_greedy_equal_and_global_cache_helps(llama_dir, baseline, k, bs, factor):
    prompts, ref = baseline
    spec = {"method": "suffix", "num_speculative_tokens": k, "max_spec_factor": factor}
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=spec)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:bs]], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == ref[:bs]
    # the same prompts again: the global tree now holds their outputs, drafts are long and right
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[:bs]], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == ref[:bs]
    spec_first = sum(o.metrics.spec.num_accepted_tokens for o in first)
    spec_again = sum(o.metrics.spec.num_accepted_tokens for o in again)
    assert spec_again > spec_first and spec_again >= 0.5 * bs * MAX
    assert llm.engine.proposer.stats()["requests"] == 2 * bs


def test_suffix_sampling_follows_target(tiny):
    """Siblings at depth 1 (max_spec_offset lets a 1-token match draft several): recursive rejection
    sampling over point-mass siblings keeps tokens 2 and 3 on the target's law."""
    target, _ = tiny
    spec = {"method": "suffix", "num_speculative_tokens": 4, "max_spec_offset": 4, "min_token_prob": 0.05}
    m = assert_follows_target(target, spec, SETTINGS[0], seed=7)
    assert m["num_draft_tokens"] > m["num_drafts"]   # more than one node per step: trees


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.spec_decode.test_sampling_lossless import SMALL
    from leapfrog.demo import save_random_llama
    return save_random_llama(tmp_path_factory.mktemp("tinys"), None, seed=3, **SMALL), None


@pytest.mark.parametrize("bad, why", [
    ({"suffix_cache_max_depth": 1}, "suffix_cache_max_depth"),
    ({"min_token_prob": 1.5}, "min_token_prob"),
    ({"suffix_cache_max_requests": -1}, "suffix_cache_max_requests"),
    ({"max_spec_factor": "x"}, "max_spec_factor"),
    ({"model": "x"}, "takes no 'model'"),
    ({"suffix_decoding_max_tree_depth": 8, "suffix_cache_max_depth": 8}, "same setting"),
])
def test_suffix_config_errors(bad, why):
    from leapfrog.spec_decode.config import SpeculativeConfig
    with pytest.raises(ConfigError, match=why):
        SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8, **bad})
    with pytest.raises(ConfigError, match="applies to method 'suffix' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 8, "min_token_prob": 0.2})
    cfg = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8,
                                       "suffix_decoding_max_tree_depth": 16})
    assert cfg.suffix_cache_max_depth == 16
