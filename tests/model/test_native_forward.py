"""The eager decode/verify forward of a Llama target as one C++ call (model/runner.py
``_native_forward``, model/native_draft.py ``llama_hidden``): with it on, every token and every
logprob is bitwise what the Python forward (LEAPFROG_NATIVE_FORWARD=0) gives, without speculation
and with EAGLE-3 chains and trees (the target's aux-layer features feed the head), for greedy,
seeded and unseeded sampled requests in one batch, on targets with q/k/v biases, GQA and a sliding
window; and the op is what serves those steps."""

from __future__ import annotations

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.model.native_draft import NativeLlamaForward
from leapfrog.model.native_linear import native_linear_supported
from tests.conftest import prompts_of
from tests.model.test_native_draft import heads  # noqa: F401  (the module's fixture)

pytestmark = pytest.mark.skipif(not native_linear_supported(torch.bfloat16, torch.device("cpu")),
                                reason="the op serves models on the bf16 linear kernel (AVX-512 BF16 or AVX2)")

SPECS = {None: None,
         "chain": {"num_speculative_tokens": 4, "eagle_topk": 1},
         "tree": {"num_speculative_tokens": 4, "eagle_topk": 3, "num_draft_tokens": 10}}


def _outputs(llm: LLM, prompts: list[list[int]]) -> list:
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True, logprobs=3)
    unseeded = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    got = []
    for ps, sp in [(prompts, greedy), (prompts, [seeded, greedy, unseeded])]:
        for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False):
            c = o.outputs[0]
            got.append((c.token_ids, None if c.logprobs is None else
                        [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]))
    return got


@pytest.mark.parametrize("shape,spec", [("qwen2", None), ("gqa_window", None), ("qwen2", "chain"),
                                        ("gqa_window", "tree")])
def test_native_target_forward_is_the_python_forward(heads, tokenizer, shape, spec, monkeypatch):  # noqa: F811
    target, head = heads[shape]
    prompts = prompts_of(tokenizer, 3)
    calls = []
    fn = NativeLlamaForward.hidden
    monkeypatch.setattr(NativeLlamaForward, "hidden", lambda self, *a, **kw: calls.append(a[0].shape) or fn(self, *a, **kw))
    runs, counts = {}, {}
    for native in ("0", "1"):
        with monkeypatch.context() as m:
            m.setenv("LEAPFROG_NATIVE_FORWARD", native)
            config = None if spec is None else {"method": "eagle3", "model": str(head), **SPECS[spec]}
            llm = LLM(model=str(target), dtype="bfloat16", max_model_len=128, max_num_seqs=3, seed=3,
                      speculative_config=config)
            before = len(calls)
            torch.manual_seed(0)
            runs[native] = _outputs(llm, prompts)
            served = calls[before:]
        if native == "0":
            assert not served
        else:   # decode steps (S = 1) and verification (S = K + 1) of up to 3 sequences (with a
            # head, the prompts too: their aux-layer features are read for every token)
            assert len(served) > 20 and max(s[0] for s in served) == 3 and (3, 1) in served
            verify = {None: 0, "chain": 5, "tree": 11}[spec]   # K + 1 rows, a tree's nodes + 1 (tree mask)
            assert any(s[1] == verify for s in served) == (spec is not None)
        m = llm.get_metrics()
        # (greedy and seeded requests are verified by matching: their tokens do not show the drafts;
        # the same drafts from the same target features show in the counts)
        counts[native] = (m["num_draft_tokens"], m["num_accepted_tokens"])
        if spec is not None:
            assert m["num_accepted_tokens"] > 0
    assert runs["0"] == runs["1"]
    assert counts["0"] == counts["1"]
