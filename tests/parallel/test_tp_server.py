"""`leapfrog serve --tensor-parallel-size 2` as users run it: the official openai client, streaming,
a clean SIGTERM shutdown that takes the worker along, and a killed worker that ends the server
with an error within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from leapfrog import LLM, SamplingParams
from tests.entrypoints.openai.test_serve_cli import free_port, start_serve

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


def _children(pid: int) -> list[int]:
    """The tensor-parallel worker processes of ``pid`` (not, e.g., multiprocessing's resource tracker)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = []
    for x in out.split():
        try:
            cmd = open(f"/proc/{x}/cmdline", "rb").read()
        except FileNotFoundError:
            continue
        if b"leapfrog.parallel.worker" in cmd:
            kids.append(int(x))
    return kids


def _serve(model) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start_serve([str(model), "--dtype", "float32", "--served-model-name", "tiny", "--tensor-parallel-size",
                        "2", "--speculative-config", SPEC, "--max-model-len", "256"], port)
    return proc, f"http://127.0.0.1:{port}"


def test_tp2_server_answers_streams_and_stops_on_sigterm(llama_dir):
    prompt = "def foo(x):\n    return"
    with LLM(str(llama_dir), dtype="float32", max_model_len=256) as ref_llm:
        ref = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].text
    proc, url = _serve(llama_dir)
    try:
        workers = _children(proc.pid)
        assert len(workers) == 1, workers
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref                       # TP=2 + ngram equals TP=1 without speculation
        assert r.usage.model_dump()["speculative"]["num_draft_tokens"] > 0
        stream = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == ref
    finally:
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert time.time() - t0 < 30
    for pid in workers:   # the worker went with it
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def test_killed_worker_ends_the_server_with_an_error(llama_dir):
    proc, url = _serve(llama_dir)
    try:
        workers = _children(proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.time()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - t0 < 20
    assert proc.returncode == 1, out
    assert "tensor-parallel worker rank 1 exited" in out


def test_torchrun_launch_matches_one_process(llama_dir):
    """The multi-machine path on one machine: torchrun starts 2 processes of the same command,
    rank 0 generates (over gloo), rank 1 serves its forwards; the text equals a plain run's."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this Python")
    cmd = ["generate", "def f(x):", "--model", str(llama_dir), "--max-tokens", "12", "--dtype", "float32",
           "--temperature", "0", "--ignore-eos"]
    plain = subprocess.run([sys.executable, "-m", "leapfrog", *cmd], capture_output=True, text=True, timeout=120)
    tr = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "leapfrog",
                         *cmd, "--tensor-parallel-size", "2", "--speculative-config", SPEC],
                        capture_output=True, text=True, timeout=180)
    assert plain.returncode == 0 and tr.returncode == 0, tr.stderr[-2000:]
    text = plain.stdout.split("\n--- [")[0]
    assert text and tr.stdout.split("\n--- [")[0] == text
