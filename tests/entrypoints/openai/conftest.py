"""A real leapfrog server (uvicorn on 127.0.0.1, a free port) in a background thread."""

from __future__ import annotations

import pytest

from leapfrog.config import EngineConfig
from leapfrog.engine.engine import LLMEngine
from leapfrog.entrypoints.openai.api_server import build_app
from leapfrog.entrypoints.openai.server_thread import ServerThread

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def make_server(model_dir, spec=SPEC, api_key=None, max_num_seqs=8, max_waiting=256, max_model_len=256):
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs, speculative_config=spec))
    return ServerThread(build_app(engine, "tiny", api_key=api_key, max_waiting=max_waiting))


def greedy_text(model_dir, prompt: str, max_tokens: int) -> str:
    """The offline engine's greedy text for ``prompt`` (ignoring EOS): what the server must answer."""
    from leapfrog import LLM, SamplingParams
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256)
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def server(llama_dir):
    with make_server(llama_dir) as s:
        yield s
