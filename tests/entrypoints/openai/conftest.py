"""A real leapfrog server (uvicorn on 127.0.0.1, a free port) in a background thread."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from leapfrog.config import EngineConfig
from leapfrog.engine.engine import LLMEngine
from leapfrog.entrypoints.openai.api_server import build_app

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


class ServerThread:
    def __init__(self, app) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def make_server(model_dir, spec=SPEC, api_key=None, max_num_seqs=8, max_waiting=256, max_model_len=256):
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs, speculative_config=spec))
    return ServerThread(build_app(engine, "tiny", api_key=api_key, max_waiting=max_waiting))


@pytest.fixture(scope="module")
def server(llama_dir):
    with make_server(llama_dir) as s:
        yield s
