"""After any sequence of accept/reject steps, target and draft caches equal a fresh forward
over the committed tokens."""

from __future__ import annotations

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.model.runner import ModelRunner, SeqChunk
from tests.conftest import prompts_of


def assert_row_matches_fresh(runner: ModelRunner, row: int, tokens: list[int]) -> None:
    if not tokens:
        return
    fresh = ModelRunner(runner.model, 1, runner.kv.max_model_len)
    fresh.run([SeqChunk(0, 0, tokens, 0)])
    n = len(tokens)
    for layer in range(runner.model.args.num_hidden_layers):
        torch.testing.assert_close(runner.kv.k[layer][row, :, :n], fresh.kv.k[layer][0, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.kv.v[layer][row, :, :n], fresh.kv.v[layer][0, :, :n], rtol=1e-5, atol=1e-5)


def test_caches_equal_fresh_forward_after_each_step(llama_dir, draft_dir, tokenizer):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 4}
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=4, speculative_config=spec)
    eng = llm.engine
    for i, p in enumerate(prompts_of(tokenizer, 3)):
        eng.add_request(str(i), None, p, SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True))
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for req in list(eng.requests.values()):
            if req.row is None or not req.output_ids:
                continue
            assert_row_matches_fresh(eng.runner, req.row, req.all_ids[:req.num_computed])
            dc = eng.proposer.computed[req.request_id]
            assert dc <= req.num_tokens
            assert_row_matches_fresh(eng.proposer.runner, req.row, req.all_ids[:dc])
            checked += 1
    assert checked > 10
    m = llm.get_metrics()
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
