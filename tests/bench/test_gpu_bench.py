"""benchmarks/gpu_bench.py's helpers that run without a GPU (the script itself needs CUDA)."""

from __future__ import annotations

import pytest

from leapfrog import LLM, SamplingParams


@pytest.fixture
def gpu_bench(load_script):
    return load_script("benchmarks/gpu_bench.py")


def test_forward_kernels_are_one_decode_forwards_ops(llama_dir, gpu_bench):
    """The profile covers decode forwards only, counted per forward: each decoder layer's linears
    appear a whole number of times per forward (a prefill inside would add a fraction), and the
    profiled request runs to its end."""
    llm = LLM(model=str(llama_dir), dtype="float32", enforce_eager=True, max_num_seqs=1, max_model_len=128)
    layers = llm.engine.model.args.num_hidden_layers
    rows = gpu_bench.forward_kernels(llm, list(range(5, 21)), n=16, cuda=False)
    assert rows and len(rows) <= 15
    assert all(ms > 0 and calls > 0 for _, ms, calls in rows)
    linear = [c for key, _, c in rows if "linear" in key.lower() or key in ("aten::mm", "aten::addmm")]
    assert linear, [key for key, _, _ in rows]
    assert all(float(c).is_integer() and layers <= c < 16 * layers for c in linear), linear
    assert not llm.engine.has_unfinished()


def test_forward_kernels_refuses_speculation(llama_dir, gpu_bench):
    """A speculative step is not one decode forward: the profile refuses it, with a message."""
    llm = LLM(model=str(llama_dir), dtype="float32", enforce_eager=True, max_num_seqs=1, max_model_len=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="plain one-token steps"):
        gpu_bench.forward_kernels(llm, list(range(5, 21)), cuda=False)
    assert not llm.engine.has_unfinished()


def test_one_max_contenders_compile_without_the_split_argmax(gpu_bench):
    """The -1max contenders' graphs are traced with first_max's split off, and the setting comes
    back afterwards, even when making the LLM fails."""
    from leapfrog.model import compiled
    before = compiled.SPLIT_MAX_AT
    with gpu_bench.one_reduction_argmax():
        assert compiled.SPLIT_MAX_AT > 1 << 40
    with pytest.raises(RuntimeError), gpu_bench.one_reduction_argmax():
        raise RuntimeError("no GPU")
    assert compiled.SPLIT_MAX_AT == before
    assert {"graphs-1max", "steps-1max"} <= set(gpu_bench.ALL)


def test_random_head_fits_a_short_vocabulary(tmp_path_factory, tmp_path, tokenizer, gpu_bench):
    """``random_head`` (gpu_bench.py; ``tree_bench.py --head random``) writes an EAGLE-3 head the
    engine loads for a target whose vocabulary is shorter than 32000 ids, drafting over all of it;
    output stays the target's."""
    import json

    from tests.conftest import prompts_of, save_shapes
    from tests.spec_decode.test_eagle import SHAPES
    llama_dir = save_shapes(tmp_path_factory, tokenizer, {"t": SHAPES["llama_untied"]})["t"]   # (3 layers to fuse)
    head = gpu_bench.random_head(llama_dir, tmp_path / "head", 0.2)
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    assert json.loads((head / "config.json").read_text())["draft_vocab_size"] == vocab
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 2)]
    kw = dict(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(**kw, speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                                        "eagle_topk": 1})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    assert llm.get_metrics()["num_draft_tokens"] > 0
