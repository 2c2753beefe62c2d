"""What the speculation controller's bookkeeping costs a step, without the forwards around it: record
every call an engine makes to its SpecController during a run, then replay the calls on fresh
controllers and time them (spec_decode/adaptive.py; issue 11: at batch 1 "auto" tree sizes trail
the chain of the depth by about their controller's host work).

Per batch size (``--batch-sizes``), held-out prompts in static batches: one run of "auto" tree sizes
(``--depth``, ``--topk``) and one of the fixed chain of the depth, each recorded (the requests' fields
the controller reads, the drafts, the acceptance results, the times, every return value). Each
"auto" trace is replayed ``--repeats`` times with the C++ confidence model
(spec_decode/native_confidence.py) and with the Python one (confidence.py ConfidenceCurves), the
chain's with its own; per contender the microseconds a call of each method (the least of the
repeats' means) and a step's total, and whether every call returned what the recorded run's did
(a replay that returns anything else is no measurement of that run: the bench says so and exits
1). A replay runs warm, without the forwards' traffic through the caches: in the engine the same
calls take about twice as long (docs/eagle-measurements.md, stop 111).

Recording wraps the controller instance's methods (a measurement, not an API).

    python benchmarks/controller_bench.py [--batch-sizes 1 4] [--temperature 0] [--num-prompts 16] \\
        [--max-tokens 128] [--depth 7] [--topk 4] [--head-quantization w8a8] [--repeats 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR
from leapfrog.model.loader import load_tokenizer
from leapfrog.spec_decode.adaptive import SpecController
from leapfrog.spec_decode.confidence import ConfidenceCurves
from leapfrog.spec_decode.native_confidence import native_curves
from leapfrog.train.distill import heldout_prompts

#: the controller's methods the engine calls (the rest are its own)
CALLS = ("choose", "observe", "leased", "lease_step", "lease_continues", "drafting_off", "observe_rounds",
         "plain_steps_ready")
#: the Request fields the controller reads
FIELDS = ("request_id", "max_tokens", "num_computed", "sampled", "unseeded_sampled", "num_speculative_tokens")


@dataclass
class Trace:
    """One run's controller calls: (method, args, kwargs, returned, stop confidence after ``choose``)."""
    cfg: Any
    max_model_len: int
    calls: list[tuple] = field(default_factory=list)


def _snapshot(value: Any, keep: dict[int, list]) -> tuple:
    """A call's argument as it was: a list of requests as ("reqs", the list's identity, each one's
    fields), a dataclass (drafts, results) deep-copied, anything else as it is."""
    if isinstance(value, list) and value and hasattr(value[0], "request_id"):
        keep[id(value)] = value   # (alive to the end: an identity stays unique)
        return ("reqs", id(value), [{**{f: getattr(r, f) for f in FIELDS}, "output_ids": list(r.output_ids)}
                                    for r in value])
    if hasattr(value, "__dataclass_fields__"):
        return ("value", copy.deepcopy(value))
    return ("value", value)


def record(llm: LLM, prompts: list[str], params: SamplingParams, batch_size: int) -> Trace:
    """Run ``prompts`` in static batches through ``llm``, recording its controller's calls (every
    call since the controller was made: a replay starts from a new one)."""
    ctl = llm.engine.spec_controller
    trace, keep = Trace(copy.deepcopy(ctl.cfg), ctl.max_model_len), {}
    for name in CALLS:
        method = getattr(ctl, name)

        def wrapped(*args, _name=name, _method=method, **kwargs):
            call = [_name, [_snapshot(a, keep) for a in args], {k: _snapshot(v, keep) for k, v in kwargs.items()}]
            out = _method(*args, **kwargs)
            trace.calls.append((*call, out, ctl.stop_confidence if _name == "choose" else None))
            return out
        setattr(ctl, name, wrapped)
    try:
        for i in range(0, len(prompts), batch_size):
            llm.generate(prompts[i:i + batch_size], params, use_tqdm=False)
    finally:
        for name in CALLS:
            delattr(ctl, name)
    return trace


def replay(trace: Trace, model: str) -> tuple[dict[str, tuple[int, float]], int]:
    """The trace's calls on a fresh controller (``model``: its confidence model, "native" or
    "python"; "own": as constructed) -> per method (calls, seconds), and how many calls returned
    other than recorded."""
    ctl = SpecController(copy.deepcopy(trace.cfg), trace.max_model_len)
    if model != "own":
        K, depth = ctl.K, trace.cfg.num_speculative_tokens
        ctl.confidence = native_curves(K, depth) if model == "native" else ConfidenceCurves(K, depth)
        if ctl.confidence is None:
            raise RuntimeError("the C++ confidence model is unavailable here (no compiler?)")
    reqs: dict[str, SimpleNamespace] = {}
    lists: dict[int, list] = {}

    def arg(value: tuple) -> Any:
        if value[0] != "reqs":
            return value[1]
        _, ident, fields = value
        objs = []
        for f in fields:   # the engine's requests persist and change between calls: so do these
            r = reqs.setdefault(f["request_id"], SimpleNamespace())
            r.__dict__.update(f)
            objs.append(r)
        same = lists.get(ident)
        if same is None or len(same) != len(objs) or any(a is not b for a, b in zip(same, objs)):
            same = lists[ident] = objs   # (the controller tells a step's lists apart by identity)
        return same

    times: dict[str, list] = {}
    wrong = 0
    for name, args, kwargs, out, stop in trace.calls:
        a, kw = [arg(v) for v in args], {k: arg(v) for k, v in kwargs.items()}
        method = getattr(ctl, name)
        t = time.perf_counter()
        got = method(*a, **kw)
        dt = time.perf_counter() - t
        entry = times.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += dt
        wrong += got != out or (name == "choose" and ctl.stop_confidence != stop)
    return {k: (n, s) for k, (n, s) in times.items()}, wrong


def measure(trace: Trace, model: str, repeats: int) -> dict[str, Any]:
    """Per method the least over ``repeats`` replays of the mean seconds a call; a step's total."""
    best: dict[str, float] = {}
    counts: dict[str, int] = {}
    wrong = 0
    for _ in range(repeats):
        times, w = replay(trace, model)
        wrong = max(wrong, w)
        for name, (n, s) in times.items():
            counts[name] = n
            best[name] = min(best.get(name, float("inf")), s / n)
    steps = counts.get("observe", 0) + counts.get("lease_step", 0)
    total = sum(best[n] * counts[n] for n in best)
    return {"us_per_call": {n: 1e6 * best[n] for n in sorted(best)}, "calls": counts, "steps": steps,
            "us_per_step": 1e6 * total / max(steps, 1), "mismatches": wrong}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--head", default=str(DEMO_DIR / "eagle3"), help="an EAGLE-3 head (default: the built-in one)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--topk", type=int, default=4, help="eagle_topk of the \"auto\" sizes")
    ap.add_argument("--head-quantization", choices=["w8a8", "int8"], default=None)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="write controller_bench.json here")
    args = ap.parse_args(argv)
    for name in ("num_prompts", "max_tokens", "depth", "topk", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch_sizes) < 1:
        ap.error("--batch-sizes must be at least 1")

    from leapfrog.bench.edits import heldout_documents
    tok = load_tokenizer(args.target)
    docs = heldout_documents(DEMO_DIR if args.target == str(DEMO_DIR / "target") else Path(args.target).parent)
    prompts = heldout_prompts(tok, docs, args.num_prompts, prompt_tokens=64)
    head = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.depth}
    if args.head_quantization:
        head["draft_quantization"] = args.head_quantization
    seqs = max(args.batch_sizes)
    base = LLM(args.target, max_num_seqs=seqs)   # (the target, loaded once)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=0 if args.temperature > 0 else None)
    results = []
    for B in args.batch_sizes:
        # fresh engines per batch size: a replay starts from a new controller, so the recorded one must
        # have made every call since its start (a replay of one past a warm-up chose otherwise)
        traces = {}
        for name, spec in (("auto", {**head, "eagle_topk": args.topk, "num_draft_tokens": "auto"}),
                           ("chain", {**head, "eagle_topk": 1})):
            llm, refused = LLM.sharing_if_possible(base, model=args.target, speculative_config=spec, max_num_seqs=seqs)
            if refused:
                print(f"{name} loads its own copy of the target: {refused}")
            traces[name] = record(llm, prompts, params, B)
            llm.close()
        rows = {"auto (C++ model)": measure(traces["auto"], "native", args.repeats),
                "auto (Python model)": measure(traces["auto"], "python", args.repeats),
                f"chain of {args.depth}": measure(traces["chain"], "own", args.repeats)}
        results.append({"batch_size": B, "contenders": rows})
        print(f"\nbatch {B}, T = {args.temperature}: microseconds a call (least of {args.repeats} replays' means)")
        names = sorted({n for r in rows.values() for n in r["us_per_call"]})
        print(f"{'contender':22s} {'steps':>6s} " + " ".join(f"{n:>15s}" for n in names) + f" {'a step':>9s}")
        for label, r in rows.items():
            cells = " ".join(f"{r['us_per_call'][n]:15.1f}" if n in r["us_per_call"] else f"{'-':>15s}" for n in names)
            print(f"{label:22s} {r['steps']:6d} {cells} {r['us_per_step']:9.1f}"
                  + ("" if not r["mismatches"] else f"  ({r['mismatches']} calls returned otherwise!)"))
    bad = any(r["mismatches"] for res in results for r in res["contenders"].values())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "controller_bench.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                                    "results": results}, indent=1))
    if bad:
        print("a replay returned other than its recorded run: its times measure another run", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
