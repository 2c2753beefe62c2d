"""Tiny real checkpoints (safetensors + config.json + tokenizer files) made with transformers'
config classes; transformers' own model classes are the oracle for our model math."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from leapfrog.demo import build_tokenizer, save_random_llama, stdlib_sample_text

# Two threads; one per worker when pytest-xdist runs the suite in two processes (the README's test
# command, `-n 2`: the suite is mostly single-threaded Python, compiling graphs and building tiny
# models, so two workers take 10 minutes where one process took 17 on 2 cores). The servers and
# ranks the tests start inherit one thread too, so the two workers never oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)


def pytest_runtest_setup(item):
    """CI's time budget: past LEAPFROG_SLOW_DEADLINE (seconds since the epoch; .ci/run sets it)
    the remaining slow tests are skipped, so CI ends inside its time limit on slower machines."""
    deadline = os.environ.get("LEAPFROG_SLOW_DEADLINE")
    if deadline and item.get_closest_marker("slow") is not None and time.time() > float(deadline):
        pytest.skip("CI's time budget for slow tests is spent (LEAPFROG_SLOW_DEADLINE)")

@pytest.fixture
def load_script(monkeypatch):
    """-> load(relpath): a script of the repository (benchmarks/, scripts/) imported as a module,
    in sys.modules for the test's duration only (its dataclasses look their module up)."""
    def load(relpath: str):
        path = Path(__file__).resolve().parents[1] / relpath
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, mod)
        spec.loader.exec_module(mod)
        return mod
    return load


# initializer_range 0.2 makes random models' distributions peaked, so argmax near-ties are rare.
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CONFIGS = {
    "llama_gqa_llama3": dict(arch="llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "llama_untied": dict(arch="llama", tie_word_embeddings=False, num_key_value_heads=4),
    "mistral": dict(arch="mistral", sliding_window=None),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=False),
}


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(stdlib_sample_text(60_000), vocab_size=320)


def save_shapes(tmp_path_factory, tokenizer, configs: dict[str, dict]) -> dict:
    """{name: checkpoint dir} of random-init models, one per config (``arch`` + BASE overrides)."""
    out = {}
    for name, cfg in configs.items():
        cfg = dict(cfg)
        arch = cfg.pop("arch")
        out[name] = save_random_llama(tmp_path_factory.mktemp(name), tokenizer, arch=arch, seed=1,
                                      **{**BASE, **cfg})
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    return save_shapes(tmp_path_factory, tokenizer, CONFIGS)


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama_gqa_llama3"]


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, tokenizer):
    """An unrelated smaller random model with the same tokenizer."""
    return save_random_llama(tmp_path_factory.mktemp("draft"), tokenizer, seed=7, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.2)


def greedy_baseline(model_dir, tokenizer, n: int, max_tokens: int):
    """(LLM without speculation, n prompts, their greedy outputs, fp32, ignoring EOS): the
    reference the lossless tests compare speculation with."""
    from leapfrog import LLM, SamplingParams
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=8)
    prompts = prompts_of(tokenizer, n)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def prompts_of(tokenizer, n: int = 4) -> list[list[int]]:
    texts = ["def foo(x):\n    return", "import os", "class A:\n    def __init__(self):\n        self.x = 1\n",
             "for i in range(10):", "# comment", "x = [1, 2, 3]\ny = x[::-1]\nprint(y)", "while True:", "a"]
    return [tokenizer.encode(t) for t in texts[:n]]
