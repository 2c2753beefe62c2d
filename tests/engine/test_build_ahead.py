"""The engine builds its C++ op libraries ahead (LLMEngine._build_ops_ahead, utils/cpp.py
build_ahead): its guess from the configuration is the set of libraries the run then loads, for the
built-in default (bf16, an EAGLE-3 chain) and for a float32 model without speculation; a
sampled request also loads the verify op library (which draws plain decode's tokens too, and races
seeded ones), whose build starts ahead where the caller expects sampled requests (leapfrog serve) or else
at the first such request, during its prefill. Each case runs in a fresh process (the libraries' memos are process-wide), with
build_ahead recording the guess instead of building, so the memos show what the run itself loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from leapfrog.demo import save_random_llama

SCRIPT = r"""
import json, sys
from leapfrog.engine import engine as E
guessed = []
E.build_ahead = lambda loaders: guessed.extend(f.__name__ for f in loaders)
from leapfrog import LLM, SamplingParams
from leapfrog.attention import native as attention
from leapfrog.model import native_draft, native_linear, native_ops
from leapfrog.spec_decode.verify import native as verify
model, temperature, serving = sys.argv[1] or None, float(sys.argv[2]), sys.argv[3] == "serve"
seed = int(sys.argv[4]) if sys.argv[4] != "-" else None
llm = LLM(model=model, max_model_len=256)
if serving:   # (what leapfrog serve does: the OpenAI API's default temperature is 1)
    llm.engine.expect_sampled_requests()
llm.generate(["def f(x):"], SamplingParams(temperature=temperature, seed=seed, max_tokens=24, ignore_eos=True), use_tqdm=False)
used = {"load_native_linear": "ok" in native_linear._STATE, "load_native_ops": "ok" in native_ops._STATE,
        "load_native_attention": "ok" in attention._STATE, "load_native_draft": native_draft._LIBRARY._ok is not None,
        "load_native_verify": verify._LIBRARY._ok is not None}
print(json.dumps({"guessed": guessed, "used": [k for k, v in used.items() if v]}))
"""


def _run(model: str, temperature: float, env: dict[str, str] | None = None, serve: bool = False,
         seed: int | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, model, str(temperature), "serve" if serve else "-",
                          "-" if seed is None else str(seed)],
                         capture_output=True, text=True,
                         timeout=600, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_guess_is_what_the_built_in_default_loads(temperature):
    got = _run("", temperature)
    # (a sampled chain verified natively: its op's build starts at the first unseeded sampled request)
    assert got["guessed"] == got["used"], got
    assert ("load_native_verify" in got["used"]) == bool(temperature)
    assert "load_native_draft" in got["used"]   # (the chain drafted natively)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.7, None), (0.7, 5)])
def test_the_guess_is_what_a_float32_model_without_speculation_loads(tmp_path, tokenizer, temperature, seed):
    """(A seeded request's tokens are raced by the verify library's other op: loaded too.)"""
    model = save_random_llama(tmp_path / "m", tokenizer, seed=2)
    got = _run(str(model), temperature, seed=seed)
    assert got["guessed"] == got["used"], got
    # (plain decode's sampled tokens are drawn by the verify op too)
    assert "load_native_draft" not in got["used"] and ("load_native_verify" in got["used"]) == bool(temperature)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("switch", ["LEAPFROG_NATIVE_LINEAR", "LEAPFROG_NATIVE_ATTENTION"])
def test_the_guess_follows_the_switches(switch):
    """With the few-row kernel or the attention op switched off, neither it nor the one-call
    forwards' library (which needs both) is built ahead: the guess is still what the run loads."""
    got = _run("", 0.0, {switch: "0"})
    assert got["guessed"] == got["used"], got
    assert "load_native_draft" not in got["guessed"]


@pytest.mark.timeout(900)
def test_a_server_builds_the_sampled_verify_op_ahead_too():
    """leapfrog serve expects sampled requests (engine.expect_sampled_requests): with speculation,
    the sampled-chain verify op is built ahead as well, and a sampled request then loads it."""
    got = _run("", 0.7, serve=True)
    assert got["guessed"] == got["used"] and "load_native_verify" in got["guessed"], got
