"""Tensor parallelism on CPU with gloo, 2 processes: the shard arithmetic, greedy output with TP=2
equal to TP=1 (float32) on several shapes with and without speculation, the sampling law
unchanged, and errors for shapes and options that cannot be sharded."""

from __future__ import annotations

import os

import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.entrypoints.check import check_sampling
from leapfrog.errors import ConfigError
from leapfrog.model.args import LlamaArgs
from leapfrog.parallel.shard import Shard, check_divisible
from tests.conftest import BASE, prompts_of, save_shapes

SHAPES = {
    # 4 query heads, 1 KV head: fewer KV heads than ranks, each rank holds a replica
    "gqa_kv1": dict(arch="llama", num_key_value_heads=1, tie_word_embeddings=False),
    "qwen2_bias": dict(arch="qwen2", tie_word_embeddings=False),
    "tied": dict(arch="llama", tie_word_embeddings=True),
    "odd_vocab": dict(arch="llama", vocab_size=331),   # not a multiple of 2: the last rank pads
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def _args(**kw) -> LlamaArgs:
    base = dict(model_type="llama", vocab_size=11, hidden_size=16, intermediate_size=12, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=32)
    return LlamaArgs(**{**base, **kw})


def test_shard_ranges():
    a = _args()
    s0, s1 = Shard(0, 2, a), Shard(1, 2, a)
    assert (s0.heads, s1.heads) == (range(0, 2), range(2, 4))
    assert (s0.kv_heads, s1.kv_heads) == (range(0, 1), range(1, 2))
    assert (s0.intermediate, s1.intermediate) == (range(0, 6), range(6, 12))
    assert (s0.vocab, s1.vocab) == (range(0, 6), range(6, 12))      # 11 padded to 12
    assert s1.local_args().num_attention_heads == 2 and s1.local_args().vocab_size == 6
    # 1 KV head, 4 ranks: every rank holds the one head; 2 KV heads, 4 ranks: ranks 0-1 head 0, 2-3 head 1
    assert [Shard(r, 4, _args(num_key_value_heads=1)).kv_heads for r in range(4)] == [range(0, 1)] * 4
    assert [Shard(r, 4, a).kv_heads.start for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("kw, size, field", [
    (dict(), 3, "num_attention_heads=4"),
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, "num_key_value_heads=3"),
    (dict(num_attention_heads=6, num_key_value_heads=2, head_dim=4), 4, "num_attention_heads=6"),
    (dict(intermediate_size=10), 4, "intermediate_size=10"),
])
def test_indivisible_shapes_are_refused(kw, size, field):
    with pytest.raises(ConfigError, match=field):
        check_divisible(_args(**kw), size)


def test_unsupported_combinations_are_refused(llama_dir):
    for kw, what in ((dict(batch_invariant=True), "batch_invariant"), (dict(enforce_eager=False), "enforce_eager"),
                     (dict(quantization="int8"), "quantization"),
                     (dict(tensor_parallel_size=0), "tensor_parallel_size")):
        with pytest.raises(ConfigError, match=what):
            LLM(str(llama_dir), dtype="float32", **{"tensor_parallel_size": 2, **kw})
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by 3"):
        LLM(str(llama_dir), dtype="float32", tensor_parallel_size=3)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory, tokenizer):
    return save_shapes(tmp_path_factory, tokenizer, SHAPES)


def _greedy(model, prompts, spec=None, tp=1, max_tokens=24):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(model), dtype="float32", speculative_config=spec, tensor_parallel_size=tp, max_model_len=128,
             max_num_seqs=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.get_metrics()


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_tp2_equals_tp1(shapes, tokenizer, name):
    prompts = prompts_of(tokenizer, 4)
    ref, _ = _greedy(shapes[name], prompts)
    out, _ = _greedy(shapes[name], prompts, tp=2)
    assert out == ref


def test_greedy_tp4_equals_tp1_and_leaves_no_segment(shapes, tokenizer, monkeypatch):
    """4 ranks on 2 KV heads (each replicated twice), 320-token vocabulary in 4 slices; the
    shared-memory segment rank 0 created went with the engine (only its own: the other pytest-xdist
    worker may be running an engine with a segment of its own meanwhile)."""
    from leapfrog.parallel import shm
    created, init = [], shm.ShmChannel.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.owner:
            created.append(self.name)

    monkeypatch.setattr(shm.ShmChannel, "__init__", recording)
    prompts = prompts_of(tokenizer, 2)
    ref, _ = _greedy(shapes["tied"], prompts, max_tokens=12)
    out, _ = _greedy(shapes["tied"], prompts, tp=4, max_tokens=12)
    assert out == ref
    assert created   # (rank 0 runs in this process)
    if os.path.isdir("/dev/shm"):
        assert not [name for name in created if os.path.exists(f"/dev/shm/{name}")]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_tp2_with_speculation_equals_tp1_without(shapes, tokenizer, draft_dir, method):
    prompts = prompts_of(tokenizer, 4)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(draft_dir),
                                            "num_speculative_tokens": 3}
    ref, _ = _greedy(shapes["gqa_kv1"], prompts)
    out, metrics = _greedy(shapes["gqa_kv1"], prompts, spec=spec, tp=2)
    assert metrics["num_draft_tokens"] > 0
    assert out == ref


#: 3 layers (EAGLE-3 fuses three); EAGLE-1 on a tied, odd vocabulary (the replica's embedding is also the
#: LM head the head drafts with; padding ids must not leak into drafts), EAGLE-3 on an untied target
#: with 1 KV head (its own LM head and draft vocabulary: the replica holds the embedding only)
EAGLE_TARGETS = {"eagle": dict(arch="llama", vocab_size=331, num_hidden_layers=3),
                 "eagle3": dict(arch="llama", num_key_value_heads=1, tie_word_embeddings=False, num_hidden_layers=3)}
EAGLE_TREES = {"chain": {"num_speculative_tokens": 4, "eagle_topk": 1},
               "dynamic": {"num_speculative_tokens": 3, "eagle_topk": 3, "num_draft_tokens": 8}}


@pytest.fixture(scope="module")
def eagle_pairs(tmp_path_factory, tokenizer):
    from tests.spec_decode.test_eagle import make_head
    targets = save_shapes(tmp_path_factory, tokenizer, EAGLE_TARGETS)
    return {kind: (t, make_head(t, tmp_path_factory.mktemp(f"head-{kind}"), kind,
                                **({"draft_vocab_size": 200} if kind == "eagle3" else {})))
            for kind, t in targets.items()}


@pytest.mark.parametrize("kind", list(EAGLE_TARGETS))
def test_greedy_tp2_with_eagle_equals_tp1_without(eagle_pairs, tokenizer, kind):
    """The head on rank 0 reads the sharded target's features and whole copies of its embedding
    and LM head (parallel/replica.py); chains and dynamic trees, 4 ragged prompts in one batch."""
    target, head = eagle_pairs[kind]
    prompts = prompts_of(tokenizer, 4)
    ref, _ = _greedy(target, prompts)
    for tree, extra in EAGLE_TREES.items():
        spec = {"method": kind, "model": str(head), **extra}
        out, metrics = _greedy(target, prompts, spec=spec, tp=2)
        assert out == ref, tree
        # greedy output is right whatever is drafted: the drafts themselves must be the unsharded
        # head's (the same features and vocabulary give the same proposals, up to fp32 rounding)
        _, one = _greedy(target, prompts, spec=spec)
        assert metrics["num_accepted_tokens"] > 0, tree
        n1 = one["num_accepted_tokens"]
        assert abs(metrics["num_accepted_tokens"] - n1) <= 0.1 * n1, tree


def test_vocab_replica_matches_the_whole_target(eagle_pairs):
    """The replica's embedding rows and logits are the unsharded target's (no process group needed:
    load_whole reads the checkpoint)."""
    import torch

    from leapfrog.model.loader import load_model, read_checkpoint
    from leapfrog.parallel.replica import VocabReplica, unsharded_view
    for kind in EAGLE_TARGETS:
        ckpt = read_checkpoint(eagle_pairs[kind][0])
        whole = load_model(ckpt, torch.float32, torch.device("cpu"), 64, pack=True)
        assert unsharded_view(whole, ckpt) is whole
        whole.tp = object()   # pretend it is a shard: the view now reads the tensors itself
        view = unsharded_view(whole, ckpt)
        embed_only = unsharded_view(whole, ckpt, need_head=False)
        head_only = unsharded_view(whole, ckpt, need_embed=False)
        whole.tp = None
        assert isinstance(view, VocabReplica)
        h = torch.randn(3, whole.args.hidden_size)
        torch.testing.assert_close(view.compute_logits(h), whole.compute_logits(h), rtol=0, atol=0)
        torch.testing.assert_close(head_only.compute_logits(h), whole.compute_logits(h), rtol=0, atol=0)
        assert torch.equal(view.embed.weight, whole.embed.weight)
        assert torch.equal(embed_only.embed.weight, whole.embed.weight)
        assert embed_only.head is None and head_only.embed is None   # only what the head uses is read


def test_sampling_law_unchanged_with_drafters(eagle_pairs, draft_dir, tokenizer):
    """Chi-square through the engine, TP=1 without speculation vs TP=2 with an EAGLE-3 head configured
    for trees (sampled requests draft sampled chains, verified against q) and with a draft model
    (rejection sampling against q)."""
    target = eagle_pairs["eagle3"][0]
    prompt = prompts_of(tokenizer, 2)[1]
    specs = {"eagle3": {"method": "eagle3", "model": str(eagle_pairs["eagle3"][1]), **EAGLE_TREES["dynamic"]},
             "draft_model": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}}
    with LLM(str(target), dtype="float32", max_model_len=64, max_num_seqs=64) as base:
        for name, spec in specs.items():
            with LLM(str(target), dtype="float32", max_model_len=64, max_num_seqs=64, seed=7,
                     tensor_parallel_size=2, speculative_config=spec) as tp:
                res = check_sampling(base, tp, [prompt], "temperature=0.8, top_k=50", samples=1200, num_tokens=3)
                assert tp.get_metrics()["num_accepted_tokens"] > 0, name
            assert min(r.p_value for r in res) > 1e-3 / len(res), (name, res)


def test_seeded_output_alone_equals_in_a_batch(eagle_pairs, tokenizer):
    """Same seed, same output, whatever else is in the batch and whatever was drafted: TP=2 with an
    EAGLE-3 tree, each seeded request alone and then all together with unseeded neighbours."""
    target, head = eagle_pairs["eagle3"]
    prompts = prompts_of(tokenizer, 3)
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=16, ignore_eos=True)
              for i in range(3)]
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "eagle3", "model": str(head), **EAGLE_TREES["dynamic"]}
    with LLM(str(target), dtype="float32", max_model_len=128, max_num_seqs=8, tensor_parallel_size=2,
             speculative_config=spec) as llm:
        alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
                 for p, sp in zip(prompts, seeded)]
        inputs = [{"prompt_token_ids": p} for p in prompts + prompts]
        batch = llm.generate(inputs, seeded + [noise] * 3, use_tqdm=False)
        assert llm.get_metrics()["num_accepted_tokens"] > 0
    assert [list(o.outputs[0].token_ids) for o in batch[:3]] == [list(a) for a in alone]


def test_sampling_law_unchanged(shapes, tokenizer):
    """Chi-square, token by token: TP=1 without speculation vs TP=2 with n-gram drafts, on the odd
    vocabulary (a padding logit that leaked into the sampler would show as a new token)."""
    prompt = prompts_of(tokenizer, 4)[3] * 3   # repeated: prompt lookup finds drafts
    with LLM(str(shapes["odd_vocab"]), dtype="float32", max_model_len=64, max_num_seqs=64) as base, \
            LLM(str(shapes["odd_vocab"]), dtype="float32", max_model_len=64, max_num_seqs=64, seed=5,
                tensor_parallel_size=2, speculative_config=NGRAM) as tp:
        res = check_sampling(base, tp, [prompt], "temperature=1.0", samples=1500, num_tokens=3)
        assert tp.get_metrics()["num_draft_tokens"] > 0
        outs = tp.generate([{"prompt_token_ids": prompt}] * 200, SamplingParams(temperature=1.5, max_tokens=4),
                           use_tqdm=False)
    assert max(t for o in outs for t in o.outputs[0].token_ids) < 331   # never a padding id
    assert min(r.p_value for r in res) > 1e-3 / len(res)


def test_base_shapes_unchanged():
    assert BASE["num_attention_heads"] == 4   # the shapes above assume 4 heads split over 2 ranks


def test_each_rank_loads_only_its_slices(shapes):
    """load_model(tp=...) builds the shard's shapes and fills them with the checkpoint's slices
    (parts read with safetensors' get_slice; no process group is needed to load)."""
    import torch

    from leapfrog.model.loader import load_model, read_checkpoint
    from leapfrog.parallel.group import TPGroup

    ckpt = read_checkpoint(shapes["gqa_kv1"])
    a = ckpt.args
    full = load_model(ckpt, torch.float32, torch.device("cpu"), 64)
    hd, inter = a.head_dim, a.intermediate_size // 2
    for rank in range(2):
        part = load_model(ckpt, torch.float32, torch.device("cpu"), 64, tp=TPGroup(Shard(rank, 2, a), "cpu"))
        n = sum(p.numel() for p in part.parameters())
        assert n < 0.6 * sum(p.numel() for p in full.parameters())
        f, p = full.layers[0], part.layers[0]
        q = slice(rank * 2 * hd, (rank + 1) * 2 * hd)                 # 2 of 4 query heads
        assert torch.equal(p.wqkv.weight[:2 * hd], f.wqkv.weight[q])
        assert torch.equal(p.wqkv.weight[2 * hd:], f.wqkv.weight[4 * hd:])   # the one KV head, replicated
        assert torch.equal(p.wo.weight, f.wo.weight[:, q])
        assert torch.equal(p.w13.weight[:inter], f.w13.weight[rank * inter:(rank + 1) * inter])
        assert torch.equal(p.w2.weight, f.w2.weight[:, rank * inter:(rank + 1) * inter])
        v = Shard(rank, 2, a).vocab
        assert torch.equal(part.lm_head.weight[:len(v)], full.lm_head.weight[v.start:v.stop])
