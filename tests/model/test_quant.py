"""Weight-only int8/int4 quantization (model/quant.py): kernels against the pure reference, the
quantized model against a float model holding the dequantized weights, and the engine options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leapfrog import LLM, SamplingParams
from leapfrog.config import EngineConfig
from leapfrog.errors import ConfigError
from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.native_linear import native_int8_supported
from leapfrog.model.quant import (QUANT_LINEARS, Int4Linear, Int8Linear, check_quantization, int4_group_size,
                                  quantize_int4, quantize_int8, quantized_bytes, reference_weight)
from tests.conftest import prompts_of

CPU = torch.device("cpu")


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_kernel_matches_reference_weight(method, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 256, generator=g) * 0.05).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(2, rows, 256, generator=g).to(dtype)
    lin = QUANT_LINEARS[method](w, b)
    y = lin(x)
    assert y.shape == (2, rows, 96) and y.dtype == dtype
    ref = F.linear(x.float(), reference_weight(method, w), b.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


def test_quantization_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127  # the largest weight of a row maps to 127
    assert bool(((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all())
    q4, sz = quantize_int4(w, 32)  # sz [G, N, 2]
    assert sz.shape == (4, 64, 2) and int(q4.min()) == 0 and int(q4.max()) == 15
    step = sz[..., 0].t().repeat_interleave(32, dim=1)  # [N, K]
    assert bool(((reference_weight("int4", w, 32) - w).abs() <= step / 2 + 1e-5).all())
    # int4's error is ~16x int8's on the same weights
    assert (reference_weight("int4", w) - w).abs().mean() > 5 * (reference_weight("int8", w) - w).abs().mean()


def test_int4_group_size_and_bytes():
    assert int4_group_size(512) == 32 and int4_group_size(1408) == 32 and int4_group_size(64 * 3) == 32
    with pytest.raises(ConfigError, match="int4 group size"):
        int4_group_size(24)
    w = torch.randn(128, 256)
    assert quantized_bytes(Int8Linear(w, None)) == 128 * 256 + 128 * 4
    assert quantized_bytes(Int4Linear(w, None)) == 128 * 256 // 2 + (256 // 32) * 128 * 2 * 4


def test_check_quantization_refuses_unknown_method():
    check_quantization(None, torch.float32, CPU)
    check_quantization("int8", torch.bfloat16, CPU)
    with pytest.raises(ConfigError, match="must be one of"):
        check_quantization("int3", torch.float32, CPU)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_is_the_dequantized_float_model(llama_dir, method):
    """The loaded quantized model computes what a float model with the reference weights computes."""
    ckpt = read_checkpoint(llama_dir)
    quant = load_model(ckpt, torch.float32, CPU, 64, quantization=method)
    ref = load_model(ckpt, torch.float32, CPU, 64)
    n = 0
    for lq, lr in zip(quant.layers, ref.layers):
        for name in ("wqkv", "wo", "w13", "w2"):
            assert isinstance(getattr(lq, name), QUANT_LINEARS[method])
            lin = getattr(lr, name)
            lin.weight.data = reference_weight(method, lin.weight)
            n += 1
    assert n == 4 * len(ref.layers)
    ids = torch.tensor([[5, 9, 11, 3, 40, 7]])
    pos = torch.arange(6)[None]
    with torch.no_grad():
        hq, hr = quant(ids, pos).hidden, ref(ids, pos).hidden
        unquantized = load_model(ckpt, torch.float32, CPU, 64)(ids, pos).hidden
    torch.testing.assert_close(hq, hr, atol=1e-4, rtol=1e-4)
    assert (hq - unquantized).abs().max() > 1e-3  # quantization did change the model


@pytest.mark.parametrize("quant, spec", [
    ("int8", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    ("int4", {"method": "draft_model", "model": "self", "draft_quantization": "int4", "num_speculative_tokens": 4}),
    (None, {"method": "draft_model", "model": "self", "draft_quantization": "int8", "num_speculative_tokens": 4}),
])
def test_greedy_speculation_on_a_quantized_target_is_lossless(llama_dir, tokenizer, quant, spec):
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 5)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=4, quantization=quant)
    plain = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(speculative_config=spec, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == plain
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0
    if spec["method"] == "draft_model":  # a quantized copy of the target agrees with it most of the time
        assert m["acceptance_rate"] > 0.5


def test_self_draft_shares_the_embedding(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=2,
              speculative_config={"method": "draft_model", "model": "self", "draft_quantization": "int4",
                                  "num_speculative_tokens": 2})
    draft = llm.engine.proposer.model
    assert draft.embed is llm.engine.model.embed
    assert isinstance(draft.layers[0].w13, Int4Linear) and isinstance(draft.head.proj, Int4Linear)
    assert not isinstance(llm.engine.model.layers[0].w13, (Int4Linear, Int8Linear))  # the target stays float


@pytest.mark.parametrize("kw, match", [
    (dict(quantization="int3"), "quantization='int3'"),
    (dict(quantization="int4", batch_invariant=True), "batch_invariant"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_quantization": "int4"}),
     "draft_quantization applies to methods 'draft_model', 'eagle'"),
    (dict(speculative_config={"method": "draft_model", "model": "self", "num_speculative_tokens": 2,
                              "draft_quantization": "fp8"}), "draft_quantization"),
    (dict(speculative_config={"method": "eagle", "model": "self", "num_speculative_tokens": 2}), "'self'"),
])
def test_bad_quantization_options(llama_dir, kw, match):
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(llama_dir), max_model_len=64, **kw)


def test_engine_config_field():
    assert EngineConfig(model="x", quantization="int4").quantization == "int4"
    with pytest.raises(ConfigError):
        EngineConfig(model="x", quantization=8)


@pytest.mark.parametrize("n_out", [12, 40])
def test_int4_pads_output_features_to_the_kernels_multiple(n_out):
    w = torch.randn(n_out, 64)
    x = torch.randn(3, 64)
    lin = Int4Linear(w, None)
    assert lin.padded == -n_out % 16
    torch.testing.assert_close(lin(x), F.linear(x, reference_weight("int4", w)), atol=1e-4, rtol=1e-4)


def test_int8_batch_invariant_needs_the_row_invariant_op(llama_dir, monkeypatch):
    """batch_invariant=True with int8 runs on leapfrog's int8 op (rows independent of the batch);
    where it cannot serve, a clear error instead of PyTorch's kernel, which is not row-invariant."""
    from leapfrog.model import native_linear
    monkeypatch.setattr(native_linear, "native_int8_supported", lambda device: False)
    with pytest.raises(ConfigError, match="int8 op"):
        LLM(model=str(llama_dir), max_model_len=64, quantization="int8", batch_invariant=True)


@pytest.mark.skipif(not native_int8_supported("cpu"), reason="needs leapfrog's int8 op (AVX2 and a C++ compiler)")
def test_int8_batch_invariant_greedy_alone_equals_batched(llama_dir, tokenizer):
    """An int8 target in batch-invariant mode: each prompt's greedy tokens alone equal those in a
    batch of 5 with speculation (ngram drafts and verification rows in the same forwards)."""
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 5)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=str(llama_dir), dtype="bfloat16", max_model_len=128, max_num_seqs=5, quantization="int8",
              batch_invariant=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1})
    assert isinstance(llm.engine.model.layers[0].w13, Int8Linear) and llm.engine.model.layers[0].w13.row_invariant
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
