"""Drafters with a forward of their own (a draft model, an EAGLE head) run it over a new prompt in
the step that prefills the target (engine: _drafters_prefill), so the first decode step does not
carry it; the first token's time is when that step ends. A drafter prefill that fails resets the
drafter for those requests, which catch up while decoding: the output is the same either way."""

from __future__ import annotations

import time

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.spec_decode import adaptive
from tests.conftest import prompts_of, save_shapes
from tests.spec_decode.test_eagle import SHAPES, make_head


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory, tokenizer):
    target = save_shapes(tmp_path_factory, tokenizer, {"llama_untied": SHAPES["llama_untied"]})["llama_untied"]
    return target, make_head(target, tmp_path_factory.mktemp("eagle3"), "eagle3", draft_vocab_size=200)


def _drain(eng) -> dict[str, list[int]]:
    """Step the engine until every request ends: request id -> output token ids."""
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return outs


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
@pytest.mark.parametrize("fail", [False, True])
def test_drafters_prefill_in_the_targets_prefill_step(target_and_head, tokenizer, method, fail):
    target, head = target_and_head
    spec = {"method": method, "model": str(target if method == "draft_model" else head), "num_speculative_tokens": 3,
            **({"eagle_topk": 1} if method == "eagle3" else {})}
    prompts = prompts_of(tokenizer, 2)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                          use_tqdm=False)]
    llm = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=2, speculative_config=spec)
    eng, prop = llm.engine, llm.engine.proposer
    real, ended = prop.prefill, []

    def prefill(reqs):
        if fail:
            raise RuntimeError("injected fault")
        real(reqs)
        ended.append(time.monotonic())
    prop.prefill = prefill
    reqs = [eng.add_request(f"r{i}", None, p, sp) for i, p in enumerate(prompts)]
    eng.step()   # both prompts prefilled (and, without the fault, the drafter's over them)
    for req, p in zip(reqs, prompts):
        assert len(req.output_ids) == 1
        # the draft model's cache: every prompt token; the head's: every prompt position but the last
        caught_up = 0 if fail else len(p) - (method == "eagle3")
        assert prop.computed[req.request_id] == caught_up
        if not fail:
            assert req.metrics.first_token_time >= ended[-1]
    outs = _drain(eng)
    assert [outs[f"r{i}"] for i in range(2)] == want
    assert llm.get_metrics()["num_draft_tokens"] > 0


def _alone_and_speculating(target, tokenizer, spec: dict, lengths: tuple[int, int]):
    """Two prompts, greedy sampling params for outputs of ``lengths`` tokens, the target's outputs
    alone, and an LLM of the target speculating with ``spec`` (a batch of 2 at most)."""
    prompts = prompts_of(tokenizer, 2)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    base = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in prompts], sps,
                                                          use_tqdm=False)]
    llm = LLM(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=2, speculative_config=spec)
    return prompts, sps, want, llm


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_drafters_prefill_waits_while_speculation_is_off(target_and_head, tokenizer, method):
    """Above disable_by_batch_size nothing is drafted, so a new prompt's drafter prefill waits;
    when the batch shrinks the drafter catches up on the whole request and drafts, and the
    output is the target's alone."""
    target, head = target_and_head
    spec = {"method": method, "model": str(target if method == "draft_model" else head), "num_speculative_tokens": 3,
            "disable_by_batch_size": 1, **({"eagle_topk": 1} if method == "eagle3" else {})}
    prompts, sps, want, llm = _alone_and_speculating(target, tokenizer, spec, (3, 16))
    eng, prop = llm.engine, llm.engine.proposer
    reqs = [eng.add_request(f"r{i}", None, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    eng.step()   # both prompts prefilled: a batch of 2 drafts nothing, so the drafter has not run
    assert all(prop.computed.get(r.request_id, 0) == 0 for r in reqs)
    outs = _drain(eng)
    assert [outs[f"r{i}"] for i in range(2)] == want
    assert llm.get_metrics()["num_draft_tokens"] > 0   # r1 drafted alone, after catching up


def test_steps_the_controller_leased_are_run_without_choosing(target_and_head, tokenizer):
    """While drafting is off at the batch's size, the engine runs the plain steps the controller
    promised (a lease, spec_decode/adaptive.py ``leased``) without asking it for sizes, and
    measures them when the lease ends (here: when the batch shrinks); the output is the
    target's, and the head drafts once the batch is small enough."""
    target, head = target_and_head
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "eagle_topk": 1,
            "disable_by_batch_size": 1}
    prompts, sps, want, llm = _alone_and_speculating(target, tokenizer, spec, (24, 40))
    eng, ctl = llm.engine, llm.engine.spec_controller
    asked: list[int] = []
    choose = ctl.choose
    ctl.choose = lambda reqs, *a, **kw: asked.append(len(reqs)) or choose(reqs, *a, **kw)
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        eng.add_request(f"r{i}", None, p, sp)
    outs = _drain(eng)
    assert [outs[f"r{i}"] for i in range(2)] == want
    assert 1 <= asked.count(2) <= 3                     # 23 steps of both: one in 17 chosen
    assert ctl.observations >= 23 and ctl.plain_host    # (every leased step measured)
    assert llm.get_metrics()["num_draft_tokens"] > 0    # r1 alone drafts


def test_no_target_states_while_leased_and_the_head_reads_zeros_there(target_and_head, tokenizer, monkeypatch):
    """While drafting is off at the batch's size, the target's states are not captured for the
    prompts nor on a leased step followed by another leased one (engine ``_capture``); when the
    batch shrinks and the head drafts, it catches up on the whole request reading the states that
    were captured at their positions and zeros everywhere else, and the output is the target's."""
    target, head = target_and_head
    monkeypatch.setattr(adaptive, "_LEASE_STEPS", 16)   # (leases shorter than the 39 steps of both: some captured)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "eagle_topk": 1,
            "disable_by_batch_size": 1}
    prompts, sps, want, llm = _alone_and_speculating(target, tokenizer, spec, (40, 56))
    eng, prop = llm.engine, llm.engine.proposer
    captured: dict[str, set[int]] = {"r0": set(), "r1": set()}
    real_plain, real_states = prop.on_plain_states, prop.on_target_states

    def on_plain_states(reqs, states):
        for r in reqs:
            captured[r.request_id].add(r.num_computed)
        real_plain(reqs, states)

    def on_target_states(req, start, states):
        captured[req.request_id].update(range(start, start + states.shape[0]))
        real_states(req, start, states)
    prop.on_plain_states, prop.on_target_states = on_plain_states, on_target_states
    read: dict[int, torch.Tensor] = {}   # r1's first catch-up: position -> the feature the head read
    real_step = prop.runner.step

    def step(chunks, **kw):
        for ch in chunks:
            if ch.row == eng.requests["r1"].row and ch.features is not None and not read.keys() & {ch.start}:
                read.update({ch.start + j: ch.features[j] for j in range(len(ch.token_ids))})
        return real_step(chunks, **kw)
    prop.runner.step = step
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        eng.add_request(f"r{i}", None, p, sp)
    outs = _drain(eng)
    assert [outs[f"r{i}"] for i in range(2)] == want
    assert llm.get_metrics()["num_draft_tokens"] > 0   # r1 drafted alone
    # 39 steps of both: a chosen step then 16 leased ones, the last of those captured, and r0's last
    both = set(captured["r0"])
    assert min(both) == len(prompts[0]) and 4 <= len(both) <= 6
    first = len(prompts[1]) + 40 - 1   # r1's positions 0..first-1 were written while r0 ran
    assert {c for c in captured["r1"] if c < first} == {c - len(prompts[0]) + len(prompts[1]) for c in both}
    assert first - 1 in captured["r1"]   # r0's last step (it ends there): r1's root feature when it drafts next
    # (the catch-up's forward reads all but the last few: the fused chain reads those itself)
    assert set(range(first - 8)) <= read.keys() and len(read.keys() & captured["r1"]) >= 4
    for pos in read.keys() & set(range(first)):
        assert bool(read[pos].any()) == (pos in captured["r1"]), pos
