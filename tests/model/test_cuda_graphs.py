"""The fast path on CUDA: compiled forwards replayed as CUDA graphs (model/compiled.py GraphReplay).

Skipped without a CUDA device (CI has none); run on a GPU machine with
``python -m pytest tests/model/test_cuda_graphs.py tests/attention/test_triton_decode.py`` (the
Triton attention kernel's own test lives there, with its CPU run through Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from leapfrog import LLM, SamplingParams
from tests.conftest import prompts_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _generate(llm: LLM, prompts, max_tokens: int = 24, **sp):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **sp})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _calls(g) -> int:
    """Replays of one compiled forward's CUDA graphs (0 when the runner built none of that kind)."""
    return 0 if g is None else sum(r.calls for r in g.replays.values())


def _replays(llm: LLM) -> int:
    return sum(_calls(g) for g in llm.engine.runner.graphs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_replay_and_match_eager(llama_dir, tokenizer, dtype):
    """Every decode step replays a CUDA graph (none compiles while serving), and greedy output
    equals the eager forwards' (fp32: token for token; bf16: most prompts, near-ties aside)."""
    prompts = prompts_of(tokenizer, 4)
    eager = LLM(model=str(llama_dir), dtype=dtype, device="cuda", max_model_len=128, max_num_seqs=4)
    fast = LLM(model=str(llama_dir), dtype=dtype, device="cuda", max_model_len=128, max_num_seqs=4,
               enforce_eager=False)
    assert all(g.replays for g in fast.engine.runner.graphs)
    frames = counters["stats"]["unique_graphs"]
    want, got = _generate(eager, prompts), _generate(fast, prompts)
    assert counters["stats"]["unique_graphs"] == frames   # nothing compiled while serving
    assert _replays(fast) >= 20
    same = sum(a == b for a, b in zip(want, got))
    assert same == len(prompts) if dtype == "float32" else same >= len(prompts) - 1


def test_graphs_without_the_triton_kernel_match_eager(llama_dir, tokenizer, monkeypatch):
    """Where the Triton kernel cannot run (attention/triton_decode.py ``try_decode_attention``
    gives None), the graphs' attention op writes the cache itself and attends with SDPA: greedy
    output still equals eager forwards' (float32)."""
    from leapfrog.attention import triton_decode
    calls = []
    monkeypatch.setattr(triton_decode, "try_decode_attention", lambda *a: calls.append(1))
    prompts = prompts_of(tokenizer, 3)
    eager = LLM(model=str(llama_dir), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=4)
    fast = LLM(model=str(llama_dir), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=4,
               enforce_eager=False)
    assert _generate(fast, prompts) == _generate(eager, prompts)
    assert calls and _replays(fast) > 0


def test_speculation_on_graphs_is_lossless(llama_dir, draft_dir, tokenizer):
    """draft_model and n-gram speculation on the CUDA fast path: greedy output equals plain
    decoding's; sampled output is reproducible by seed."""
    prompts = prompts_of(tokenizer, 4)
    base = LLM(model=str(llama_dir), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=4,
               enforce_eager=False)
    want = _generate(base, prompts)
    for spec in ({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM(model=str(llama_dir), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=4,
                  enforce_eager=False, speculative_config=spec)
        assert _generate(llm, prompts) == want, spec["method"]
        a = _generate(llm, prompts, temperature=0.8, seed=5)
        assert a == _generate(llm, prompts, temperature=0.8, seed=5), spec["method"]
        assert _replays(llm) > 0


def test_dummy_shape_on_cuda(tmp_path, llama_dir):
    """load_format="dummy" builds the model on the GPU from config.json alone."""
    import shutil
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    llm = LLM(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
              max_model_len=64, max_num_seqs=1, enforce_eager=False)
    assert next(llm.engine.model.parameters()).is_cuda
    assert len(_generate(llm, [[5, 6, 7]], max_tokens=8)[0]) == 8


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_linear_on_cuda_matches_its_reference(method):
    """The CUDA weight-only kernels (tinygemm's int4 layout, int8) compute with the weight
    quant.reference_weight describes, for one row and for a few."""
    from leapfrog.model.quant import QUANT_LINEARS, reference_weight
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(384, 1024, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    layer = QUANT_LINEARS[method](w, None)
    for rows in (1, 5):
        x = torch.randn(rows, 1024, generator=g, device="cuda").to(torch.bfloat16)
        want = x.float() @ reference_weight(method, w).T
        got = layer(x).float()
        assert ((got - want).norm() / want.norm()).item() < 2e-2, rows


def test_unseeded_sampling_on_cuda(llama_dir, draft_dir, tokenizer):
    """Requests without a seed of their own draw from a CPU generator stream (the engine's seed):
    plain sampling and rejection sampling on CUDA take those draws (found on the H100: the noise was
    drawn into a CUDA tensor with a CPU generator), reproducibly per engine seed."""
    prompts = prompts_of(tokenizer, 2)
    for spec in (None, {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}):
        outs = []
        for _ in range(2):
            llm = LLM(model=str(llama_dir), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=2,
                      enforce_eager=False, speculative_config=spec, seed=3)
            outs.append(_generate(llm, prompts, temperature=0.9))
        assert outs[0] == outs[1] and all(len(o) == 24 for o in outs[0])


def test_position_noise_is_the_same_on_cuda():
    """A seeded request's noise at an output position is computed on the host for every device
    (sampler.position_noise): one-token steps race on the host, multi-step and round graphs on
    the GPU (with a CUDA generator their draws differed, found on the H100)."""
    from leapfrog.sampling import sampler
    from leapfrog.sampling.sampler import PositionKey
    rngs = [PositionKey(12345, j) for j in range(3)] + [None]
    assert torch.equal(sampler.noise(rngs, 300, "cuda").cpu(), sampler.noise(rngs, 300, "cpu"))


@pytest.fixture(scope="module")
def eagle_target(tmp_path_factory, tokenizer):
    """A target with the three layers EAGLE-3 fuses."""
    from tests.conftest import save_shapes
    from tests.spec_decode.test_eagle import SHAPES
    return save_shapes(tmp_path_factory, tokenizer, {"t3": SHAPES["llama_gqa_llama3"]})["t3"]


def _head(target, out, kind):
    from tests.spec_decode.test_eagle import make_head
    return make_head(target, out, kind, **({"draft_vocab_size": 200} if kind == "eagle3" else {}))


CUDA_FP32 = dict(dtype="float32", device="cuda", max_model_len=128, max_num_seqs=4, enforce_eager=False)
EAGLE_TREES = {"chain": {"num_speculative_tokens": 4, "eagle_topk": 1},
               "dynamic": {"num_speculative_tokens": 4, "eagle_topk": 3, "num_draft_tokens": 10}}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_on_graphs_is_lossless(eagle_target, tmp_path, tokenizer, kind):
    """EAGLE-1 and EAGLE-3 heads on the CUDA fast path (the head's fused chain and tree graphs, the
    target's verify graphs, all replayed): greedy output equals plain decoding's in float32, for
    chains and dynamic trees, batched; seeded sampling is reproducible; unseeded sampled requests
    (the engine's CPU generator stream) decode to their length."""
    head = _head(eagle_target, tmp_path / "h", kind)
    prompts = prompts_of(tokenizer, 3)
    want = _generate(LLM(model=str(eagle_target), **CUDA_FP32), prompts)
    for name, tree in EAGLE_TREES.items():
        llm = LLM(model=str(eagle_target), speculative_config={"method": kind, "model": str(head), **tree}, seed=3,
                  **CUDA_FP32)
        assert _generate(llm, prompts) == want, name
        assert llm.get_metrics()["num_draft_tokens"] > 0, name
        drafter = llm.engine.proposer.runner
        assert _replays(llm) > 0 and sum(_calls(g) for g in drafter.graphs) + _calls(drafter.chain) \
            + _calls(drafter.tree) > 0, name
        seeded = _generate(llm, prompts, temperature=0.8, seed=5)
        assert seeded == _generate(llm, prompts, temperature=0.8, seed=5), name
        assert all(len(o) == 24 for o in _generate(llm, prompts, temperature=0.8)), name


@pytest.fixture(scope="module")
def plain(eagle_target, tokenizer):
    """The prompts, and plain one-token decoding's greedy (23 tokens) and seeded sampled (21) output
    (one engine for the multi-step and the rounds test)."""
    prompts = prompts_of(tokenizer, 3)
    base = LLM(model=str(eagle_target), **CUDA_FP32)
    return (prompts, _generate(base, prompts, max_tokens=23),
            _generate(base, prompts, max_tokens=21, temperature=0.9, seed=5))


def test_multi_step_on_cuda(eagle_target, plain):
    """num_scheduler_steps on CUDA (each multi-step graph captured and replayed): several decode
    steps per engine step give one-token decoding's greedy tokens (float32, batched and ragged,
    max_tokens not a multiple of the steps), and seeded sampled requests draw the one-token
    steps' tokens (the race runs on the GPU there, on the host in one-token steps)."""
    prompts, greedy, seeded = plain
    multi = LLM(model=str(eagle_target), num_scheduler_steps=4, **CUDA_FP32)
    assert _generate(multi, prompts, max_tokens=23) == greedy
    assert _calls(multi.engine.runner.multi_step) > 0
    assert _generate(multi, prompts, max_tokens=21, temperature=0.9, seed=5) == seeded


def test_eagle_rounds_on_cuda(eagle_target, tmp_path, plain):
    """EAGLE-3 speculation rounds on CUDA (num_scheduler_steps with a head: rounds graphs
    captured and replayed) give one-token decoding's greedy tokens, and seeded sampled requests
    its draws."""
    prompts, greedy, seeded = plain
    head = _head(eagle_target, tmp_path / "h", "eagle3")
    rounds = LLM(model=str(eagle_target), num_scheduler_steps=4, **CUDA_FP32,
                 speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                                     "eagle_topk": 1})
    assert _generate(rounds, prompts, max_tokens=23) == greedy
    assert _calls(rounds.engine.runner.round) > 0
    assert _generate(rounds, prompts, max_tokens=21, temperature=0.9, seed=5) == seeded


def test_argmax_in_two_reductions_on_cuda(eagle_target, tmp_path, plain, monkeypatch):
    """model/compiled.py ``first_max`` on CUDA: over a Llama 3 row (128256) it is Tensor.max,
    compiled; and with every graph's argmax and race split (``SPLIT_MAX_AT`` 1: the test
    vocabulary is short), multi-step decode and EAGLE-3 rounds give one-token decoding's greedy
    tokens and seeded draws."""
    from leapfrog.model import compiled
    x = torch.randn(3, 128256, device="cuda")
    x[0, [5, 70000]] = 50.0
    got = torch.compile(compiled.first_max, dynamic=False, fullgraph=True)(x)
    assert torch.equal(got[1], x.max(-1)[1]) and torch.equal(got[0], x.max(-1)[0]) and int(got[1][0]) == 5
    monkeypatch.setattr(compiled, "SPLIT_MAX_AT", 1)
    prompts, greedy, seeded = plain
    head = _head(eagle_target, tmp_path / "h", "eagle3")
    for spec in (None, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "eagle_topk": 1}):
        llm = LLM(model=str(eagle_target), num_scheduler_steps=4, speculative_config=spec, **CUDA_FP32)
        assert _generate(llm, prompts, max_tokens=23) == greedy, spec
        assert _generate(llm, prompts, max_tokens=21, temperature=0.9, seed=5) == seeded, spec


def test_pruned_and_split_prefill_on_cuda(eagle_target, tmp_path):
    """The eager prefill on the GPU: prompts of 5, 40 and 300 tokens prefilled together run in
    forwards of similar lengths (model/runner.py split_by_length, 256 tokens a forward on CUDA),
    and the last layer runs past attention for the logits rows only (keep_rows: the target without
    speculation, and an EAGLE-3 head catching up on the prompts; its target reads every row). Greedy output equals one unsplit, unpruned
    forward's (float32)."""
    from tests.model.test_split_prefill import _tokens
    prompts = [_tokens(n, n) for n in (5, 40, 300)]
    head = _head(eagle_target, tmp_path / "h", "eagle3")
    for spec in (None, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "eagle_topk": 1}):
        outs = []
        for fast in (True, False):
            llm = LLM(model=str(eagle_target), dtype="float32", device="cuda", max_model_len=512, max_num_seqs=4,
                      speculative_config=spec)
            runner = llm.engine.runner
            models = [runner.model] + ([llm.engine.proposer.runner.model] if spec else [])
            assert runner.split_tokens == 256
            forwards = []
            step = runner._forward
            runner._forward = lambda chunks, hidden: forwards.append(len(chunks)) or step(chunks, hidden)
            if not fast:
                runner.split_tokens = 0
                for m in models:
                    m.keeps_rows = False
            outs.append(_generate(llm, prompts, max_tokens=12))
            assert (forwards[:2] == [1, 2]) if fast else (forwards[0] == 3), (spec, forwards[:3])
        assert outs[0] == outs[1], spec


def test_unseeded_multi_step_and_rounds_on_cuda(eagle_target, tmp_path, tokenizer):
    """Unseeded sampled rows in the multi-step graph and in EAGLE-3's sampled rounds draw by
    ``torch.searchsorted`` over cumulative sums inside the graphs, with the engine's generator's
    uniforms: on CUDA they decode to their length, the same per engine seed."""
    prompts = prompts_of(tokenizer, 2)
    head = _head(eagle_target, tmp_path / "h", "eagle3")
    for spec in (None, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "eagle_topk": 1}):
        outs = []
        for _ in range(2):
            llm = LLM(model=str(eagle_target), num_scheduler_steps=4, speculative_config=spec, seed=3,
                      **{**CUDA_FP32, "max_num_seqs": 2})
            outs.append(_generate(llm, prompts, max_tokens=21, temperature=0.9))
            runner = llm.engine.runner   # (sampled batches run the rounds' sampled twin)
            assert _calls(runner.multi_step if spec is None else runner.sampled_round) > 0, spec
        assert outs[0] == outs[1] and all(len(o) == 21 for o in outs[0]), spec


def test_auto_tree_sizes_and_leases_on_cuda(eagle_target, tmp_path, tokenizer):
    """num_draft_tokens "auto" on the CUDA fast path: the controller times the target's graphs and
    picks a tree size per batch size (none among them), and the plain steps it leases (where it
    drafts nothing: with disable_by_batch_size, a batch of 3) run without asking it
    (spec_decode/adaptive.py). Ragged lengths (12, 24, 40
    tokens) shrink the batch from 3 to 1 on the way. Greedy output equals plain decoding's
    (float32); seeded sampling is reproducible."""
    head = _head(eagle_target, tmp_path / "h", "eagle3")
    prompts = prompts_of(tokenizer, 3)
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 24, 40)]

    def run(llm, sps):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    want = run(LLM(model=str(eagle_target), **CUDA_FP32), sps)
    seeded = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=sp.max_tokens, ignore_eos=True)
              for i, sp in enumerate(sps)]
    for extra in ({}, {"disable_by_batch_size": 2}):
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4, "eagle_topk": 3,
                "num_draft_tokens": "auto", **extra}
        llm = LLM(model=str(eagle_target), speculative_config=spec, seed=3, **CUDA_FP32)
        ctl = llm.engine.spec_controller
        leased = []
        lease_step = ctl.lease_step
        ctl.lease_step = lambda *a, **kw: leased.append(1) or lease_step(*a, **kw)
        assert run(llm, sps) == want, extra
        assert llm.get_metrics()["num_draft_tokens"] > 0 and ctl.observations > 0, extra
        assert _replays(llm) > 0, extra
        assert leased or not extra, extra   # (a batch of 3 is off there: its steps leased)
        assert run(llm, seeded) == run(llm, seeded), extra


def test_engines_sharing_the_target_and_its_cache_on_cuda(eagle_target, tmp_path, tokenizer):
    """LLM(share_target_with=..., share_kv_cache=True) on the CUDA fast path: the speculating
    engine's graphs are captured over the other engine's cache tensors, and the two engines,
    used in turn, each give plain decoding's greedy output (float32)."""
    head = _head(eagle_target, tmp_path / "h", "eagle3")
    prompts = prompts_of(tokenizer, 3)
    owner = LLM(model=str(eagle_target), **CUDA_FP32)
    want = _generate(owner, prompts)
    spec = LLM(model=str(eagle_target), share_target_with=owner, share_kv_cache=True, **CUDA_FP32,
               speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 4,
                                   "eagle_topk": 3, "num_draft_tokens": 10})
    assert spec.engine.model is owner.engine.model and spec.engine.runner.kv is owner.engine.runner.kv
    assert _generate(spec, prompts) == want
    assert _generate(owner, prompts) == want
    assert _generate(spec, prompts) == want and _replays(spec) > 0
