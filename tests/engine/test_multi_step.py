"""Multi-step decode (EngineConfig.num_scheduler_steps): several decode steps per engine step in
one compiled graph give the tokens one-token steps give (float32): greedy, seeded and unseeded
sampling (the same draws of the same randomness), with stops, lengths, the cache's end and
steps that must run one token at a time handled as one-token steps handle them. With a draft
model or an EAGLE head, several speculation rounds per engine step give the target's greedy output."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from torch._dynamo.utils import counters

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError
from leapfrog.model import compiled, runner
from tests.conftest import prompts_of, save_shapes
from tests.spec_decode.test_eagle import SHAPES, make_head

MAX_LEN = 96
STEPS = 4


# (the engines here compile with inductor's own GEMM choice: autotuning the C++ GEMM templates
# would double their compile time; tests/model/test_compiled.py covers those)
FAST_COMPILE = {"max_autotune": False}


@pytest.fixture(scope="module")
def multi(llama_dir):
    with patch.dict(compiled.INDUCTOR_OPTIONS, FAST_COMPILE):
        return LLM(model=str(llama_dir), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=2,
                   enforce_eager=False, num_scheduler_steps=STEPS)


@pytest.fixture(scope="module")
def base(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=2)


def _outs(llm, prompts, sp):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


def test_multi_step_output_equals_one_token_steps(multi, base, tokenizer):
    """Greedy output, batched and ragged, with a max_tokens that is not a multiple of the steps,
    equals one-token eager steps; the multi-step graph did the decoding; nothing compiled while
    serving."""
    prompts = prompts_of(tokenizer, 3)
    sp = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    graphs = counters["stats"]["unique_graphs"]
    calls = multi.engine.runner.multi_step.direct[(2, 1)].calls
    got = _outs(multi, prompts, sp)
    want = _outs(base, prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert all(len(o.token_ids) == 23 and o.finish_reason == "length" for o in got)
    assert multi.engine.runner.multi_step.direct[(2, 1)].calls > calls
    assert counters["stats"]["unique_graphs"] == graphs


def test_stops_inside_a_multi_step_end_the_output_there(multi, base, tokenizer):
    """A stop token or stop string reached in the middle of a multi-step drops the tokens after it,
    exactly as one-token steps stop."""
    _check_stops(multi, base, prompts_of(tokenizer, 1)[0], 9)


def _check_stops(llm, base, prompt, at: int) -> None:
    """A stop token first reached at some index <= ``at`` and a stop string end ``llm``'s greedy
    output where they end ``base``'s."""
    free = _outs(base, [prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    for sp in (SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[free.token_ids[at]]),
               SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[free.text[-12:-6]])):
        got, want = _outs(llm, [prompt], sp)[0], _outs(base, [prompt], sp)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason)
        assert got.finish_reason == "stop" and len(got.token_ids) < 30


def _run(llm, prompt, sp, generator_seed):
    """Run one request alone on the engine, its generator (unseeded sampling) seeded as given."""
    eng = llm.engine
    req = eng.add_request(f"r{generator_seed}-{id(sp)}", None, prompt, sp)
    req.generator.manual_seed(generator_seed)
    while eng.has_unfinished():
        eng.step()
    return req.output_ids


def test_sampling_draws_what_one_token_steps_draw(multi, base, tokenizer):
    """Seeded and unseeded sampled requests (temperature only), alone and batched with a greedy
    one, draw in the multi-step graph the tokens one-token steps draw with the same randomness
    (the seeded request's position noise, the unseeded one's generator stream); a request with
    top-k decodes one token at a time, with the same output as the eager engine's."""
    prompts = prompts_of(tokenizer, 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=21, ignore_eos=True)
    calls = multi.engine.runner.multi_step.direct[(2, 1)].calls
    outs = multi.generate([{"prompt_token_ids": p} for p in prompts[:2]], [greedy, seeded], use_tqdm=False)
    assert multi.engine.runner.multi_step.direct[(2, 1)].calls > calls
    assert outs[0].outputs[0].token_ids == _outs(base, prompts[:1], greedy)[0].token_ids
    assert outs[1].outputs[0].token_ids == _outs(base, prompts[1:2], seeded)[0].token_ids
    unseeded = SamplingParams(temperature=2, max_tokens=19, ignore_eos=True)   # (an int temperature)
    got, want = _run(multi, prompts[2], unseeded, 11), _run(base, prompts[2], unseeded, 11)
    assert got == want and len(got) == 19
    assert _run(multi, prompts[2], unseeded, 12) != got   # (another stream, another output)
    top_k = SamplingParams(temperature=0.9, top_k=5, seed=2, max_tokens=12, ignore_eos=True)
    calls = multi.engine.runner.multi_step.direct[(1, 1)].calls
    assert _outs(multi, prompts[:1], top_k)[0].token_ids == _outs(base, prompts[:1], top_k)[0].token_ids
    assert multi.engine.runner.multi_step.direct[(1, 1)].calls == calls


def test_the_cache_end_takes_one_token_steps(multi, base, tokenizer):
    """The last steps before the context's end, where the graph's last column would not fit, run
    one token at a time: output up to the end equals one-token steps'."""
    prompt = prompts_of(tokenizer, 1)[0]
    for sp in (SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
               SamplingParams(temperature=0.8, seed=9, max_tokens=None, ignore_eos=True)):
        got, want = _outs(multi, [prompt], sp)[0], _outs(base, [prompt], sp)[0]
        assert got.token_ids == want.token_ids
        assert len(got.token_ids) == MAX_LEN - len(prompt) and got.finish_reason == "length"


def test_multi_step_config_is_checked(llama_dir):
    with pytest.raises(ConfigError, match="enforce_eager=False"):
        LLM(model=str(llama_dir), num_scheduler_steps=4)
    for spec in ({"method": "ngram", "num_speculative_tokens": 2},
                 {"method": "eagle3", "model": str(llama_dir), "num_speculative_tokens": 2, "eagle_topk": 4},
                 {"method": "eagle3", "model": str(llama_dir), "num_speculative_tokens": 2, "eagle_topk": 2,
                  "num_draft_tokens": "auto", "speculative_token_tree": "[(0,), (1,)]"}):
        with pytest.raises(ConfigError, match="speculative_config"):
            LLM(model=str(llama_dir), num_scheduler_steps=4, enforce_eager=False, speculative_config=spec)
    for bad in (0, -1, 2.5, True, 33):
        with pytest.raises(ConfigError, match="num_scheduler_steps"):
            LLM(model=str(llama_dir), num_scheduler_steps=bad, enforce_eager=False)


K = 3


@pytest.fixture(scope="module")
def rounds(llama_dir):
    """Multi-step speculation: STEPS rounds of K drafts per graph. The draft is the target itself in
    bfloat16: mostly the target's own tokens, sometimes not (rounds accept all, some or none).
    Slow tests only: its graphs (the target's, the draft's, and the greedy and sampled rounds' for
    batches of 1 and 2) compile in 190-240 s on 2 cores, a third of the default suite's 10 minutes."""
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": K, "draft_dtype": "bfloat16"}
    with patch.dict(compiled.INDUCTOR_OPTIONS, FAST_COMPILE):
        return LLM(model=str(llama_dir), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=2,
                   enforce_eager=False, num_scheduler_steps=STEPS, speculative_config=spec)


def _round_calls(llm, batch, sampled=False):
    g = llm.engine.runner.sampled_round if sampled else llm.engine.runner.round
    return g.direct[(batch, g.k + 1)].calls


@pytest.mark.slow   # (the rounds fixture: 190-240 s of compiling on 2 cores)
def test_speculation_rounds_give_the_target_greedy_output(rounds, base, tokenizer):
    """Greedy output, batched and ragged, with a max_tokens inside a round, equals the target's
    own (one-token eager steps); the rounds graph did the decoding, its rounds accepted all, some
    and none of their drafts, and each round counts as one verification; nothing compiled while
    serving."""
    prompts = prompts_of(tokenizer, 3)
    sp = SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True)
    graphs = counters["stats"]["unique_graphs"]
    calls = _round_calls(rounds, 2)
    before = rounds.engine.spec_metrics.num_drafts
    got = _outs(rounds, prompts, sp)
    want = _outs(base, prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert all(len(o.token_ids) == 29 and o.finish_reason == "length" for o in got)
    assert _round_calls(rounds, 2) > calls
    m = rounds.engine.spec_metrics
    assert m.num_drafts - before >= _round_calls(rounds, 2) - calls   # each graph call: a verification
    per_pos = m.num_accepted_tokens_per_pos
    assert 0 < per_pos[-1] < per_pos[0] < m.num_drafts   # full, partial and empty acceptances
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow   # (the rounds fixture: 190-240 s of compiling on 2 cores)
def test_chained_rounds_equal_rounds_called_one_by_one(rounds):
    """The rounds' lean loop (direct calls whose inputs are built once, only the carried state
    swapped in) gives what calling the graph round by round through ``_serve`` gives, from the
    same state on the same (scratch) row, and counts its graph calls."""
    g, kv = rounds.engine.runner.round, rounds.engine.runner.kv
    args = (torch.tensor([[5, 6]]), torch.tensor([3]), torch.tensor([kv.scratch_row]))
    d = g.direct[(1, g.k + 1)]
    calls = d.calls
    with torch.inference_mode():
        chained = g.rounds(args, 3)
        assert d.calls == calls + 3
        one_by_one, a = [], args
        for _ in range(3):
            one_by_one.append(g._flatten(g(*a)))
            a = (*(one_by_one[-1][i] for i in g.carried), a[-1])
    for x, y in zip(chained, one_by_one):
        assert len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))
    assert int(chained[-1][4]) >= 3 + 3   # (each round advanced the column)


@pytest.mark.slow   # (64 s of compiling on 2 cores: the default suite stays near 10 minutes)
def test_adaptive_k_runs_rounds_when_it_picks_k(llama_dir, base, tokenizer):
    """An adaptive K with speculation rounds: the controller measures plain decode, then tries the
    rounds (K) and multi-step decode (no speculation) and weighs them by their measured times;
    greedy output equals the target's own."""
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": K, "draft_dtype": "bfloat16",
            "adaptive": True}
    with patch.dict(compiled.INDUCTOR_OPTIONS, FAST_COMPILE):
        llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=1,
                  enforce_eager=False, num_scheduler_steps=STEPS, speculative_config=spec)
    ctl = llm.engine.spec_controller
    assert ctl.round_k == K and ctl.round_sizes == (K, 0)   # (no speculation: multi-step decode)
    prompts = prompts_of(tokenizer, 2)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = [o.token_ids for o in _outs(llm, prompts, sp)]
    assert got == [o.token_ids for o in _outs(base, prompts, sp)]
    assert _round_calls(llm, 1) > 0 and ctl.round_samples[(1, K)] >= 2 and ctl.round_time[(1, K)] > 0
    assert llm.engine.runner.multi_step.direct[(1, 1)].calls > 0 and ctl.round_samples[(1, 0)] >= 1
    assert ctl.verify_cost[1].get(1) is not None   # (one-token plain steps measured first)


@pytest.mark.slow   # (the rounds fixture: 190-240 s of compiling on 2 cores)
def test_stops_and_other_requests_in_speculation_rounds(rounds, base, tokenizer):
    """A stop token or string reached inside a round drops the tokens after it, as one-token steps
    stop; a request with top-k in the batch makes the step run one round (seeded: the eager
    engine's output), and the cache's last rounds run one at a time up to the context's end."""
    prompt = prompts_of(tokenizer, 1)[0]
    calls = _round_calls(rounds, 1)
    _check_stops(rounds, base, prompt, 13)
    assert _round_calls(rounds, 1) > calls
    prompts = prompts_of(tokenizer, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    top_k = SamplingParams(temperature=0.9, top_k=4, seed=3, max_tokens=12, ignore_eos=True)
    calls = _round_calls(rounds, 2), _round_calls(rounds, 2, sampled=True)
    outs = rounds.generate([{"prompt_token_ids": p} for p in prompts], [greedy, top_k], use_tqdm=False)
    assert (_round_calls(rounds, 2), _round_calls(rounds, 2, sampled=True)) == calls
    assert outs[0].outputs[0].token_ids == _outs(base, prompts[:1], greedy)[0].token_ids
    assert outs[1].outputs[0].token_ids == _outs(base, prompts[1:], top_k)[0].token_ids
    sp = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    got, want = _outs(rounds, [prompt], sp)[0], _outs(base, [prompt], sp)[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == MAX_LEN - len(prompt)


@pytest.mark.slow   # (the rounds fixture: 190-240 s of compiling on 2 cores)
def test_sampled_speculation_rounds_draw_the_targets_tokens(rounds, base, tokenizer):
    """Temperature-only sampled requests run in the sampled rounds' graph, alone and batched with a
    greedy one: a seeded request's output is exactly its output without speculation (the target's
    race winner with its position noise at every output position, whatever was drafted), up to the
    cache's end too; an unseeded one's tokens come from its own generator (another stream, another
    output), and the rounds accepted some drafts and rejected others."""
    prompts = prompts_of(tokenizer, 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=27, ignore_eos=True)
    graphs = counters["stats"]["unique_graphs"]
    calls = _round_calls(rounds, 2, sampled=True)
    m = rounds.engine.spec_metrics
    before = m.num_drafts, m.num_accepted_tokens, m.num_draft_tokens
    outs = rounds.generate([{"prompt_token_ids": p} for p in prompts[:2]], [greedy, seeded], use_tqdm=False)
    assert _round_calls(rounds, 2, sampled=True) > calls
    assert outs[0].outputs[0].token_ids == _outs(base, prompts[:1], greedy)[0].token_ids
    assert outs[1].outputs[0].token_ids == _outs(base, prompts[1:2], seeded)[0].token_ids
    accepted, drafted = m.num_accepted_tokens - before[1], m.num_draft_tokens - before[2]
    assert 0 < accepted < drafted
    calls = _round_calls(rounds, 1, sampled=True)
    for sp in (SamplingParams(temperature=1, seed=8, max_tokens=None, ignore_eos=True),   # (an int temperature)
               SamplingParams(temperature=0.6, seed=2, max_tokens=18, ignore_eos=True, stop_token_ids=[])):
        got, want = _outs(rounds, prompts[2:], sp)[0], _outs(base, prompts[2:], sp)[0]
        assert got.token_ids == want.token_ids
    assert len(got.token_ids) == 18 and _round_calls(rounds, 1, sampled=True) > calls
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    a, b = _run(rounds, prompts[2], unseeded, 11), _run(rounds, prompts[2], unseeded, 12)
    assert len(a) == len(b) == 20 and a != b
    assert _run(rounds, prompts[2], unseeded, 11) == a   # (the same stream, the same draws)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_no_sampled_rounds_when_their_noise_would_not_fit(llama_dir, base, tokenizer):
    """Sampled rounds whose race noise (steps x (K + 1) x V float64 per sequence) exceeds the
    budget are not compiled: sampled steps run one round, with the same seeded output."""
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": K, "draft_dtype": "bfloat16"}
    with patch.dict(compiled.INDUCTOR_OPTIONS, FAST_COMPILE), patch.object(runner, "SAMPLED_ROUNDS_MAX_NOISE_BYTES", 1):
        llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=1,
                  enforce_eager=False, num_scheduler_steps=STEPS, speculative_config=spec)
    assert llm.engine.runner.round is not None and llm.engine.runner.sampled_round is None
    prompt = prompts_of(tokenizer, 1)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    assert _outs(llm, prompt, seeded)[0].token_ids == _outs(base, prompt, seeded)[0].token_ids


@pytest.fixture(scope="module")
def eagle_target(tmp_path_factory, tokenizer):
    """A target with the three layers EAGLE-3 fuses, and its engine without speculation."""
    path = save_shapes(tmp_path_factory, tokenizer, {"t3": SHAPES["llama_gqa_llama3"]})["t3"]
    return path, LLM(model=str(path), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=2)


@pytest.mark.slow   # (a minute each: the default suite stays near 10 minutes)
@pytest.mark.parametrize("kind,seqs", [("eagle3", 1), ("eagle3", 2), ("eagle", 2)])
def test_eagle_rounds_give_the_target_greedy_output(eagle_target, tmp_path, tokenizer, kind, seqs):
    """EAGLE heads' chains in speculation rounds (CompiledEagleRound: the head's pending positions
    and the target's features of them carried from round to round): greedy output, batched and
    ragged (``seqs`` 2), equals the target's own; the rounds graph ran, and the head went on from
    the rounds' state in the one-round steps at the end; seeded sampled output in the sampled
    rounds' graph equals the target's own; nothing compiles while serving."""
    target, base = eagle_target
    head = make_head(target, tmp_path / "h", kind, **({"draft_vocab_size": 200} if kind == "eagle3" else {}))
    spec = {"method": kind, "model": str(head), "num_speculative_tokens": K, "eagle_topk": 1}
    with patch.dict(compiled.INDUCTOR_OPTIONS, FAST_COMPILE):
        llm = LLM(model=str(target), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=seqs, enforce_eager=False,
                  num_scheduler_steps=STEPS, speculative_config=spec)
    graphs = counters["stats"]["unique_graphs"]
    prompts = prompts_of(tokenizer, 3)
    sp = SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True)
    assert [o.token_ids for o in _outs(llm, prompts, sp)] == [o.token_ids for o in _outs(base, prompts, sp)]
    calls = sum(_round_calls(llm, b) for b in range(1, seqs + 1))
    assert _round_calls(llm, seqs) > 0 and llm.get_metrics()["num_draft_tokens"] >= K * calls
    drafted = llm.get_metrics()["num_draft_tokens"]
    sp = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)   # up to the cache's end:
    got, want = _outs(llm, prompts[:1], sp)[0], _outs(base, prompts[:1], sp)[0]   # one-round steps there
    assert got.token_ids == want.token_ids and len(got.token_ids) == MAX_LEN - len(prompts[0])
    calls = sum(_round_calls(llm, b) for b in range(1, seqs + 1)) - calls
    assert llm.get_metrics()["num_draft_tokens"] - drafted > K * calls   # (drafts outside the rounds too)
    seeded = SamplingParams(temperature=0.8, seed=4, max_tokens=25, ignore_eos=True)   # sampled rounds:
    calls = _round_calls(llm, seqs, sampled=True)                                        # the seeded draws
    assert [o.token_ids for o in _outs(llm, prompts, seeded)] == [o.token_ids for o in _outs(base, prompts, seeded)]
    assert _round_calls(llm, seqs, sampled=True) > calls
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_auto_tree_sizes_run_chain_rounds(eagle_target, tmp_path, tokenizer):
    """EAGLE "auto" tree sizes with speculation rounds: when the controller picks the chain of the
    depth, the rounds graph runs it (several rounds per engine step); trees run one round; steps
    without drafts run as multi-step decode, which hands the head the target's states; greedy
    output equals the target's own."""
    target, base = eagle_target
    head = make_head(target, tmp_path / "h", "eagle3", draft_vocab_size=200)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K, "eagle_topk": 2,
            "num_draft_tokens": "auto"}
    with patch.dict(compiled.INDUCTOR_OPTIONS, FAST_COMPILE):
        llm = LLM(model=str(target), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=1, enforce_eager=False,
                  num_scheduler_steps=STEPS, speculative_config=spec)
    ctl = llm.engine.spec_controller
    assert ctl.round_k == K and llm.engine.runner.round.k == K and ctl.round_sizes == (K, 0)
    ready: list[bool] = []   # after each multi-step decode: whether the head can draft for its requests
    decode_steps, proposer = llm.engine._decode_steps, llm.engine.proposer

    def recording(reqs):
        ran = decode_steps(reqs)
        if ran:   # (the states of every position up to the newest token's, none of them zeros)
            for r in reqs:
                if r.request_id in llm.engine.requests:
                    f = proposer.feats.get(r.request_id)
                    ready.append(f is not None and f.end == r.num_tokens - 1 and bool(f.rows().abs().sum(-1).all()))
        return ran
    llm.engine._decode_steps = recording
    prompts = prompts_of(tokenizer, 2)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert [o.token_ids for o in _outs(llm, prompts, sp)] == [o.token_ids for o in _outs(base, prompts, sp)]
    assert _round_calls(llm, 1) > 0 and ctl.round_samples[(1, K)] >= 1
    # multi-step decode (no speculation) ran and handed the head the target's states of its steps
    # (without them the head would draft from zero features: EagleProposer._ready)
    assert llm.engine.runner.multi_step.direct[(1, 1)].calls > 0 and ctl.round_samples[(1, 0)] >= 1
    assert ready and all(ready)


@pytest.mark.slow
def test_builtin_eagle3_rounds_accept_and_stay_lossless(tokenizer):
    """The built-in target and its trained EAGLE-3 head (float32), 8 rounds per engine step: the
    rounds accept most drafts, and greedy output equals the target's own."""
    from leapfrog.demo import DEMO_DIR
    spec = {"method": "eagle3", "model": str(DEMO_DIR / "eagle3"), "num_speculative_tokens": 4, "eagle_topk": 1}
    with patch.dict(compiled.INDUCTOR_OPTIONS, FAST_COMPILE):
        llm = LLM(model=str(DEMO_DIR / "target"), dtype="float32", max_model_len=160, max_num_seqs=1,
                  enforce_eager=False, num_scheduler_steps=8, speculative_config=spec)
    base = LLM(model=str(DEMO_DIR / "target"), dtype="float32", max_model_len=160, max_num_seqs=1)
    prompts = ["def quicksort(arr):", "import os\n\n\ndef main(", "class Stack:\n    def __init__(self"]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    assert _round_calls(llm, 1) > 0 and llm.get_metrics()["acceptance_rate"] > 0.3
