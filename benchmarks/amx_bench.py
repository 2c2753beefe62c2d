"""The linear kernel's AMX tiles on and off, side by side: what AMX-BF16 gives decode and speculation.

On CPUs with AMX-BF16 (``leapfrog.model.native_linear.kernel_amx``) the bf16 kernel multiplies
bf16 rows with the tile registers, where the AVX-512 BF16 build's vdpbf16ps tiles become
compute-bound past a few rows: verifying a chain of 7 (8 rows) or a tree of 16 nodes (17 rows)
then costs about what one token costs. ``LEAPFROG_AMX=0`` is read once per process (the kernel is
built and loaded once), so the contenders are child processes, interleaved round by round (each
contender with AMX off, then on, in every round) to spread the machine's drift over both. Each
child loads the built-in target (bf16, batch 1, greedy, 2 threads) with its speculation, warms it
on two prompts, times ``--num-prompts`` held-out prompts of ``--max-tokens`` tokens one at a time,
and reports tokens/s, tokens per target forward and its output tokens; the "none" child also
times one-forward steps of 1-17 tokens (the verify-cost curve t(S)/t(1)).

    python benchmarks/amx_bench.py [--rounds 3] [--num-prompts 6] [--max-tokens 128] \\
        [--contenders none eagle3-k7 eagle3-k5 eagle3-tree16 draft_model]

Prints per contender and setting the median tokens/s, its speedup over "none" with the same
setting (median of per-round ratios), AMX on/off, whether its greedy output equals none's, and the
verify-cost curves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONTENDERS = ("none", "eagle3-k7", "eagle3-k5", "eagle3-tree16", "draft_model")
CURVE = (1, 2, 4, 6, 8, 12, 17)


def spec_config(which: str) -> dict | None:
    from leapfrog.demo import DEMO_DIR
    head = {"method": "eagle3", "model": str(DEMO_DIR / "eagle3")}
    return {
        "none": None,
        "eagle3-k7": {**head, "num_speculative_tokens": 7, "eagle_topk": 1},
        "eagle3-k5": {**head, "num_speculative_tokens": 5, "eagle_topk": 1},
        "eagle3-tree16": {**head, "num_speculative_tokens": 5, "eagle_topk": 4, "num_draft_tokens": 16},
        "draft_model": {"method": "draft_model", "model": str(DEMO_DIR / "draft"), "num_speculative_tokens": 4},
    }[which]


def child(which: str, num_prompts: int, max_tokens: int) -> None:
    """One contender's run in this process (AMX as the environment says) -> one JSON line."""
    import torch

    from leapfrog import LLM, SamplingParams
    from leapfrog.demo import DEMO_DIR
    from leapfrog.model.loader import load_tokenizer
    from leapfrog.model.native_linear import amx_in_use
    from leapfrog.model.runner import SeqChunk
    from leapfrog.train.distill import heldout_prompts
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_bench import heldout_documents
    torch.set_num_threads(2)
    tok = load_tokenizer(str(DEMO_DIR / "target"))
    prompts = heldout_prompts(tok, heldout_documents(DEMO_DIR), num_prompts, prompt_tokens=64)
    llm = LLM(str(DEMO_DIR / "target"), dtype="bfloat16", speculative_config=spec_config(which))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    tokens, forwards, digest = 0, 0, hashlib.sha256()
    t0 = time.perf_counter()
    for p in prompts:
        res = llm.generate([p], sp, use_tqdm=False)[0]
        tokens += len(res.outputs[0].token_ids)
        forwards += res.metrics.num_target_forwards
        digest.update(json.dumps(list(res.outputs[0].token_ids)).encode())
    elapsed = time.perf_counter() - t0
    curve = {}
    if which == "none":
        runner = llm.engine.runner
        for s in CURVE:
            times = []
            for _ in range(30):
                t = time.perf_counter()
                runner.step([SeqChunk(0, 150, [5] * s, s)])
                times.append(time.perf_counter() - t)
            curve[s] = statistics.median(times[5:])
    print(json.dumps({"tokens_per_s": tokens / elapsed, "digest": digest.hexdigest()[:16], "amx": amx_in_use(),
                      "curve_ms": {s: 1e3 * t for s, t in curve.items()},
                      "tokens_per_forward": tokens / max(1, forwards)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    ap.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.num_prompts, args.max_tokens)
        return
    from leapfrog.model.native_linear import kernel_amx
    if not kernel_amx():
        sys.exit("this CPU has no AMX-BF16 (or LEAPFROG_AMX=0 is set): nothing to compare")
    names = ["none", *[c for c in args.contenders if c != "none"]]
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for which in names:
            for amx in ("0", "1"):
                for attempt in range(2):   # (one retry: a child once failed importing the standard library)
                    out = subprocess.run([sys.executable, __file__, "--child", which, "--num-prompts",
                                          str(args.num_prompts), "--max-tokens", str(args.max_tokens)],
                                         env={**os.environ, "LEAPFROG_AMX": amx}, capture_output=True, text=True)
                    if not out.returncode:
                        break
                    print(f"[amx_bench] child {which} (LEAPFROG_AMX={amx}) failed; {'again' if attempt else 'retrying'}",
                          file=sys.stderr)
                if out.returncode:
                    sys.exit(f"child {which} (LEAPFROG_AMX={amx}) failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                if res["amx"] != (amx == "1"):
                    sys.exit(f"child {which}: LEAPFROG_AMX={amx} but the kernel's AMX use was {res['amx']}")
                runs.setdefault((which, amx), []).append(res)
        print(f"[amx_bench] round {r + 1}/{args.rounds} done", file=sys.stderr)

    def med(xs):
        return statistics.median(xs)

    print(f"\nbuilt-in target, bf16, batch 1, T = 0, {args.num_prompts} prompts x {args.max_tokens} tokens x "
          f"{args.rounds} rounds (medians; ratios: medians of per-round ratios)\n")
    print("| contender | AMX | tokens/s | vs none (same AMX) | AMX on / off | tokens per forward | same output as none |")
    print("|---|---|---:|---:|---:|---:|---|")
    for which in names:
        for amx in ("0", "1"):
            rs, base = runs[(which, amx)], runs[("none", amx)]
            vs = med(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rs, base))
            onoff = med(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[(which, "1")], runs[(which, "0")]))
            same = sum(a["digest"] == b["digest"] for a, b in zip(rs, base))
            print(f"| {which} | {'on' if amx == '1' else 'off'} | {med(x['tokens_per_s'] for x in rs):.1f} | "
                  f"{vs:.2f}x | {onoff:.3f}x | {med(x['tokens_per_forward'] for x in rs):.2f} | {same}/{len(rs)} |")
    print("\nverify cost t(S)/t(1) of the target's forward (none's child; medians over rounds):\n")
    print("| AMX | t(1) ms | " + " | ".join(f"S={s}" for s in CURVE[1:]) + " |")
    print("|---|---:|" + "---:|" * (len(CURVE) - 1))
    for amx in ("0", "1"):
        curves = [r["curve_ms"] for r in runs[("none", amx)]]
        t1 = med(c["1"] for c in curves)
        print(f"| {'on' if amx == '1' else 'off'} | {t1:.3f} | "
              + " | ".join(f"{med(c[str(s)] / c['1'] for c in curves):.2f}" for s in CURVE[1:]) + " |")


if __name__ == "__main__":
    main()
