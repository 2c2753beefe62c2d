"""Where a decode step's time goes, side by side in one run (issue 12: the per-step framework time).

Contenders (``--only``, default all): ``none``, ``eagle3`` (the built-in EAGLE-3 head as a chain of
5), ``draft_model`` (the demo draft, K = 4), ``eagle3-python`` and ``draft_model-python`` (drafting
with the Python loops rather than model/native_draft.py's ops), ``none-python-forward`` and
``eagle3-python-forward`` (the target's eager forward through LlamaModel.forward in Python rather
than one ``llama_hidden`` call: LEAPFROG_NATIVE_FORWARD=0) and ``eagle3-tree16`` (a dynamic
tree of 16 nodes, depth 5, width 4), each one LLM on the built-in target, run in
interleaved rounds (A B C A B C ...) over the same held-out prompts, one at a time (batch 1). Per
contender, the median over its decode steps of:

- the whole step (the engine's one-token or one-round decode step),
- drafting (the proposer's ``propose``),
- the target's forward (the verification's, or plain decode's),
- acceptance (verification of the drafts against the target's logits, the final draw),
- the rest: the host's work around them (choosing sizes, committing, outputs, the controller);

tokens per step and milliseconds per token. Then the target's verify-cost curve t(S) / t(1) for
S = 1..6 tokens, from direct forwards on one cache row (medians of interleaved repeats; compiled,
S = 2..6 run padded in the bucket of 6): the two numbers that bound speculation's speed on a
machine (README, section "The compiled fast path"). Compiled one-token steps
(``--no-enforce-eager``, a run here): none 1.71 ms a step (forward 1.63), eagle3 chain 3.74 ms
(drafting 1.21, forward 2.34), 2.15x, the host's work 3 % of a step.

Timings come from wrapping the engine's methods on these instances (a measurement, not an API).
Multi-step decode and speculation rounds (``num_scheduler_steps`` > 1) do their work inside one
graph and are not split here (``fastpath_bench.py``, ``round_bench.py --profile``).

    python benchmarks/step_bench.py [--temperature 0.7] [--num-prompts 6] [--max-tokens 128] \\
        [--rounds 3] [--no-enforce-eager] [--out bench_step]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR
from leapfrog.model.loader import load_tokenizer
from leapfrog.model.runner import SeqChunk
from leapfrog.train.distill import heldout_prompts

CONTENDERS = {
    "none": None,
    "eagle3": {"method": "eagle3", "model": str(DEMO_DIR / "eagle3"), "num_speculative_tokens": 5, "eagle_topk": 1},
    "draft_model": {"method": "draft_model", "model": str(DEMO_DIR / "draft"), "num_speculative_tokens": 4},
}
#: the eagle3 chain and the draft model drafting with the Python loops (LEAPFROG_NATIVE_DRAFTS=0 at
#: load: model/native_draft.py's drafting ops off), for the ops' A/B (each forward of a draft model's
#: per-token loop is still one llama_hidden call: LEAPFROG_NATIVE_FORWARD is a separate switch)
CONTENDERS["eagle3-python"] = CONTENDERS["eagle3"]
CONTENDERS["draft_model-python"] = CONTENDERS["draft_model"]
#: the 16-node dynamic tree of depth 5 and width 4 (tree_bench's)
CONTENDERS["eagle3-tree16"] = {**CONTENDERS["eagle3"], "eagle_topk": 4, "num_draft_tokens": 16}
#: chains that end where the drafter's path confidence falls below 0.3 (min_draft_confidence): the
#: head's up to 10 deep, the draft model's up to 8
CONTENDERS["eagle3-conf"] = {**CONTENDERS["eagle3"], "num_speculative_tokens": 10, "min_draft_confidence": 0.3}
CONTENDERS["draft_model-conf"] = {**CONTENDERS["draft_model"], "num_speculative_tokens": 8,
                                  "min_draft_confidence": 0.3}
#: the head's linears in w8a8 (int8 weights and rows: AMX-INT8 tiles, AVX-512 VNNI or AVX2): the
#: chain of 5, of 7, and the confidence-ended chain
CONTENDERS["eagle3-w8a8"] = {**CONTENDERS["eagle3"], "draft_quantization": "w8a8"}
CONTENDERS["eagle3-7"] = {**CONTENDERS["eagle3"], "num_speculative_tokens": 7}
CONTENDERS["eagle3-7-w8a8"] = {**CONTENDERS["eagle3-7"], "draft_quantization": "w8a8"}
CONTENDERS["eagle3-conf-w8a8"] = {**CONTENDERS["eagle3-conf"], "draft_quantization": "w8a8"}
#: "auto" tree sizes at depth 7 with the w8a8 head (what a step of the adaptive controller costs
#: against the fixed chain of 7 it mostly runs at batch 1)
CONTENDERS["eagle3-auto-w8a8"] = {**CONTENDERS["eagle3-7-w8a8"], "eagle_topk": 4, "num_draft_tokens": "auto"}
#: the eagle3 chain verifying sampled chains in Python (LEAPFROG_NATIVE_VERIFY=0: spec_decode/verify/native.py's
#: op off), for the op's A/B at a temperature
CONTENDERS["eagle3-python-verify"] = CONTENDERS["eagle3"]
#: no speculation and the eagle3 chain with the target's eager forward in Python (LEAPFROG_NATIVE_FORWARD=0:
#: model/runner.py _native_forward off), for that op's A/B
CONTENDERS["none-python-forward"] = CONTENDERS["none"]
CONTENDERS["eagle3-python-forward"] = CONTENDERS["eagle3"]
ENV = {"eagle3-python": {"LEAPFROG_NATIVE_DRAFTS": "0"}, "draft_model-python": {"LEAPFROG_NATIVE_DRAFTS": "0"},
       "eagle3-python-verify": {"LEAPFROG_NATIVE_VERIFY": "0"},
       "none-python-forward": {"LEAPFROG_NATIVE_FORWARD": "0"}, "eagle3-python-forward": {"LEAPFROG_NATIVE_FORWARD": "0"}}
PARTS = ("step", "draft", "forward", "accept")


class StepTimer:
    """Per decode step of one engine: seconds in each part (PARTS), and the tokens it appended."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[dict[str, float]] = []
        self._cur: dict[str, float] | None = None
        eng = llm.engine
        self._wrap(eng, "_decode", "step", top=True)
        self._wrap(eng.runner, "step", "forward")
        self._wrap(eng, "accept", "accept")
        if eng.proposer is not None:
            self._wrap(eng.proposer, "propose", "draft")
        self._eng = eng

    def _wrap(self, obj, name: str, part: str, top: bool = False) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if not top and self._cur is None:   # (a prefill's forward: not a decode step's)
                return fn(*args, **kwargs)
            if top:
                self._cur = dict.fromkeys(PARTS, 0.0)
                self._cur["tokens0"] = self._eng.iteration.num_generation_tokens
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._cur[part] += time.perf_counter() - t0
                if top:
                    self._cur["tokens"] = self._eng.iteration.num_generation_tokens - self._cur.pop("tokens0")
                    self.steps.append(self._cur)
                    self._cur = None
        setattr(obj, name, timed)

    def summary(self) -> dict[str, float]:
        """Medians in ms per step of each part and of the host's, tokens per step (mean), and ms
        per token (all steps' time over all their tokens: slow steps count) over the recorded steps."""
        med = {p: 1e3 * statistics.median(s[p] for s in self.steps) for p in PARTS}
        host = [s["step"] - s["draft"] - s["forward"] - s["accept"] for s in self.steps]
        tokens = sum(s["tokens"] for s in self.steps)
        return {**{f"{p}_ms": round(v, 3) for p, v in med.items()}, "host_ms": round(1e3 * statistics.median(host), 3),
                "tokens_per_step": round(tokens / len(self.steps), 2),
                "ms_per_token": round(1e3 * sum(s["step"] for s in self.steps) / tokens, 3), "steps": len(self.steps)}


def verify_curve(llm: LLM, sizes: range, repeats: int) -> dict[int, float]:
    """t(S) / t(1): medians of the target's forward over S new tokens at column 64 of cache row 0
    (its context from the last run), the sizes interleaved ``repeats`` times."""
    runner, hidden = llm.engine.runner, llm.engine._target_states
    times: dict[int, list[float]] = defaultdict(list)
    for r in range(repeats + 3):
        for s in sizes:
            t0 = time.perf_counter()
            runner.step([SeqChunk(0, 64, list(range(5, 5 + s)), s)], hidden=hidden)
            if r >= 3:   # (warm-up)
                times[s].append(time.perf_counter() - t0)
    t1 = statistics.median(times[sizes[0]])
    return {s: round(statistics.median(v) / t1, 3) for s, v in times.items()}


def make_llm(name: str, enforce_eager: bool) -> LLM:
    """Contender ``name``'s LLM on the built-in target, with its environment (ENV) at load."""
    saved = {k: os.environ.get(k) for k in ENV.get(name, {})}
    os.environ.update(ENV.get(name, {}))
    try:
        return LLM(model=str(DEMO_DIR / "target"), speculative_config=CONTENDERS[name], enforce_eager=enforce_eager)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=list(CONTENDERS), default=None,
                    help="default: every contender this CPU runs (the w8a8 ones need leapfrog's native linear kernel)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--curve-repeats", type=int, default=30)
    ap.add_argument("--no-enforce-eager", action="store_true", help="the compiled fast path (one-token steps)")
    ap.add_argument("--eagle-depths", type=int, nargs="*", default=[],
                    help="also the eagle3 chain at these depths (contenders eagle3-kD)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_step")
    args = ap.parse_args()
    if args.only is None:
        from leapfrog.model.native_linear import w8a8_supported
        args.only = [n for n in CONTENDERS if "w8a8" not in n or w8a8_supported()]
    torch.set_num_threads(args.threads)
    for d in args.eagle_depths:
        CONTENDERS[f"eagle3-k{d}"] = {**CONTENDERS["eagle3"], "num_speculative_tokens": d}
        args.only.append(f"eagle3-k{d}")
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_bench import heldout_documents
    tok = load_tokenizer(str(DEMO_DIR / "target"))
    prompts = heldout_prompts(tok, heldout_documents(DEMO_DIR), args.num_prompts)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    llms = {name: make_llm(name, not args.no_enforce_eager) for name in args.only}
    for llm in llms.values():   # warm-up (and the compiled graphs' first calls) before the timers
        llm.generate(prompts[:1], sp, use_tqdm=False)
    timers = {name: StepTimer(llm) for name, llm in llms.items()}
    for r in range(args.rounds):
        for name, llm in llms.items():
            for p in prompts:
                llm.generate([p], sp, use_tqdm=False)
        print(f"[step_bench] round {r + 1}/{args.rounds} done", file=sys.stderr)
    rows = {name: t.summary() for name, t in timers.items()}
    curve = verify_curve(next(iter(llms.values())), range(1, 7), args.curve_repeats)
    base = rows.get("none")
    print(f"\nbatch 1, T = {args.temperature}, {'compiled' if args.no_enforce_eager else 'eager'}, "
          f"{args.num_prompts} prompts x {args.max_tokens} tokens x {args.rounds} rounds (ms: medians per step; "
          "ms/token: total time over total tokens)\n")
    print("| contender | step | drafting | target forward | acceptance | host | tokens/step | ms/token | vs none |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        speed = f"{base['ms_per_token'] / r['ms_per_token']:.2f}x" if base else "-"
        print(f"| {name} | {r['step_ms']:.2f} | {r['draft_ms']:.2f} | {r['forward_ms']:.2f} | {r['accept_ms']:.2f} | "
              f"{r['host_ms']:.2f} ({100 * r['host_ms'] / r['step_ms']:.0f} %) | {r['tokens_per_step']:.2f} | "
              f"{r['ms_per_token']:.2f} | {speed} |")
    print("\nverify cost t(S)/t(1): " + ", ".join(f"S={s}: {v:.2f}" for s, v in curve.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_summary.json").write_text(json.dumps({"args": vars(args), "contenders": rows, "verify_curve": curve},
                                                      indent=1))


if __name__ == "__main__":
    main()
