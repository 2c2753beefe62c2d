"""Eager prefill with the last layer pruned to the logits rows, against the whole forward, side by side.

A prefill reads the logits of its prompt's last token only, so the last decoder layer's output
projection, residual and MLP are needed for that token alone (every token's keys and values are
still cached): ``LlamaModel.forward(keep_rows=...)``, which the runner passes in eager steps that
ask for no hidden states (model/runner.py). This script times one prefill step of the target
(default: the built-in one) per prompt length, the two variants interleaved in the same process
(the model's ``keeps_rows`` flag switched between repetitions, whose order alternates), and
reports the median per-repetition time ratio; it also checks that both give the same logits.

    python benchmarks/prefill_bench.py [--target DIR] [--lengths 64 256 1024] [--reps 15] [--dtype auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leapfrog import LLM
from leapfrog.demo import DEMO_DIR
from leapfrog.model.runner import SeqChunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.target, enforce_eager=True, dtype=args.dtype, max_model_len=max(args.lengths) + 1)
    runner = llm.engine.runner
    model = runner.model
    vocab = model.args.vocab_size
    print(f"target {args.target}, dtype {model.dtype}, {args.threads} threads")
    print("| prompt tokens | last layer for the logits row only, ms | whole forward, ms | ratio (median per repetition) | same logits |")
    print("|---:|---:|---:|---:|---|")
    for n in args.lengths:
        ids = [(i * 37) % (vocab - 10) + 5 for i in range(n)]
        chunk = [SeqChunk(0, 0, ids, 1)]
        out = {}
        for keep in (True, False):
            model.keeps_rows = keep
            runner.step(chunk)
            out[keep] = runner.step(chunk).logits
        same = "bitwise" if torch.equal(out[True], out[False]) else (
            "argmax" if torch.equal(out[True].argmax(-1), out[False].argmax(-1)) else "NO")
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.reps):
            for keep in ((True, False) if rep % 2 else (False, True)):
                model.keeps_rows = keep
                t0 = time.perf_counter()
                runner.step(chunk)
                times[keep].append(time.perf_counter() - t0)
        ratio = statistics.median(a / b for a, b in zip(times[True], times[False]))
        print(f"| {n} | {statistics.median(times[True]) * 1e3:.2f} | {statistics.median(times[False]) * 1e3:.2f} "
              f"| {ratio:.3f} | {same} |", flush=True)
    model.keeps_rows = True


if __name__ == "__main__":
    main()
