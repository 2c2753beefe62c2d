"""Chunks of very different lengths (prompts prefilled together) run in several eager forwards of
similar lengths where padding them all to the longest costs more (model/runner.py
split_by_length): the same logits and hidden states, in the chunks' order, as one forward."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.runner import ModelRunner, SeqChunk, split_by_length


def _cost(lengths: list[int], groups: list[list[int]], forward_tokens: int) -> int:
    return sum(len(g) * max(lengths[i] for i in g) for g in groups) + forward_tokens * (len(groups) - 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=24), st.integers(0, 64))
def test_split_by_length_partitions_and_never_costs_more(lengths, forward_tokens):
    groups = split_by_length(lengths, forward_tokens)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g for g in groups)
    # longest first, within and across groups (runs of neighbours in length order)
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(lengths, reverse=True)
    assert _cost(lengths, groups, forward_tokens) <= _cost(lengths, [list(range(len(lengths)))], forward_tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(0, 40))
def test_split_by_length_is_the_cheapest_split_of_the_sorted_lengths(lengths, forward_tokens):
    """Against every split of the longest-first order into runs (brute force, n <= 8)."""
    from itertools import combinations
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    brute = min(_cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, n))], forward_tokens)
                for k in range(n) for cuts in combinations(range(1, n), k))
    assert _cost(lengths, split_by_length(lengths, forward_tokens), forward_tokens) == brute


def test_split_by_length_examples():
    assert split_by_length([5, 5, 5], 32) == [[0, 1, 2]]              # no padding: one forward
    assert split_by_length([6, 1, 1, 1], 32) == [[0, 1, 2, 3]]        # a verify step: not worth a forward
    assert split_by_length([16, 256], 32) == [[1], [0]]               # 256 + 32 + 16 < 2 x 256
    assert split_by_length([16, 256], 300) == [[1, 0]]


def _runner(path, split: bool) -> ModelRunner:
    model = load_model(read_checkpoint(path), torch.float32, torch.device("cpu"), 512, pack=True)
    r = ModelRunner(model, num_rows=4, max_model_len=512)
    if not split:
        r.split_tokens = 0
    return r


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_ragged_prefill_runs_in_groups_with_one_forwards_outputs(llama_dir):
    """Four prompts (200, 9, 180, 12 tokens; one reads every row's logits, as prompt_logprobs
    does), each kind of hidden state, then a decode step that reads the cache they wrote."""
    lengths = [200, 9, 180, 12]
    chunks = [SeqChunk(i, 0, _tokens(n, i), n if i == 3 else 1) for i, n in enumerate(lengths)]
    assert len(split_by_length(lengths, 32)) == 2
    split, whole = _runner(llama_dir, True), _runner(llama_dir, False)
    forwards = []
    hook = split.model.layers[0].register_forward_hook(lambda m, i, o: forwards.append(tuple(i[0].shape[:2])))
    for hidden in (None, "hidden", (0, 1), "logits_rows"):
        forwards.clear()
        got, want = split.step(chunks, hidden), whole.step(chunks, hidden)
        assert sorted(forwards) == [(2, 12), (2, 200)]   # two forwards, each padded to its longest
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        assert (got.hidden is None) == (want.hidden is None)
        if want.hidden is not None:
            torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
    hook.remove()
    decode = [SeqChunk(i, n, [7], 1) for i, n in enumerate(lengths)]
    torch.testing.assert_close(split.run(decode), whole.run(decode), atol=1e-5, rtol=1e-5)
