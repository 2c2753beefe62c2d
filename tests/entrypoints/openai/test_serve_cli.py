"""`leapfrog serve` as users run it: a subprocess, real port, SIGTERM shutdown."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from leapfrog.parallel.group import free_port


def test_serve_subprocess_answers_and_exits_on_sigterm(llama_dir):
    port = free_port()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    proc = subprocess.Popen([sys.executable, "-m", "leapfrog.entrypoints.cli", "serve", str(llama_dir),
                             "--port", str(port), "--dtype", "float32", "--served-model-name", "tiny",
                             "--speculative-config", spec, "--api-key", "k"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                       json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal: exit 0 or "terminated by SIGTERM"
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out
    assert "start-up objects out of the garbage collector's scans" in out   # utils.freeze_heap


def test_serve_bad_config_exits_2(llama_dir):
    r = subprocess.run([sys.executable, "-m", "leapfrog.entrypoints.cli", "serve", str(llama_dir),
                        "--speculative-config", '{"method": "ngram"}'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "num_speculative_tokens" in r.stderr


def test_serve_flags_refused_before_the_model_loads(llama_dir, monkeypatch, capsys):
    """Bad serve flags exit 2 with one line, before any model loads: a port outside 0..65535, one
    already taken, --max-waiting 0 (every request would be a 400), an empty --api-key or
    LEAPFROG_API_KEY (it silently turned authentication off), an empty --served-model-name."""
    import socket

    from leapfrog.engine import engine as engine_mod
    from leapfrog.entrypoints.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(engine_mod, "LLMEngine", no_load)
    for extra in (["--port", "70000"], ["--port", "-1"], ["--max-waiting", "0"], ["--api-key", ""],
                  ["--served-model-name", " "]):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(llama_dir), *extra])
        assert e.value.code == 2, extra
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(llama_dir), "--port", str(port)]) == 2
        assert f"--port {port}: cannot listen there" in capsys.readouterr().err
    monkeypatch.setenv("LEAPFROG_API_KEY", "")
    assert main(["serve", str(llama_dir), "--port", "0"]) == 2
    assert "LEAPFROG_API_KEY is set but empty" in capsys.readouterr().err


def start_serve(args: list[str], port: int) -> subprocess.Popen:
    """`leapfrog serve ARGS --port PORT` as a subprocess, once /health answers 200 (within 120 s);
    a server that exits or never comes up fails the test with its output, and is killed."""
    proc = subprocess.Popen([sys.executable, "-m", "leapfrog", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail("server did not come up:\n" + proc.communicate()[0])
        time.sleep(0.2)


def test_sigterm_ends_every_stream_with_abort_and_done():
    """8 long streams on the built-in model; SIGTERM: within 2 s every stream gets a chunk with
    finish_reason "abort" and then [DONE], and the process exits."""
    import asyncio
    port = free_port()
    proc = start_serve(["--max-num-seqs", "8"], port)
    url = f"http://127.0.0.1:{port}/v1/completions"
    ended: dict[int, float] = {}
    try:
        async def main():
            started = asyncio.Event()
            seen = set()

            async def stream(h, i):
                body = {"model": "leapfrog-default", "prompt": f"def f{i}(x):", "max_tokens": 1500,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                finish, done = None, False
                async with h.stream("POST", url, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                            ended[i] = time.time()
                        elif line.startswith("data: "):
                            ch = json.loads(line[6:])
                            seen.add(i)
                            if len(seen) == 8:
                                started.set()
                            if ch["choices"] and ch["choices"][0]["finish_reason"]:
                                finish = ch["choices"][0]["finish_reason"]
                return finish, done

            async with httpx.AsyncClient(timeout=60) as h:
                tasks = [asyncio.ensure_future(stream(h, i)) for i in range(8)]
                await asyncio.wait_for(started.wait(), 60)
                t0 = time.time()
                proc.send_signal(signal.SIGTERM)
                return t0, await asyncio.gather(*tasks)
        t0, results = asyncio.run(main())
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert results == [("abort", True)] * 8, results
    assert max(ended.values()) - t0 < 2.0
    assert proc.returncode in (0, -signal.SIGTERM), out


def test_openai_clients_that_give_up_are_aborted():
    """A real `leapfrog serve` (built-in model): 4 non-streaming openai-client requests time out
    client-side after 0.5 s; within a second the server runs nothing and holds no KV."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    port = free_port()
    proc = start_serve(["--max-num-seqs", "4"], port)
    base = f"http://127.0.0.1:{port}"

    def gauges() -> dict[str, float]:
        text = httpx.get(base + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in ("leapfrog:num_requests_running", "leapfrog:kv_cache_usage_perc")}
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=0.5)
        import concurrent.futures as cf
        with cf.ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(c.completions.create, model="leapfrog-default", prompt=f"def g{i}():",
                                max_tokens=1500, temperature=0, extra_body={"ignore_eos": True}) for i in range(4)]
            for f in futs:
                with pytest.raises(openai.APITimeoutError):
                    f.result()
        t0 = time.time()
        while time.time() - t0 < 1.0 and gauges()["leapfrog:num_requests_running"] > 0:
            time.sleep(0.05)
        g = gauges()
        assert g["leapfrog:num_requests_running"] == 0 and g["leapfrog:kv_cache_usage_perc"] == 0, g
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)


def test_sigterm_while_a_prompt_tokenizes_answers_every_request_at_once():
    """A 3.9 MB prompt holds the long texts' tokenizer thread for seconds; a second one (streamed)
    queues behind it. On SIGTERM both get a JSON 503 ("shutting_down") at once and the process
    exits without waiting for the tokenizer: they got uvicorn's plain-text 500 after its 5 s
    graceful timeout, and the exit waited for the tokenization (helper's fuzzing)."""
    import threading
    port = free_port()
    proc = start_serve([], port)
    url = f"http://127.0.0.1:{port}/v1/completions"
    big = "x = 1 + foo(bar) # " * (3_900_000 // 19)   # ~7 s of tokenizing on a 2-core EPYC
    answers: dict[str, tuple] = {}

    def send(name: str, stream: bool) -> None:
        body = {"model": "leapfrog-default", "prompt": big, "max_tokens": 4, "stream": stream}
        r = httpx.post(url, json=body, timeout=60)
        answers[name] = (r.status_code, r.headers.get("content-type", ""), r.text, time.time())

    threads = []
    for name, stream in (("big", False), ("queued", True)):
        threads.append(threading.Thread(target=send, args=(name, stream)))
        threads[-1].start()
        time.sleep(0.7)   # (the first reaches the tokenizer first)
    try:
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        out, _ = proc.communicate(timeout=30)
        exited = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    for name, (status, ctype, text, at) in answers.items():
        assert status == 503 and ctype.startswith("application/json"), (name, status, text[:200])
        assert json.loads(text)["error"]["code"] == "shutting_down", (name, text)
        assert at - t0 < 2.0, (name, at - t0)
    assert set(answers) == {"big", "queued"}
    assert exited < 6.0, exited   # (the old exit waited out both tokenizations: ~7 s each here)
    assert proc.returncode in (0, -signal.SIGTERM), out
