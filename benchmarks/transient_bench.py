"""How much slower the target's plain decode steps run right after something else ran: a pause,
or a burst of other matrix work (what drafting steps are to the plain steps after them).

On the built-in target, ``--batch`` rows of a 64-token prompt, then ``--steps`` one-token forwards
per row (``ModelRunner.step`` directly: no engine, no controller). Before steps ``--at`` ..
``--at`` + 3 each perturbation runs for ``--ms`` milliseconds: ``sleep`` (the CPU idles),
``bf16`` / ``fp32`` (a busy loop of matrix products of about a verification's shape, on other
weights). ``none`` perturbs nothing. The contenders run interleaved (one pass each per repeat);
per step after the perturbation, the median forward time over the repeats against ``none``'s at
the same step, and the excess summed over the steps after it, in plain steps.

On the 2-vCPU AMX Xeon (stop 106), four runs: the first step after the perturbations 1.29-1.35x
(sleep), 1.34-1.42x (bf16), 1.20-1.30x (fp32) as slow as an undisturbed one, and the excess summed
over the steps after them 0.5-4.6 / 0.96-6.4 / 1.1-3.1 plain steps: in some runs the steps were
back to 1.0x from the fifth, in one they stayed 1.17-1.24x for 12 steps. Even an idle pause does
it, so it is the machine's (caches or clocks), not the engine's. In the engine, four drafting
steps of the EAGLE-3 head (chains of 3, a batch of 16, T = 0.7) made the plain steps after them
1.37, 1.37, 1.26, 1.22, 1.18, 1.12, 1.12, 1.07x as slow as none's same steps. So a plain step
measured within a few steps of drafting reads slow by a varying amount: what "auto" tree sizes
take for plain decode's speed right after drafting (spec_decode/adaptive.py _PLAIN_FIRST,
_PLAIN_SETTLE) can be that slow, not what a run of plain steps makes.

    python benchmarks/transient_bench.py [--batch 16] [--steps 80] [--at 24] [--ms 10] [--repeats 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from leapfrog import LLM
from leapfrog.demo import DEMO_DIR
from leapfrog.model.runner import SeqChunk

PERTURBATIONS = ("none", "sleep", "bf16", "fp32")


def perturb(kind: str, ms: float, work: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run ``kind`` for ``ms`` milliseconds."""
    end = time.perf_counter() + ms / 1e3
    if kind == "sleep":
        time.sleep(ms / 1e3)
    elif kind in work:
        a, w = work[kind]
        while time.perf_counter() < end:
            torch.mm(a, w)


def one_pass(runner, kind: str, args, work) -> list[float]:
    """A prompt per row, then ``args.steps`` plain forwards of every row -> each forward's seconds."""
    B, prompt = args.batch, 64
    runner.step([SeqChunk(r, 0, [(7 * r + i) % 500 + 10 for i in range(prompt)], 1) for r in range(B)])
    out = []
    for j in range(args.steps):
        if kind != "none" and args.at <= j < args.at + 4:
            perturb(kind, args.ms, work)
        chunks = [SeqChunk(r, prompt + j, [(r + j) % 500 + 10], 1) for r in range(B)]
        t0 = time.perf_counter()
        runner.step(chunks)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--at", type=int, default=24, help="the first perturbed step (4 in a row)")
    ap.add_argument("--ms", type=float, default=10.0, help="milliseconds of each perturbation")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_transient")
    args = ap.parse_args()
    if not 0 <= args.at < args.steps - 4:
        raise SystemExit("--at must leave 4 perturbed steps and at least one after them inside --steps")
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.target, enforce_eager=True, max_num_seqs=args.batch)
    runner = llm.engine.runner
    rows = 5 * args.batch   # (about a batch's verification of chains of 4)
    work = {"bf16": (torch.randn(rows, 512, dtype=torch.bfloat16), torch.randn(512, 8192, dtype=torch.bfloat16)),
            "fp32": (torch.randn(rows, 512), torch.randn(512, 1408))}
    one_pass(runner, "none", args, work)   # (warm-up)
    times: dict[str, list[list[float]]] = {k: [] for k in PERTURBATIONS}
    for _ in range(args.repeats):
        for kind in PERTURBATIONS:
            times[kind].append(one_pass(runner, kind, args, work))
    med = {k: [statistics.median(rep[j] for rep in v) for j in range(args.steps)] for k, v in times.items()}
    after = range(args.at + 4, args.steps)
    print(f"batch {args.batch}, {args.ms:g} ms before steps {args.at}..{args.at + 3}; forward time over none's "
          f"(none: {1e3 * statistics.median(med['none'][j] for j in after):.2f} ms a step after them)")
    print("step after " + " ".join(f"{k:>6s}" for k in PERTURBATIONS[1:]))
    for j in list(after)[:32]:
        print(f"{j - args.at - 3:10d} " + " ".join(f"{med[k][j] / med['none'][j]:6.3f}" for k in PERTURBATIONS[1:]))
    excess = {k: sum(med[k][j] - med["none"][j] for j in after) / statistics.median(med["none"][j] for j in after)
              for k in PERTURBATIONS[1:]}
    print("excess after the perturbation, in plain steps: "
          + ", ".join(f"{k} {v:.2f}" for k, v in excess.items()))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "transient.json").write_text(json.dumps(
        {"settings": vars(args), "median_seconds": med, "excess_steps": excess}, indent=1))


if __name__ == "__main__":
    main()
