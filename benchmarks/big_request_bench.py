"""What one request with long rule lists and many choices costs the other requests of a server.

For each source tree given (``--tree``: a leapfrog checkout, e.g. a ``git worktree`` of an older
commit, or this one), a server on the built-in model (``leapfrog serve``, no speculation) streams
one long greedy completion; two seconds in, a second client sends ``--prompts`` prompts x ``--n``
choices of ``--max-tokens`` tokens with ``--stop-ids`` stop_token_ids (the 4 MiB body holds about
700k). Printed per tree: the big request's answer time, and the long stream's largest and median
gap between chunks (the stall every running request saw). The trees run one after the other on
the same machine; compare them within one run.

Stop 122, the 2-vCPU AVX2 EPYC, 8 prompts x n = 16, 600k stop ids (3.4 MiB): before
``LLMEngine.prepare`` (each choice's params checked again on the event loop and the engine's
thread) the big request took 18.0-21.2 s and the stream's largest gap was 13.4-16.7 s; after,
0.76-1.01 s and 0.34-0.38 s (two runs; median gaps 5.0-6.6 and 5.8-7.4 ms).

    git worktree add /tmp/old <commit>
    python benchmarks/big_request_bench.py --tree /tmp/old --tree .
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import httpx


def run(tree: str, port: int, args: argparse.Namespace) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    srv = subprocess.Popen([sys.executable, "-m", "leapfrog", "serve", "--port", str(port), "--max-num-seqs",
                            str(args.prompts * args.n + 1), "--max-waiting", "256", "--speculative-config", "null"],
                           env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if srv.poll() is not None:
                return f"{tree}: the server exited ({srv.returncode})"
            time.sleep(1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        httpx.post(url + "/v1/completions", json={"model": model, "prompt": "def f(x):", "max_tokens": 4,
                                                  "temperature": 0.8}, timeout=600)   # (warm: the sampled op builds)
        times: list[float] = []

        def stream() -> None:
            body = {"model": model, "prompt": "import os\n", "max_tokens": args.stream_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        times.append(time.perf_counter())

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(2)
        ids = [i % 8000 + 3 for i in range(args.stop_ids)]
        body = json.dumps({"model": model, "prompt": ["def g(y):"] * args.prompts, "n": args.n,
                           "max_tokens": args.max_tokens, "temperature": 0.8, "stop_token_ids": ids})
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=600)
        took = time.perf_counter() - t0
        t.join()
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        if r.status_code != 200 or not gaps:
            return f"{tree}: status {r.status_code} {r.text[:200]}, {len(times)} chunks"
        return (f"{tree}: body {len(body) / 2**20:.1f} MiB, the big request {took:.2f} s; the stream: "
                f"{len(times)} chunks, largest gap {gaps[-1] * 1e3:.0f} ms, median {gaps[len(gaps) // 2] * 1e3:.1f} ms")
    finally:
        srv.terminate()
        srv.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="a leapfrog source tree (repeat to compare)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--stop-ids", type=int, default=600_000)
    ap.add_argument("--stream-tokens", type=int, default=1200)
    ap.add_argument("--port", type=int, default=8941)
    args = ap.parse_args()
    for i, tree in enumerate(args.tree):
        print(run(tree, args.port + i, args), flush=True)


if __name__ == "__main__":
    main()
