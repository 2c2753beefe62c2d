"""The compiled fast path (model/compiled.py): buckets, graph metadata, and compiled forwards that
give the eager forward's logits (float32) for decode, padded ragged batches and trees at every
context length, without compiling anything after warm-up."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from torch._dynamo.utils import counters

from leapfrog import LLM, SamplingParams
from leapfrog.attention.metadata import build_attn_meta
from leapfrog.errors import ConfigError
from leapfrog.model.compiled import (INDUCTOR_OPTIONS, Bucket, CompiledForward, DirectCall, _spec, compile_settings,
                                     first_max, make_buckets, native_ops_tag, rejection_tokens)
from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.runner import ModelRunner, SeqChunk
from leapfrog.sampling import sampler
from tests.conftest import prompts_of
from tests.stats import chisq_pvalue

F32 = torch.float32
MAX_LEN = 128


def _runner(path, compiled: bool) -> ModelRunner:
    model = load_model(read_checkpoint(path), F32, torch.device("cpu"), MAX_LEN, pack=not compiled)
    if compiled:
        model.pack_for_inference(pack_layers=False)
    return ModelRunner(model, num_rows=3, max_model_len=MAX_LEN)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_graphs_compile_under_a_tag_of_the_ops_sources(monkeypatch):
    """Graphs compile with a hash of leapfrog's C++ op sources in torch.compile's cache keys: a
    changed op never runs a graph compiled on disk against its earlier build."""
    from leapfrog.attention import native
    tag = native_ops_tag()
    with compile_settings(torch.device("cpu")):
        assert torch.compiler.config.cache_key_tag == tag
        assert torch._inductor.config.freezing and torch._inductor.config.cpp_wrapper
        assert not torch._inductor.config.size_asserts   # (no assert_size_stride in the C++: compiled.py)
    assert torch.compiler.config.cache_key_tag != tag
    monkeypatch.setenv("LEAPFROG_SIZE_ASSERTS", "1")   # the switch that turns them back on
    with compile_settings(torch.device("cpu")):
        assert torch._inductor.config.size_asserts
    assert INDUCTOR_OPTIONS["size_asserts"] is False
    native_ops_tag.cache_clear()
    try:
        monkeypatch.setattr(native, "_SOURCE", native._SOURCE + "// changed\n")
        assert native_ops_tag() != tag
    finally:
        native_ops_tag.cache_clear()


def test_buckets_cover_powers_of_two_up_to_max_seqs():
    assert make_buckets(5, [1, 5]) == sorted(Bucket(b, s) for b in (1, 2, 4, 5) for s in (1, 5))
    assert make_buckets(1, [1, 1]) == [Bucket(1, 1)]
    assert make_buckets(64, [1, 65], max_tokens=256) == sorted(
        [Bucket(b, 1) for b in (1, 2, 4, 8, 16, 32, 64)] + [Bucket(1, 65), Bucket(2, 65)])


def test_graph_metadata_has_fixed_shapes():
    meta = build_attn_meta([2], [[7]], 3, "cpu", pad_to=4, graph_width=MAX_LEN)
    assert meta.mask.shape == (1, 1, 4, MAX_LEN)
    assert int(meta.graph_kv_len) == 8
    assert meta.mask[0, 0, 0].nonzero().flatten().tolist() == list(range(8))
    assert meta.mask[0, 0, 1:, 1:].sum() == 0   # padding tokens see column 0 only
    assert meta.row_range is None and meta.write_span is None   # index writes and reads
    assert meta.write_rows.tolist() == [2, 3, 3, 3] and meta.write_cols.tolist() == [7, 0, 1, 2]


def test_graph_mask_with_a_sliding_window_is_the_padded_eager_mask():
    """A graph's mask (full width, one comparison) equals the eager mask padded to the graph's
    width: causal, inside the window, padding tokens on column 0 only."""
    rows, cols = [0, 2], [[5, 6, 7], [9]]
    eager = build_attn_meta(rows, cols, 3, "cpu", sliding_window=3)
    graph = build_attn_meta(rows, cols, 3, "cpu", sliding_window=3, graph_width=MAX_LEN)
    assert graph.mask.shape == (2, 1, 3, MAX_LEN) and int(graph.graph_kv_len) == eager.kv_len == 10
    assert torch.equal(graph.mask, torch.nn.functional.pad(eager.mask, (0, MAX_LEN - eager.kv_len)))
    assert graph.mask[0, 0, 2].nonzero().flatten().tolist() == [5, 6, 7]       # column 7, window 3
    assert graph.mask[1, 0, 1:].nonzero()[:, 1].tolist() == [0, 0]             # padding tokens


def test_bucket_choice(llama_dir):
    r = _runner(llama_dir, compiled=True)
    cf = CompiledForward(r.model, r.kv, [Bucket(1, 1), Bucket(2, 5), Bucket(4, 1)])
    cf.warmed = list(cf.buckets)  # choice only: nothing is compiled before a call
    assert cf.bucket_for(1, 1, 10) == Bucket(1, 1)
    assert cf.bucket_for(2, 1, 10) == Bucket(2, 5)
    assert cf.bucket_for(3, 1, 10) == Bucket(4, 1)
    assert cf.bucket_for(1, 4, 10) == Bucket(2, 5)
    assert cf.bucket_for(3, 2, 10) is None          # no bucket: eager
    assert cf.bucket_for(1, 6, 10) is None
    assert cf.bucket_for(1, 1, MAX_LEN + 1) is None
    cf.warmed = []
    assert cf.bucket_for(1, 1, 10) is None           # not warmed: eager


def test_batch_invariant_runs_eagerly(llama_dir):
    with pytest.raises(ConfigError, match="enforce_eager"):
        LLM(model=str(llama_dir), batch_invariant=True, enforce_eager=False)


def test_compiled_forwards_match_eager(llama_dir):
    """Decode, a padded ragged batch, a tree and a 2-token chunk, at growing context lengths:
    compiled logits equal eager ones (float32, to rounding), the graph's greedy rows are exactly
    ``logits.max(-1)`` of its logits, prompts run eagerly, and nothing compiles after warm-up."""
    eager, fast = _runner(llama_dir, False), _runner(llama_dir, True)
    fast.compile([Bucket(1, 1), Bucket(2, 3)], progress=False)
    graphs = counters["stats"]["unique_graphs"]
    a, b = _tokens(20, 0), _tokens(9, 1)
    steps = [
        [SeqChunk(0, 0, a, 1), SeqChunk(1, 0, b, 1)],                    # prompts: eager
        [SeqChunk(0, 20, _tokens(1, 2), 1)],                              # decode: bucket (1, 1)
        [SeqChunk(0, 21, _tokens(3, 3), 3), SeqChunk(1, 9, _tokens(1, 4), 1)],   # ragged: (2, 3)
        [SeqChunk(1, 10, _tokens(3, 5), 3, parents=[-1, 0, 0])],          # tree, batch padded: (2, 3)
        [SeqChunk(1, 11, _tokens(2, 6), 2)],                              # 2 tokens padded to 3
        [SeqChunk(0, 24, _tokens(1, 7), 1)],                              # decode, longer context
    ]
    for i, chunks in enumerate(steps):
        want, out = eager.run(chunks), fast.step(chunks)
        torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-4)
        if i == 0:
            assert out.top is None   # (eager)
        else:
            top, top_ids = out.logits.max(-1)
            assert torch.equal(out.top[0], top) and torch.equal(out.top[1], top_ids)
    assert counters["stats"]["unique_graphs"] == graphs
    assert fast.compiled is not None and fast.compiled.warmed == [Bucket(1, 1), Bucket(2, 3)]
    # every graph call after warm-up went straight into inductor's code (no torch.compile wrappers)
    assert {k: d.calls for k, d in fast.compiled.direct.items()} == {(1, 1): 2, (2, 3): 3}
    assert fast.graph_seconds() > 0 and eager.graph_seconds() == 0


#: the fused drafting graphs' first forwards after _prefilled: ragged at batch 2, and batch 1 padded
FIRST_FORWARDS = ([SeqChunk(0, 20, _tokens(2, 2), 1), SeqChunk(1, 9, _tokens(1, 3), 1)],
                  [SeqChunk(1, 10, _tokens(2, 4), 1)])


def _prefilled(path, compile_fused) -> tuple[ModelRunner, ModelRunner, int]:
    """An eager and a compiled runner (``compile_fused(fast)`` warms its fused graph, with
    inductor's own GEMM choice: test_compiled_forwards_match_eager covers the autotuned GEMM
    templates, which would double these graphs' compile time), both with prompts of 20 and 9
    tokens in rows 0 and 1 -> (eager, fast, dynamo's graph count after warm-up)."""
    eager, fast = _runner(path, False), _runner(path, True)
    with patch.dict(INDUCTOR_OPTIONS, {"max_autotune": False}):
        compile_fused(fast)
    graphs = counters["stats"]["unique_graphs"]
    prompts = [SeqChunk(0, 0, _tokens(20, 0), 0), SeqChunk(1, 0, _tokens(9, 1), 0)]
    eager.run(prompts)
    fast.run(prompts)
    return eager, fast, graphs


def test_compiled_chain_matches_step_by_step(llama_dir):
    """A fused greedy chain (one graph: a ragged first forward, then one-token steps fed the
    previous argmax) drafts what eager step-by-step argmax drafts, with the same log q, and
    writes the same KV; padding sequences leave the real rows alone; nothing compiles after
    warm-up."""
    steps = 3
    eager, fast, graphs = _prefilled(llama_dir, lambda fast: fast.compile_chain([Bucket(2, 2)], steps, progress=False))
    for first in FIRST_FORWARDS:
        got = fast.draft_chain(first, steps)
        assert got is not None
        want_tok, want_lp, chunks = [], [], first
        for _ in range(steps):
            lp, x = torch.log_softmax(eager.run(chunks), -1).max(-1)
            want_tok.append(x)
            want_lp.append(lp)
            chunks = [SeqChunk(c.row, c.start + len(c.token_ids), [int(t)], 1) for c, t in zip(chunks, x)]
        assert got.tokens.tolist() == torch.stack(want_tok, 1).tolist()
        torch.testing.assert_close(got.logprobs, torch.stack(want_lp, 1), rtol=1e-4, atol=1e-4)
        for c in first:  # the drafted tokens' KV (all but the last) is the eager one's
            end = c.start + len(c.token_ids) + steps - 1
            torch.testing.assert_close(fast.kv.k[0][c.row, :, :end], eager.kv.k[0][c.row, :, :end],
                                       rtol=1e-4, atol=1e-4)
    assert fast.draft_chain([SeqChunk(0, 30, _tokens(3, 5), 1)], steps) is None    # 3 pending: no bucket
    assert fast.draft_chain([SeqChunk(0, MAX_LEN - 3, [5], 1)], steps) is not None  # the last draft fits
    assert fast.draft_chain([SeqChunk(0, MAX_LEN - 2, [5], 1)], steps) is None      # it would not
    assert counters["stats"]["unique_graphs"] == graphs
    assert fast.chain is not None and fast.chain.direct[(2, 2)].calls == 3


def test_decode_steps_match_one_token_steps(llama_dir):
    """Multi-step decode (one graph, num_scheduler_steps): each sequence's tokens are what
    one-token eager steps give, each fed to the next: a greedy row the argmax of the raw logits
    (with its logit), a seeded sampled row the sampler's race, argmax softmax(logits / T) / E,
    with the exponentials E given, an unseeded one (``stream``) the sampler's inverse-CDF draw
    with the uniforms w given; the last step's column must fit the cache; nothing compiles after
    warm-up."""
    steps, V = 4, 320
    eager, fast, graphs = _prefilled(llama_dir, lambda fast: fast.compile_multi_step([Bucket(2, 1)], steps,
                                                                                    progress=False))
    first = [SeqChunk(0, 20, _tokens(1, 2), 1), SeqChunk(1, 9, _tokens(1, 3), 1)]
    temperature, sampled = torch.tensor([1.0, 0.8]), torch.tensor([False, True])
    gen = torch.Generator().manual_seed(0)
    e = -torch.log(torch.rand(2, steps, V, dtype=torch.float64, generator=gen))
    w = torch.rand(2, steps, dtype=torch.float64, generator=gen)
    no_stream, stream = torch.tensor([False, False]), torch.tensor([True, False])

    def one_token_steps(chunks, draw):
        want_tok, want_val = [], []
        for j in range(steps):
            logits = eager.run(chunks)
            v, x = logits.max(-1)
            x = torch.stack([draw(b, j, logits[b], x[b]) for b in range(len(chunks))])
            want_tok.append(x)
            want_val.append(v)
            chunks = [SeqChunk(c.row, c.start + 1, [int(t)], 1) for c, t in zip(chunks, x)]
        return torch.stack(want_tok, 1), torch.stack(want_val, 1)

    def race(b, j, logits, top):
        return (torch.softmax(logits / 0.8, -1).double() / e[b, j]).argmax() if b == 1 else top

    got = fast.decode_steps(first, temperature, sampled, e, no_stream, w)
    assert got is not None and got.tokens.shape == (2, steps)
    want_tok, want_val = one_token_steps(first, race)
    assert got.tokens.tolist() == want_tok.tolist()
    torch.testing.assert_close(got.logits, want_val, rtol=1e-4, atol=1e-4)
    one = fast.decode_steps(first[1:], temperature[1:], sampled[1:], e[1:], no_stream[1:], w[1:])  # padded
    assert one is not None and one.tokens.tolist() == got.tokens[1:].tolist()
    # row 0 unseeded at T = 1.3 (inverse CDF with its uniforms), row 1 the race as before
    hot = torch.tensor([1.3, 0.8])
    both = fast.decode_steps(first, hot, torch.tensor([True, True]), e, stream, w)
    inverse = lambda b, j, logits, top: (sampler.inverse_cdf_draw(torch.softmax(logits / 1.3, -1), w[b, j])  # noqa: E731
                                         if b == 0 else race(b, j, logits, top))
    assert both is not None and both.tokens.tolist() == one_token_steps(first, inverse)[0].tolist()
    assert both.tokens[0].tolist() != got.tokens[0].tolist()   # (not the argmax: it drew)
    end = [SeqChunk(0, MAX_LEN - steps, [5], 1)]
    assert fast.decode_steps(end, temperature[:1], sampled[:1], e[:1], no_stream[:1], w[:1]) is not None
    end = [SeqChunk(0, MAX_LEN - steps + 1, [5], 1)]
    assert fast.decode_steps(end, temperature[:1], sampled[:1], e[:1], no_stream[:1], w[:1]) is None
    assert counters["stats"]["unique_graphs"] == graphs
    assert fast.multi_step is not None and fast.multi_step.direct[(2, 1)].calls == 4


def test_decode_steps_hand_over_the_target_states(llama_dir):
    """Multi-step decode with ``states`` (an EAGLE-3 head's layers): every step's input token's
    state is what a one-token eager step gives with ``hidden`` set (the layers' outputs
    concatenated), so an EAGLE head drafts after multi-step decode as after one-token steps."""
    steps, layers, V = 3, (0, 1), 320
    eager, fast, _ = _prefilled(llama_dir, lambda fast: fast.compile_multi_step([Bucket(1, 1)], steps, layers,
                                                                              progress=False))
    first = [SeqChunk(1, 9, _tokens(1, 3), 1)]
    got = fast.decode_steps(first, torch.tensor([1.0]), torch.tensor([False]),
                            torch.ones(1, steps, V, dtype=torch.float64), torch.tensor([False]),
                            torch.zeros(1, steps, dtype=torch.float64))
    want, chunks = [], first
    for _ in range(steps):
        out = eager.step(chunks, hidden=layers)
        want.append(out.hidden[0])
        chunks = [SeqChunk(1, chunks[0].start + 1, [int(out.logits[0].argmax())], 1)]
    assert got is not None and got.states is not None and got.states.shape == (1, steps, want[0].shape[-1])
    torch.testing.assert_close(got.states[0].float(), torch.stack(want).float(), rtol=1e-4, atol=1e-4)


def _eager_tree(runner: ModelRunner, first: SeqChunk, steps: int, k: int, n: int):
    """The reference EAGLE-2 expansion, level by level with eager forwards (as the proposer's
    eager path): -> (tokens, parents, depths, ranks, sorted scores) of the best n nodes, in
    depth-then-confidence order."""
    col = first.start + len(first.token_ids)
    lp = torch.log_softmax(runner.run([first])[-1], -1)
    top = lp.topk(k)
    nodes = [(int(t), -1, float(s), 1) for s, t in zip(top.values, top.indices)]   # token, parent, score, depth
    frontier, cols = list(range(k)), {}
    for d in range(2, steps + 1):
        for i, j in enumerate(frontier):
            cols[j] = col + (d - 2) * k + i
        extra = []
        for j in frontier:
            anc, a = [], nodes[j][1]
            while a >= 0:
                anc.append(cols[a])
                a = nodes[a][1]
            extra.append(anc)
        chunk = SeqChunk(first.row, col + (d - 2) * k, [nodes[j][0] for j in frontier], k, context=col,
                         extra_cols=extra, first_pos=[col + d - 2] * k)
        lp = torch.log_softmax(runner.run([chunk]), -1)
        cand = []
        for i, j in enumerate(frontier):
            top = lp[i].topk(k)
            for s, t in zip(top.values, top.indices):
                nodes.append((int(t), j, nodes[j][2] + float(s), d))
                cand.append(len(nodes) - 1)
        frontier = sorted(cand, key=lambda j: -nodes[j][2])[:k]
    ranked = sorted(range(len(nodes)), key=lambda j: -nodes[j][2])
    best = ranked[:n]
    order = sorted(best, key=lambda j: (nodes[j][3], -nodes[j][2]))
    local = {j: i for i, j in enumerate(order)}
    return ([nodes[j][0] for j in order], [local.get(nodes[j][1], -1) for j in order], [nodes[j][3] for j in order],
            [best.index(j) for j in order], sorted((x[2] for x in nodes), reverse=True))


def test_compiled_tree_matches_eager_expansion(llama_dir):
    """A fused dynamic tree (one graph: the ragged first forward, then each level's frontier with
    ancestor masks, then the reranking) drafts the tree the eager level-by-level expansion
    drafts: same nodes, parents, depths, confidence ranks and scores, for ragged and padded
    batches; nodes are closed under ancestors; the tree never fits past the cache; nothing
    compiles after warm-up."""
    steps, k, n = 3, 2, 5
    eager, fast, graphs = _prefilled(llama_dir, lambda fast: fast.compile_tree([Bucket(2, 2)], steps, k, n,
                                                                               progress=False))
    for first in FIRST_FORWARDS:
        got = fast.draft_tree(first)
        assert got is not None and got.tokens.shape == (len(first), n)
        for i, c in enumerate(first):
            tokens, parents, depths, ranks, scores = _eager_tree(eager, c, steps, k, n)
            assert got.tokens[i].tolist() == tokens
            assert got.parents[i].tolist() == parents
            assert got.depths[i].tolist() == depths
            assert got.ranks[i].tolist() == ranks
            torch.testing.assert_close(got.scores[i], torch.tensor(scores), rtol=1e-4, atol=1e-4)
            assert all(p < j and depths[p] == depths[j] - 1 and ranks[p] < ranks[j]
                       for j, p in enumerate(parents) if p >= 0)
            assert all((p < 0) == (d == 1) for p, d in zip(got.parents[i].tolist(), got.depths[i].tolist()))
    assert fast.draft_tree([SeqChunk(0, 30, _tokens(3, 5), 1)]) is None       # 3 pending: no bucket
    tree_cols = (steps - 1) * k
    assert fast.draft_tree([SeqChunk(0, MAX_LEN - tree_cols - 1, [5], 1)]) is not None   # the frontier fits
    assert fast.draft_tree([SeqChunk(0, MAX_LEN - tree_cols, [5], 1)]) is None           # it would not
    assert counters["stats"]["unique_graphs"] == graphs
    assert fast.tree is not None and fast.tree.direct[(2, 2)].calls == 3


def test_direct_call_takes_only_the_warm_up_shapes_strides_and_dtypes():
    """A direct call (no torch.compile wrappers) is made only for arguments laid out as at warm-up:
    inductor's code assumed those strides and would read anything else wrongly."""
    tok, mask = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 1, 3, 8, dtype=torch.bool)
    d = DirectCall(lambda inputs: inputs, [0, 1], _spec((tok, mask, None)))
    assert d.matches((torch.ones(2, 3, dtype=torch.long), mask.clone(), None))
    assert not d.matches((torch.zeros(3, 2, dtype=torch.long).t(), mask, None))   # same shape, other strides
    assert not d.matches((tok.int(), mask, None))                                    # other dtype
    assert not d.matches((tok, mask, torch.zeros(1)))                                # a feature where none was
    assert not d.matches((tok, mask))
    assert not d.matches((tok, mask.to("meta"), None))                              # another device


@pytest.mark.slow
def test_engine_fast_path_is_lossless(llama_dir, tokenizer):
    """The engine on the fast path (target and draft model compiled; the target drafts for
    itself, so drafts are accepted): greedy output with speculation equals eager output without
    (float32), batched, with nothing compiled while serving."""
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 3)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}
    fast = LLM(model=str(llama_dir), dtype="float32", speculative_config=spec, max_num_seqs=2,
               max_model_len=MAX_LEN, enforce_eager=False)
    graphs = counters["stats"]["unique_graphs"]
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, sp, use_tqdm=False)]
    assert counters["stats"]["unique_graphs"] == graphs
    base = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert fast.get_metrics()["num_accepted_tokens"] > 0


@pytest.mark.slow
def test_fast_path_falls_back_for_big_trees_and_long_predictions(llama_dir, tokenizer):
    """Suffix trees (up to 24 nodes) and prediction verifies (up to 65 tokens) fit no compiled
    bucket: they run eagerly beside the graphs, with nothing compiled while serving; greedy output
    equals eager output without speculation (float32), and a seeded request's output is the same
    alone and in a batch."""
    prompts = [p * 3 for p in prompts_of(tokenizer, 2)]   # repeated: the suffix trees find drafts
    inputs = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    base = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN * 3)
    want = [list(o.outputs[0].token_ids) for o in base.generate(inputs, sp, use_tqdm=False)]
    fast = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN * 3,
               enforce_eager=False, speculative_config={"method": "suffix", "num_speculative_tokens": 24})
    graphs = counters["stats"]["unique_graphs"]
    got = [list(o.outputs[0].token_ids) for o in fast.generate(inputs, sp, use_tqdm=False)]
    assert got == want
    assert fast.get_metrics()["num_accepted_tokens"] > 0
    with_pred = [SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True, prediction=w) for w in want]
    outs = fast.generate(inputs, with_pred, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert len(fast.engine.spec_metrics.num_draft_tokens_per_pos) == 64   # 65-token verifies ran
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    alone = fast.generate([inputs[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = fast.generate(inputs, [seeded, SamplingParams(temperature=1.0, max_tokens=40)], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_first_max_in_two_reductions_is_tensor_max(dtype):
    """The split form (CUDA graphs' argmax over a long row) gives Tensor.max(-1)'s values and
    indices, eagerly and compiled: equal maxima in two slices and inside one (the first wins),
    the maximum in the padded last slice, a row of -inf, NaN, a length the slices do not divide."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 1001, generator=g).to(dtype)   # [.., V]: 15 slices of 67, 4 of padding
    x[0, 0, [70, 500]] = 9.0            # slices 1 and 7
    x[0, 1, [140, 150]] = 9.0           # one slice
    x[0, 2, 1000] = 9.0                 # the last real element
    x[0, 3] = float("-inf")
    x[0, 4, [3, 800]] = float("nan")
    x[0, 5, [999, 1000]] = 9.0
    want = x.max(-1)
    split = torch.compile(lambda t: first_max(t, chunks=15, split=True), dynamic=False, fullgraph=True)
    for got in (first_max(x, chunks=15, split=True), split(x)):
        assert torch.equal(got[1], want[1])
        assert torch.allclose(got[0], want[0], equal_nan=True) and torch.equal(got[0].isnan(), want[0].isnan())
    assert got[1][0].tolist() == [70, 140, 1000, 0, 3, 999]
    assert torch.equal(first_max(x)[1], want[1])   # (the CPU: one reduction)


def test_rejection_tokens_are_lossless_and_accept_equal_drafts():
    """Speculative sampling in a graph (``rejection_tokens``) on fixed p and q: the first token
    (accepted draft or residual draw) follows p_1, and the second, when the first draft was
    accepted, follows p_2 (chi-square over 40000 draws); drafts equal to a q = p are all accepted,
    and the token after a rejected draft is never that draft."""
    V, K, N = 6, 2, 40_000
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)              # [K + 1, V]
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)                  # [K, V]
    d = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)  # [N, K]
    w = torch.rand(N, K + 1, 3, generator=g, dtype=torch.float64)
    out = rejection_tokens(p.expand(N, -1, -1), q.expand(N, -1, -1), d, w)     # [N, K + 1]
    assert chisq_pvalue(torch.bincount(out[:, 0], minlength=V).numpy(), p[0].double().numpy()) > 1e-3
    first = out[:, 0] == d[:, 0]                                                 # the first draft accepted
    assert torch.equal(first, w[:, 0, 1] * q[0, d[:, 0]].double() < p[0, d[:, 0]].double())
    assert 0 < first.float().mean() < 1
    assert chisq_pvalue(torch.bincount(out[first, 1], minlength=V).numpy(), p[1].double().numpy()) > 1e-3
    same = rejection_tokens(p[None, :].expand(N, -1, -1), p[:K].expand(N, -1, -1), d, w)
    assert torch.equal(same[:, :K], d)
