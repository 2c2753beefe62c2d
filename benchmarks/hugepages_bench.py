"""Transparent huge pages on and off, side by side: would PyTorch's THP_MEM_ALLOC_ENABLE=1 pay?

With it, PyTorch's CPU allocator aligns allocations of 2 MB and more (weights, KV caches) to 2 MB
and madvises them into huge pages (kernels whose THP mode is "madvise" give none otherwise), so
streaming the weights each step misses the TLB less. leapfrog leaves it to the user: on the
2-vCPU AVX-512 EPYC (stop 72) it measured no effect beyond the noise (tokens/s on/off 0.97-1.04x
over 4 and 6 rounds, both configurations), though isolated forward loops had looked 25 % faster.
PyTorch reads the variable once per process, so the contenders are child
processes, interleaved round by round (off on off on ..., each configuration in each round) to
spread the machine's drift over both: plain decode and the built-in EAGLE-3 chain on the built-in
target, batch 1, greedy, the same held-out prompts. Each child loads its LLM, warms it on two
prompts, then times ``--num-prompts`` prompts of ``--max-tokens`` tokens one at a time, and
reports tokens/s, the median target forward of a one-token step (``runner.step``, timed after
the run), and the huge pages it holds (AnonHugePages of /proc/self/smaps_rollup).

    python benchmarks/hugepages_bench.py [--rounds 4] [--num-prompts 6] [--max-tokens 128]

Prints per configuration the median tokens/s and forward time over the rounds, and the ratio
on/off of each (medians of the per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("none", "eagle3")


def child(which: str, num_prompts: int, max_tokens: int) -> None:
    """One contender's run in this process (THP as the environment says) -> one JSON line."""
    import torch

    from leapfrog import LLM, SamplingParams
    from leapfrog.demo import DEMO_DIR, DEMO_EAGLE3
    from leapfrog.model.loader import load_tokenizer
    from leapfrog.model.runner import SeqChunk
    from leapfrog.train.distill import heldout_prompts
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_bench import heldout_documents
    torch.set_num_threads(2)
    tok = load_tokenizer(str(DEMO_DIR / "target"))
    prompts = heldout_prompts(tok, heldout_documents(DEMO_DIR), num_prompts, prompt_tokens=64)
    spec = None if which == "none" else {**DEMO_EAGLE3, "model": str(DEMO_DIR / "eagle3")}
    llm = LLM(str(DEMO_DIR / "target"), speculative_config=spec)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    n, t0 = 0, time.perf_counter()
    for p in prompts:
        n += len(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    runner, hidden, times = llm.engine.runner, llm.engine._target_states, []
    for _ in range(30):
        t = time.perf_counter()
        runner.step([SeqChunk(0, 150, [5], 1)], hidden=hidden)
        times.append(time.perf_counter() - t)
    huge = open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0]
    print(json.dumps({"tokens_per_s": n / elapsed, "forward_ms": 1e3 * statistics.median(times[5:]),
                      "huge_kb": int(huge)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.num_prompts, args.max_tokens)
        return
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for which in CONFIGS:
            for thp in ("0", "1"):
                out = subprocess.run([sys.executable, __file__, "--child", which, "--num-prompts",
                                      str(args.num_prompts), "--max-tokens", str(args.max_tokens)],
                                     env={**os.environ, "THP_MEM_ALLOC_ENABLE": thp}, capture_output=True,
                                     text=True, check=True)
                runs.setdefault((which, thp), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"[hugepages_bench] round {r + 1}/{args.rounds} done", file=sys.stderr)
    print("| contender | huge pages | tokens/s | one-token forward (ms) | huge pages held (MB) |")
    print("|---|---|---:|---:|---:|")
    for (which, thp), rs in runs.items():
        print(f"| {which} | {'on' if thp == '1' else 'off'} | {statistics.median(x['tokens_per_s'] for x in rs):.1f} "
              f"| {statistics.median(x['forward_ms'] for x in rs):.2f} | {statistics.median(x['huge_kb'] for x in rs) / 1024:.0f} |")
    for which in CONFIGS:
        on, off = runs[(which, "1")], runs[(which, "0")]
        speed = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, off))
        fwd = statistics.median(a["forward_ms"] / b["forward_ms"] for a, b in zip(on, off))
        print(f"{which}: on/off tokens/s {speed:.3f}x, forward time {fwd:.3f}x (medians of {len(on)} rounds)")
    base = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[("eagle3", "1")], runs[("none", "1")])]
    print(f"eagle3 vs none with huge pages: {statistics.median(base):.2f}x; without: "
          f"{statistics.median(a['tokens_per_s'] / b['tokens_per_s'] for a, b in zip(runs[('eagle3', '0')], runs[('none', '0')])):.2f}x")


if __name__ == "__main__":
    main()
