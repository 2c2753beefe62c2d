"""Tensor parallelism on one machine: TP=1 vs TP=2 side by side, and what the wire costs per step.

One run, interleaved (A B A B ... per prompt, rotated each repeat): the built-in target without
speculation, with its draft model (K=4) and with its EAGLE-3 head (generate's default chain), at
batch 1 and 4, greedy, fp32, TP=1 with all the threads vs TP=2 with an equal share per rank (on 2
cores: 1 thread each, so expect no speedup; what this measures is the overhead). For TP=2 it
reports, from rank 0's counters (parallel/group.py ``CommStats``), per target forward:
collectives, bytes through them, the time rank 0 spends inside them (wire time plus waiting for
the slower rank), and the part of it that is the step command (which carries the drafts); and per
drafting step the time rank 0 spends drafting while the workers wait (the cost a drafter
replicated on every rank would run in parallel instead, on the same critical path).

    python benchmarks/tp_bench.py --out bench_tp [--max-tokens 96] [--repeats 3] [--threads 2]
        [--speculation none draft_model-k4 eagle3-chain5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR, DEMO_EAGLE3, demo_pair
from leapfrog.entrypoints.check import DEFAULT_PROMPTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--out", default="bench_tp")
    specs_all = ["none", "draft_model-k4", "eagle3-chain5"]
    ap.add_argument("--speculation", nargs="+", choices=specs_all, default=specs_all)
    args = ap.parse_args()
    target, draft = demo_pair()
    specs = {"none": None,
             "draft_model-k4": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
             "eagle3-chain5": {**DEMO_EAGLE3, "model": str(DEMO_DIR / "eagle3"), "disable_by_batch_size": None}}
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = DEFAULT_PROMPTS[:4]
    rows = []
    for spec_name in args.speculation:
        spec = specs[spec_name]
        torch.set_num_threads(args.threads)
        one = LLM(str(target), dtype="float32", speculative_config=spec, max_num_seqs=max(args.batch_size))
        two = LLM(str(target), dtype="float32", speculative_config=spec, max_num_seqs=max(args.batch_size),
                  tensor_parallel_size=2)
        share = torch.get_num_threads()
        contenders = {"tp1": (one, args.threads), "tp2": (two, share)}
        drafting = _time_drafts(two)
        for bs in args.batch_size:
            batch = [prompts[i % len(prompts)] for i in range(bs)]
            tps: dict[str, list[float]] = {n: [] for n in contenders}
            same = True
            for name, (llm, th) in contenders.items():   # warm-up
                torch.set_num_threads(th)
                llm.generate(batch, sp, use_tqdm=False)
            stats0 = two.engine.tp.stats.snapshot()
            forwards0 = two.engine.tp.stats.forwards
            drafting[:] = [0, 0.0]
            for r in range(args.repeats):
                order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
                outs = {}
                for name in order:
                    llm, th = contenders[name]
                    torch.set_num_threads(th)
                    t0 = time.perf_counter()
                    outs[name] = llm.generate(batch, sp, use_tqdm=False)
                    dt = time.perf_counter() - t0
                    tps[name].append(sum(len(o.outputs[0].token_ids) for o in outs[name]) / dt)
                same &= all(a.outputs[0].token_ids == b.outputs[0].token_ids
                            for a, b in zip(outs["tp1"], outs["tp2"]))
            st = two.engine.tp.stats
            fwd = max(1, st.forwards - forwards0)
            d = {k: v - stats0[k] for k, v in st.snapshot().items()}
            ratios = [b / a for a, b in zip(tps["tp1"], tps["tp2"])]
            rows.append({
                "speculation": spec_name, "batch_size": bs,
                "tp1_tokens_per_s": statistics.median(tps["tp1"]), "tp2_tokens_per_s": statistics.median(tps["tp2"]),
                "tp2_over_tp1": statistics.median(ratios), "ratio_repeats": ratios, "identical": same,
                "forwards": fwd, "collectives_per_forward": d["calls"] / fwd,
                "bytes_per_forward": d["bytes"] / fwd, "comm_ms_per_forward": 1000 * d["seconds"] / fwd,
                "forward_ms_tp2": 1000 * d["forward_seconds"] / fwd,
                "command_ms_per_forward": 1000 * d["command_seconds"] / fwd,
                "draft_ms_per_step_tp2": 1000 * drafting[1] / max(1, drafting[0]),
            })
            print(json.dumps(rows[-1]))
        one.close()
        two.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_bench.json").write_text(json.dumps({"rows": rows, "threads": args.threads,
                                                   "max_tokens": args.max_tokens, "repeats": args.repeats}, indent=1))
    print(f"\n{'speculation':<16}{'bs':>3}{'TP1 tok/s':>11}{'TP2 tok/s':>11}{'TP2/TP1':>9}{'same':>6}"
          f"{'coll/fwd':>9}{'KB/fwd':>8}{'comm ms/fwd':>12}{'cmd ms':>8}{'fwd ms':>8}{'draft ms':>9}")
    for r in rows:
        print(f"{r['speculation']:<16}{r['batch_size']:>3}{r['tp1_tokens_per_s']:>11.1f}{r['tp2_tokens_per_s']:>11.1f}"
              f"{r['tp2_over_tp1']:>9.2f}{str(r['identical']):>6}{r['collectives_per_forward']:>9.1f}"
              f"{r['bytes_per_forward'] / 1024:>8.1f}{r['comm_ms_per_forward']:>12.2f}"
              f"{r['command_ms_per_forward']:>8.2f}{r['forward_ms_tp2']:>8.2f}{r['draft_ms_per_step_tp2']:>9.2f}")


def _time_drafts(llm: LLM) -> list:
    """[drafting steps, seconds] on rank 0, counted around the proposer's ``propose`` (none: zeros)."""
    counter: list = [0, 0.0]
    proposer = llm.engine.proposer
    if proposer is None:
        return counter
    propose = proposer.propose

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = propose(*a, **kw)
        counter[0] += 1
        counter[1] += time.perf_counter() - t0
        return out

    proposer.propose = timed
    return counter


if __name__ == "__main__":
    main()
