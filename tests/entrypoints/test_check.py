"""`leapfrog check`: passes on correct speculative configs, fails on deliberately broken verifiers.

Broken verifiers are made test-only by monkeypatching the names the engine imported
(``leapfrog.engine.engine.greedy_accept`` / ``rejection_accept``):
- greedy: the first draft token is accepted even when it is not the target's argmax;
- sampling: after a rejection the final token is drawn from p instead of norm(max(p - q, 0))
  (the residual is skipped), or the bonus token is drawn from the last draft's q instead of p.
Sampling uses a tiny-vocabulary target (V = 12, as tests/spec_decode/test_sampling_lossless.py) so that
2000 samples give the chi-square tests power.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import leapfrog.engine.engine as engine_mod
from leapfrog.demo import save_random_llama
from leapfrog.entrypoints.check import (DEFAULT_PROMPTS, QUICK_SAMPLES, CheckReport, Mismatch, build_llms,
                                        check_greedy, check_sampling, chi2_two_sample, classify_margin,
                                        detectable_shift, pinned_sizes)
from leapfrog.entrypoints.cli import main
from leapfrog.model.eagle import init_eagle_head, save_eagle_head
from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.spec_decode.verify.greedy import greedy_accept
from leapfrog.spec_decode.verify.rejection import rejection_accept
from leapfrog.spec_decode.verify.result import AcceptanceResult

V = 12
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.6, bos_token_id=0,
             eos_token_id=None)
TINY_PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8]]
ALPHA = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    t = save_random_llama(tmp_path_factory.mktemp("chk_t"), None, seed=3, **SMALL)
    # The draft: the target's architecture and seed with larger initial weights, so q ranks tokens
    # much like p but is more peaked. Acceptance is high (~0.7), so both the residual (after a
    # rejection) and the bonus (after acceptance) paths run often and their bugs show. (An unrelated
    # draft is accepted ~2% of the time: skipping the residual then barely changes the output.)
    d = save_random_llama(tmp_path_factory.mktemp("chk_d"), None, seed=3, **{**SMALL, "initializer_range": 0.9})
    return t, d


def _spec(kind, draft, k):
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


# ------------------------------------------------------------------ broken verifiers (test-only)
def accept_first_draft(target_argmax, draft_ids, num_draft):
    """Greedy bug: the first draft is accepted even when it differs from the argmax."""
    res = greedy_accept(target_argmax, draft_ids, num_draft)
    r = t = 0
    for b, k in enumerate(num_draft):
        if k and res.num_accepted[b] == 0:
            res.num_accepted[b] = 1
            res.output_ids[b] = [draft_ids[t], target_argmax[r + 1]]
        r += k + 1
        t += k
    return AcceptanceResult(res.num_accepted, res.output_ids, res.num_draft)


def skip_residual(p, q, draft_ids, num_draft, u):
    """Sampling bug: after a rejection the final token comes from p, not norm(max(p - q, 0))."""
    out = rejection_accept(p, q, draft_ids, num_draft, u)
    s = 0
    for b, k in enumerate(num_draft):
        if out.num_accepted[b] < k:
            out.final_probs[b] = p[s + out.num_accepted[b]]
        s += k + 1
    return out


def bonus_from_q(p, q, draft_ids, num_draft, u):
    """Sampling bug: the bonus token is drawn from the last draft's q instead of the target's p."""
    out = rejection_accept(p, q, draft_ids, num_draft, u)
    t = 0
    for b, k in enumerate(num_draft):
        if k and out.num_accepted[b] == k and q is not None:
            out.final_probs[b] = q[t + k - 1]
        t += k
    return out


# ------------------------------------------------------------------ pure parts
def test_chi2_two_sample_and_margin_classes():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(20))
    a, b = rng.multinomial(3000, p), rng.multinomial(3000, p)
    assert chi2_two_sample(a, b)[2] > 1e-3
    c = rng.multinomial(3000, np.roll(p, 1))
    assert chi2_two_sample(a, c)[2] < 1e-10
    assert chi2_two_sample(np.array([50, 0]), np.array([50, 0]))[2] == 1.0   # one bin: nothing to test
    assert classify_margin(2e-6, 10.0, 1e-3)[1] == "near-tie"
    assert classify_margin(0.5, 10.0, 1e-3)[1] == "MISMATCH"
    tie = Mismatch(0, 3, 5, 6, 1.0, 1.0 - 1e-7, 1e-7, 1e-7, "near-tie")
    rep = CheckReport("m", {}, "float32", greedy_mismatches=[tie])
    assert rep.passed                                                          # near-ties do not fail
    rep.greedy_mismatches.append(Mismatch(1, 0, 5, 6, 3.0, 1.0, 2.0, 0.2, "MISMATCH"))
    assert not rep.passed


# ------------------------------------------------------------------ greedy
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_greedy_passes_on_correct_config(llama_dir, draft_dir, kind):
    base, spec = build_llms(str(llama_dir), _spec(kind, draft_dir, 3), max_num_seqs=8, max_model_len=96)
    assert check_greedy(base, spec, DEFAULT_PROMPTS, max_tokens=24) == []
    assert spec.get_metrics()["num_draft_tokens"] > 0


def test_greedy_bf16_batch_invariant(llama_dir, draft_dir):
    """--batch-invariant: both engines bitwise batch-invariant, so bf16 greedy has no divergence at all."""
    base, spec = build_llms(str(llama_dir), _spec("draft_model", draft_dir, 3), dtype="bfloat16", max_num_seqs=8,
                            max_model_len=96, batch_invariant=True)
    assert base.engine.config.batch_invariant and spec.engine.config.batch_invariant
    assert check_greedy(base, spec, DEFAULT_PROMPTS, max_tokens=24) == []


def test_greedy_detects_broken_accept(llama_dir, draft_dir, monkeypatch):
    base, spec = build_llms(str(llama_dir), _spec("ngram", draft_dir, 3), max_num_seqs=8, max_model_len=96)
    monkeypatch.setattr(engine_mod, "greedy_accept", accept_first_draft)
    found = check_greedy(base, spec, DEFAULT_PROMPTS, max_tokens=24)
    assert found and all(m.kind == "MISMATCH" for m in found)
    m = found[0]
    assert m.base_token != m.spec_token and m.margin > 0 and m.relative_margin > 1e-3  # base is the argmax


# ------------------------------------------------------------------ sampling
def _min_p(results):
    tested = [r for r in results if r.dof > 0]
    assert tested
    return min(r.p_value for r in tested), len(tested)


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_sampling_passes_on_correct_config(tiny, kind):
    target, draft = tiny
    base, spec = build_llms(str(target), _spec(kind, draft, 2), skip_tokenizer_init=True, max_model_len=16)
    res = check_sampling(base, spec, TINY_PROMPTS[:1], "temperature=1.0", samples=2000, num_tokens=3)
    assert spec.get_metrics()["num_draft_tokens"] > 0
    p, n = _min_p(res)
    assert p >= ALPHA / n


@pytest.mark.parametrize("bug", [skip_residual, bonus_from_q], ids=["skip_residual", "bonus_from_q"])
def test_sampling_detects_broken_verifier(tiny, monkeypatch, bug):
    target, draft = tiny
    base, spec = build_llms(str(target), _spec("draft_model", draft, 1), skip_tokenizer_init=True,
                            max_model_len=16)
    monkeypatch.setattr(engine_mod, "rejection_accept", bug)
    monkeypatch.setattr(spec.engine, "_native_verify", False)   # (the Python verifier the bug is in)
    res = check_sampling(base, spec, TINY_PROMPTS, "temperature=1.0", samples=2000, num_tokens=3)
    p, n = _min_p(res)
    assert p < ALPHA / n * 1e-3                          # far below the Bonferroni threshold
    assert res[0].p_value > 1e-6                         # token 1 (prefill) is untouched by the bug


# ------------------------------------------------------------------ command line
def _prompts_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in TINY_PROMPTS))
    return f


def _cli(target, draft, tmp_path, *extra):
    spec = json.dumps(_spec("draft_model", draft, 2))
    return main(["check", "--model", str(target), "--speculative-config", spec, "--skip-tokenizer-init",
                 "--prompts-file", str(_prompts_file(tmp_path)), "--max-tokens", "16", "--samples", "1000",
                 "--positions", "2", "--setting", "temperature=1.0", *extra])


def _cli_json(target, spec, tmp_path, samples):
    """`leapfrog check` on the tiny prompts (16 greedy tokens, ``samples`` at T = 1) -> (exit code, JSON report)."""
    out_json = tmp_path / "report.json"
    rc = main(["check", "--model", str(target), "--speculative-config", json.dumps(spec), "--skip-tokenizer-init",
               "--prompts-file", str(_prompts_file(tmp_path)), "--max-tokens", "16", "--samples", str(samples),
               "--setting", "temperature=1.0", "--no-progress", "--json", str(out_json)])
    return rc, json.loads(out_json.read_text())


def test_cli_passes_and_writes_json(tiny, tmp_path, capsys):
    target, draft = tiny
    out_json = tmp_path / "report.json"
    rc = _cli(target, draft, tmp_path, "--json", str(out_json))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2/2 prompts token-for-token identical" in out and "RESULT: PASS" in out
    assert "Bonferroni" in out and "8 two-sample chi-square tests" in out
    rep = json.loads(out_json.read_text())
    assert rep["passed"] and len(rep["sampling_tests"]) == 8 and rep["greedy_mismatches"] == []


def test_cli_fails_on_broken_verifiers(tiny, tmp_path, capsys, monkeypatch):
    target, draft = tiny
    monkeypatch.setattr(engine_mod, "greedy_accept", accept_first_draft)
    monkeypatch.setattr(engine_mod, "rejection_accept", skip_residual)
    monkeypatch.setenv("LEAPFROG_NATIVE_VERIFY", "0")   # (the Python verifier the bug is in)
    rc = _cli(target, draft, tmp_path)
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "-> MISMATCH" in out and "greedy: FAIL" in out and "sampling: FAIL" in out
    assert "RESULT: FAIL" in out


def test_cli_quick_defaults_catch_a_gross_bug(tiny, tmp_path, capsys, monkeypatch):
    """The default (quick) sizes catch the bonus token drawn from q. (The subtler skip_residual
    needs the larger sizes above on the tiny model's flat distributions: the quick run's stated
    power is 0.15 of probability moved, and that bug moves less there.)"""
    target, draft = tiny
    monkeypatch.setattr(engine_mod, "rejection_accept", bonus_from_q)
    monkeypatch.setenv("LEAPFROG_NATIVE_VERIFY", "0")   # (the Python verifier the bug is in)
    spec = json.dumps(_spec("draft_model", draft, 2))
    rc = main(["check", "--model", str(target), "--speculative-config", spec, "--skip-tokenizer-init",
               "--prompts-file", str(_prompts_file(tmp_path)), "--max-tokens", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1 and "sampling: FAIL" in out, out
    assert f"{QUICK_SAMPLES} samples per engine" in out and "power: each test catches" in out


def test_cli_nothing_drafted_is_not_a_pass(tiny, tmp_path, capsys):
    """A config that drafts nothing (an n-gram of 20 tokens in sequences of at most 22) checks
    nothing: the result says so and the exit code is 3, not a PASS."""
    target, _ = tiny
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 20, "prompt_lookup_max": 20}
    rc, rep = _cli_json(target, spec, tmp_path, 50)
    out = capsys.readouterr().out
    assert rc == 3, out
    assert "RESULT: NOT TESTED" in out and "greedy and sampling part" in out and "RESULT: PASS" not in out
    assert rep["untested"] == ["greedy", "sampling"] and rep["passed"]


@pytest.fixture(scope="module")
def tiny_eagle3(tmp_path_factory):
    """A 3-layer tiny target (EAGLE-3 fuses three layers) and a random EAGLE-3 head for it."""
    t = save_random_llama(tmp_path_factory.mktemp("chk_e3t"), None, seed=3, **{**SMALL, "num_hidden_layers": 3})
    target = load_model(read_checkpoint(t), None, "cpu", 64)
    head = init_eagle_head("eagle3", target.args, seed=0, init_std=0.3)
    head.bind_target(target)
    return t, save_eagle_head(head, tmp_path_factory.mktemp("chk_e3h"))


def test_cli_adaptive_sizes_are_sampled_at_a_pinned_size(tiny_eagle3, tmp_path, capsys):
    """"num_draft_tokens": "auto" (and "adaptive": true) starts each batch size with plain steps and
    may draft nothing: the sampling part's short sequences (K + 2 tokens, a batch of 64) ran without
    a single draft, and the check said NOT TESTED for the config users are told to run. The
    sampling part now runs the sizes pinned at the most the controller may draft, and says so; the
    greedy part runs the config as given."""
    target, head = tiny_eagle3
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "eagle_topk": 2,
            "num_draft_tokens": "auto"}
    rc, rep = _cli_json(target, spec, tmp_path, 400)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "RESULT: PASS" in out and "the sampling part at the most the controller may draft a step (10 tokens)" in out
    # every sampled sequence drafted (before: 128 draft tokens over the 400 sequences here, and none
    # at all on the built-in pair, where the check said NOT TESTED)
    assert rep["sampling_spec_metrics"]["num_draft_tokens"] >= 400 and rep["untested"] == []


def test_pinned_sizes_fix_what_the_controller_would_choose():
    assert pinned_sizes({"method": "ngram", "num_speculative_tokens": 3}) is None   # fixed already
    fixed, n = pinned_sizes({"method": "ngram", "num_speculative_tokens": 3, "adaptive": True,
                             "adaptive_explore_interval": 4})
    assert fixed == {"method": "ngram", "num_speculative_tokens": 3} and n == 3
    head = {"method": "eagle3", "model": "h", "num_speculative_tokens": 5, "eagle_topk": 3}
    fixed, n = pinned_sizes({**head, "num_draft_tokens": "auto"})
    assert fixed == {**head, "num_draft_tokens": 39} and n == 39    # the grown tree: 3 + 4 x 9 nodes
    fixed, n = pinned_sizes({**head, "eagle_topk": 1, "adaptive": True})
    assert fixed == {**head, "eagle_topk": 1, "num_draft_tokens": 5} and n == 5   # a chain of the depth
    fixed, n = pinned_sizes({**head, "num_speculative_tokens": 7, "eagle_topk": 4, "num_draft_tokens": "auto"})
    assert n == 64   # (the most "auto" weighs)


def test_the_pinned_sampling_engine_shares_the_target_or_says_it_loaded_a_copy(tiny, monkeypatch):
    """build_sampling_llm: on the checked engine's loaded target where the engine allows it; where
    the target streams its weights beside a drafter (refused to engines sharing it) on a copy of
    its own, which the report's note names (it had raised NotShareable: `leapfrog check` with
    adaptive sizes failed on CPUs whose target outgrows the last-level cache)."""
    import torch

    from leapfrog import LLM
    from leapfrog.entrypoints.check import build_sampling_llm
    from leapfrog.model import native_linear
    if not native_linear.native_linear_supported(torch.bfloat16, "cpu"):
        pytest.skip("no bf16 linear kernel on this CPU (nothing streams)")
    target, draft = tiny
    spec = {**_spec("draft_model", draft, 2), "adaptive": True}
    kw = dict(dtype="bfloat16", max_num_seqs=2, max_model_len=64, skip_tokenizer_init=True)
    checked = LLM(model=str(target), speculative_config=spec, seed=1, **kw)
    llm, note = build_sampling_llm(str(target), spec, checked, **kw)
    assert llm.engine.model is checked.engine.model and "own copy" not in note
    monkeypatch.setattr(native_linear, "last_level_cache_bytes", lambda: 1)
    monkeypatch.setattr(native_linear, "kernel_streams", lambda: True)   # (as on AVX-512 builds)
    monkeypatch.delenv("LEAPFROG_STREAM_WEIGHTS", raising=False)
    llm, note = build_sampling_llm(str(target), spec, checked, **kw)
    assert llm.engine.model is not checked.engine.model
    assert "loaded its own copy of the target" in note and "streams its weights" in note
    got = llm.engine.config.speculative_config   # (the same pinned engine as when shared: check seed 0 + 1)
    assert got["num_speculative_tokens"] == 2 and "adaptive" not in got and llm.engine.config.seed == 1


def test_detectable_shift_shrinks_with_samples():
    a, b = detectable_shift(400, 1e-4), detectable_shift(1600, 1e-4)
    assert 0 < b < a < 0.5 and b == pytest.approx(a / 2, rel=1e-6)   # λ fixed: δ ∝ 1/sqrt(n)
    assert detectable_shift(400, 1e-6) > a                          # a stricter level needs a larger shift


def test_cli_too_few_samples_says_it_has_no_power(tiny, tmp_path, capsys):
    """With --samples 20 a test could not see even a whole token's probability move: the report
    says so instead of a 'detectable shift' above 1."""
    target, draft = tiny
    spec = json.dumps(_spec("draft_model", draft, 2))
    rc = main(["check", "--model", str(target), "--speculative-config", spec, "--skip-tokenizer-init",
               "--prompts-file", str(_prompts_file(tmp_path)), "--max-tokens", "0", "--samples", "20",
               "--no-progress"])
    out = capsys.readouterr().out
    assert rc in (0, 1) and "power: none to speak of: with 20 samples" in out and "catches" not in out, out


@pytest.mark.slow
def test_check_without_arguments_checks_the_builtin_pair(capsys):
    t0 = time.perf_counter()
    rc = main(["check", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert "built-in default model" in captured.err and "RESULT: PASS" in captured.out
    assert "8/8 prompts token-for-token identical" in captured.out and "drafted 0 tokens" not in captured.out
    assert time.perf_counter() - t0 < 240   # about a minute on 2 cores; generous for slow CI machines


def test_cli_bad_input_exit_2(tiny, tmp_path, capsys):
    target, _ = tiny
    base = ["check", "--model", str(target), "--skip-tokenizer-init", "--prompts-file", str(_prompts_file(tmp_path))]
    assert main(base + ["--speculative-config", '{"method": "nope", "num_speculative_tokens": 2}']) == 2
    assert "speculative_config.method" in capsys.readouterr().err
    assert main(base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}']) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err
    assert main(base + ["--speculative-config", "{oops"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(base + ["--speculative-config", "none"]) == 2
    assert "needs --speculative-config" in capsys.readouterr().err
    assert main(base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                        "--setting", "temperature=hot"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                        "--setting", "temperature=1,temperature=0.5"]) == 2   # (the last one won silently)
    assert "temperature is given twice" in capsys.readouterr().err
