"""Parity with Hugging Face transformers (the oracle) on tiny random checkpoints, fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from leapfrog import LLM, SamplingParams
from leapfrog.model.loader import load_model, read_checkpoint
from tests.conftest import CONFIGS, prompts_of


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(model_dirs, name):
    path = model_dirs[name]
    ours = load_model(read_checkpoint(path), torch.float32, torch.device("cpu"), 512)
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(path)(ids).logits
        pos = torch.arange(37).expand(2, 37)
        got = ours.compute_logits(ours(ids, pos).hidden.reshape(-1, 64)).view(2, 37, -1)
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(model_dirs, tokenizer, name):
    path = model_dirs[name]
    hf = hf_model(path)
    prompts = prompts_of(tokenizer, 4)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, out in zip(prompts, batched):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        single = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
        assert single.outputs[0].token_ids == ref
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_matches_single_pass(llama_dir, tokenizer):
    p = prompts_of(tokenizer, 6)[5] * 3
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    whole = LLM(model=str(llama_dir), dtype="float32").generate({"prompt_token_ids": p}, sp)
    chunked = LLM(model=str(llama_dir), dtype="float32", max_num_batched_tokens=7).generate(
        {"prompt_token_ids": p}, sp)
    assert whole[0].outputs[0].token_ids == chunked[0].outputs[0].token_ids


def test_aux_hidden_states_returned(llama_dir):
    ours = load_model(read_checkpoint(llama_dir), torch.float32, torch.device("cpu"), 512)
    ids = torch.tensor([[1, 2, 3]])
    out = ours(ids, torch.arange(3)[None], aux_layers=(0, 1))
    assert len(out.aux) == 2 and out.aux[0].shape == (1, 3, 64)
    assert not torch.equal(out.aux[0], out.aux[1])


def test_linear_rope_context_is_scaled_and_matches_transformers(tmp_path, tokenizer):
    """Linear RoPE scaling (positions / factor) stretches the context by its factor, as vLLM reads
    it: max_position_embeddings 64 x factor 2 serves 128 positions, with the same greedy tokens
    as transformers past position 64; past 128 is refused."""
    from leapfrog.demo import save_random_llama
    from leapfrog.errors import ConfigError
    from tests.conftest import BASE
    path = save_random_llama(tmp_path / "lin", tokenizer, seed=3, **{**BASE, "max_position_embeddings": 64,
                                                                      "rope_scaling": {"rope_type": "linear",
                                                                                       "factor": 2.0}})
    llm = LLM(model=str(path), dtype="float32")
    assert llm.engine.max_model_len == 128
    p = prompts_of(tokenizer, 1)[0][:20]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model(path).generate(torch.tensor([p]), max_new_tokens=100, min_new_tokens=100, do_sample=False,
                                      pad_token_id=0)[0, len(p):].tolist()
    assert out == ref
    with pytest.raises(ConfigError, match=r"context, 128 \(max_position_embeddings .* x linear rope factor 2\)"):
        LLM(model=str(path), dtype="float32", max_model_len=129)
