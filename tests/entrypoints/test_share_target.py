"""LLM(share_target_with=...): engines on one loaded copy of the target's weights."""

from __future__ import annotations

import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.errors import CacheBusy, ConfigError
from leapfrog.model import native_linear
from leapfrog.model.native_linear import NativeLinear
from tests.conftest import prompts_of

SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def owner(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=4)


def run(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], SP,
                                                           use_tqdm=False)]


def test_engines_share_the_tensors_and_keep_their_own_caches(owner, llama_dir, draft_dir, tokenizer):
    prompts = prompts_of(tokenizer, 4)
    plain = run(owner, prompts)
    dm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=2, share_target_with=owner,
             speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    ng = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=4, share_target_with=owner,
             speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    assert dm.engine.model is owner.engine.model and ng.engine.model is owner.engine.model
    assert dm.engine.runner.kv is not owner.engine.runner.kv
    # interleaved use: each engine's cache rows are its own, so outputs stay speculation-free's
    assert run(dm, prompts) == plain
    assert run(ng, prompts[:2]) == plain[:2]
    assert run(owner, prompts) == plain
    assert run(ng, prompts) == plain


@pytest.mark.parametrize("kw, what", [
    (dict(dtype="bfloat16"), "dtype"),
    (dict(max_model_len=512), "max_model_len 512"),
    (dict(batch_invariant=True), "batch_invariant"),
    (dict(quantization="int8"), "quantization"),
    (dict(load_format="dummy"), "load_format"),
    (dict(enforce_eager=False), "enforce_eager"),
    (dict(tensor_parallel_size=2), "share_target_with: .*tensor_parallel_size 2"),
])
def test_a_target_loaded_otherwise_is_refused(owner, llama_dir, kw, what):
    with pytest.raises(ConfigError, match=what):
        LLM(model=str(llama_dir), **{"dtype": "float32", "max_model_len": 256, **kw}, share_target_with=owner)


def test_another_checkpoint_or_a_non_llm_is_refused(owner, draft_dir):
    with pytest.raises(ConfigError, match="checkpoint"):
        LLM(model=str(draft_dir), dtype="float32", max_model_len=128, share_target_with=owner)
    with pytest.raises(ConfigError, match="must be an LLM"):
        LLM(model=str(draft_dir), dtype="float32", share_target_with=owner.engine)


def test_a_target_streaming_beside_a_drafter_is_not_shared(llama_dir, draft_dir, monkeypatch):
    """A target larger than the last-level cache streams its weights beside a drafter, which would
    change the engines sharing it: refused, and the shared model's linears left as they were."""
    base = LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128, max_num_seqs=2)
    linears = [m for m in base.engine.model.modules() if isinstance(m, NativeLinear)]
    if not linears:
        pytest.skip("no bf16 linear kernel on this CPU (nothing streams)")
    monkeypatch.setattr(native_linear, "last_level_cache_bytes", lambda: 1)
    monkeypatch.setattr(native_linear, "kernel_streams", lambda: True)   # (as on AVX-512 builds)
    monkeypatch.delenv("LEAPFROG_STREAM_WEIGHTS", raising=False)
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="streams its weights"):
        LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128, max_num_seqs=2, share_target_with=base,
            speculative_config=spec)
    assert not any(m.stream for m in linears)
    # (benchmarks and `leapfrog check`, which only share to save memory, take a copy instead)
    copy, why = LLM.sharing_if_possible(base, model=str(llama_dir), dtype="bfloat16", max_model_len=128,
                                        max_num_seqs=2, speculative_config=spec)
    assert "streams its weights" in why and copy.engine.model is not base.engine.model
    assert not any(m.stream for m in linears)
    streaming = LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128, max_num_seqs=2,
                    speculative_config=spec)
    assert any(m.stream for m in streaming.engine.model.modules() if isinstance(m, NativeLinear))
    with pytest.raises(ConfigError, match="streams its weights"):
        LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128, share_target_with=streaming)
    monkeypatch.setenv("LEAPFROG_STREAM_WEIGHTS", "0")   # no streaming anywhere: shared
    shared, why = LLM.sharing_if_possible(base, model=str(llama_dir), dtype="bfloat16", max_model_len=128,
                                          max_num_seqs=2, speculative_config=spec)
    assert why is None and shared.engine.model is base.engine.model
    assert LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128, max_num_seqs=2, share_target_with=base,
               speculative_config=spec).engine.model is base.engine.model


def test_engines_sharing_the_kv_cache_run_one_at_a_time(owner, llama_dir, draft_dir, tokenizer):
    """share_kv_cache: the other engine's target cache too (benchmarks: no difference of where
    the caches' pages landed). Used one after the other, every engine's output is its own
    (what another left in the rows is never read); an engine that steps while the other has
    unfinished requests is refused (CacheBusy), and the other's requests go on unharmed."""
    prompts = prompts_of(tokenizer, 4)
    plain = run(owner, prompts)
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    dm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=4, share_target_with=owner,
             share_kv_cache=True, speculative_config=spec)
    assert dm.engine.runner.kv is owner.engine.runner.kv
    assert dm.engine.proposer.runner.kv is not owner.engine.runner.kv   # (the drafter's cache is its own)
    assert run(dm, prompts) == plain
    assert run(owner, prompts[1:]) == plain[1:]
    assert run(dm, prompts[:3]) == plain[:3]
    owner.engine.add_request("busy", None, prompts[0], SP)
    owner.engine.step()
    with pytest.raises(CacheBusy, match="one at a time"):
        run(dm, prompts[:1])
    out = {}
    while owner.engine.has_unfinished():
        out.update({o.request_id: o.outputs[0].token_ids for o in owner.engine.step()})
    assert out["busy"] == plain[0]
    assert not dm.engine.has_unfinished()   # (the refused call's requests were aborted)
    assert run(dm, prompts[:2]) == plain[:2]


@pytest.mark.parametrize("kw, what", [
    (dict(max_num_seqs=2), r"max_num_seqs and max_model_len \(2, 256\) differ"),
    (dict(max_model_len=128), r"\(4, 128\) differ"),
])
def test_a_cache_of_another_shape_or_without_the_target_is_refused(owner, llama_dir, kw, what):
    with pytest.raises(ConfigError, match=what):
        LLM(model=str(llama_dir), **{"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, **kw},
            share_target_with=owner, share_kv_cache=True)
    with pytest.raises(ConfigError, match="only with share_target_with"):
        LLM(model=str(llama_dir), dtype="float32", max_model_len=256, share_kv_cache=True)
