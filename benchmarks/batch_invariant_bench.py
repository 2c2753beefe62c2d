"""What batch-invariant mode and the float32 LM head cost, on the built-in demo pair.

1. Tokens/s with and without ``batch_invariant`` (dtype auto: bf16 on CPUs with native bf16),
   greedy, 64 new tokens per prompt: batch 1 (prompts one after another) and batch 8, each with
   draft_model speculation (K = 4, the demo default) and without. Contenders run interleaved,
   round by round, in alternating order (the machine may be shared: compare ratios, not
   absolute times); the table gives median tokens/s and the ratio mode / no mode. It also
   checks what the mode promises: outputs with speculation equal those without, batch 8 equals
   batch 1.
2. The float32 LM head against a bf16 one on the demo target: the head alone for 1-40 rows,
   a whole decode step (one token at depth 128), and tokens/s at batch 1 without speculation,
   the two heads swapped in turn on the same model, median of interleaved repeats.

Run from the repository root:

    python benchmarks/batch_invariant_bench.py               # 5 rounds
    python benchmarks/batch_invariant_bench.py --rounds 1    # quick check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import default_model
from leapfrog.entrypoints.check import DEFAULT_PROMPTS

MAX_TOKENS = 64


def workloads() -> dict[str, list[list[str]]]:
    """name -> batches (each batch is one generate call)."""
    prompts = list(DEFAULT_PROMPTS[:8])
    return {"batch 1": [[p] for p in prompts[:4]], "batch 8": [prompts]}


def run(llm: LLM, batches: list[list[str]]) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids: list[list[int]] = []
    t0 = time.perf_counter()
    for batch in batches:
        ids += [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)]
    return time.perf_counter() - t0, ids


def bench_modes(rounds: int) -> dict:
    path, spec_cfg = default_model()
    llms = {(spec, mode): LLM(model=path, speculative_config=spec_cfg if spec else None, batch_invariant=mode,
                              max_num_seqs=8)
            for spec in (True, False) for mode in (False, True)}
    dtype = str(next(iter(llms.values())).engine.dtype)
    times: dict[tuple, list[float]] = {}
    outputs: dict[tuple, list[list[int]]] = {}
    for name, batches in workloads().items():
        n_tok = MAX_TOKENS * sum(len(b) for b in batches)
        for key, llm in llms.items():
            run(llm, batches[:1])  # warm-up
        for r in range(rounds):
            order = list(llms) if r % 2 == 0 else list(reversed(llms))
            for key in order:
                dt, ids = run(llms[key], batches)
                times.setdefault((name, *key), []).append(n_tok / dt)
                outputs[(name, *key)] = ids
    rows = []
    for name in workloads():
        for spec in (True, False):
            off, on = (statistics.median(times[(name, spec, m)]) for m in (False, True))
            rows.append({"workload": name, "speculation": "draft_model K=4" if spec else "none",
                         "tok_s_off": off, "tok_s_on": on, "ratio": on / off})
    checks = {}
    for mode in (False, True):
        checks[f"mode {'on' if mode else 'off'}: speculation == no speculation"] = all(
            outputs[(n, True, mode)] == outputs[(n, False, mode)] for n in workloads())
        checks[f"mode {'on' if mode else 'off'}: batch 8 == batch 1 (first 4 prompts)"] = all(
            outputs[("batch 8", s, mode)][:4] == outputs[("batch 1", s, mode)] for s in (True, False))
    return {"dtype": dtype, "rows": rows, "checks": checks}


def bench_head(repeats: int) -> dict:
    """The engine's float32-logits head (a float32 copy, or on AVX-512 BF16 the bf16 weights through
    model/native_linear.py's kernel) vs a bf16 head whose output is cast to float32 (the old one)."""
    from leapfrog.model.packed import PackedLinear, can_pack
    from leapfrog.model.runner import SeqChunk

    llm = LLM(model=default_model()[0], max_num_seqs=1)  # no speculation
    model, runner = llm.engine.model, llm.engine.runner
    fp32_head = model.head
    if model.dtype == torch.float32 or not can_pack(model.dtype, model.device):
        return {"skipped": f"model runs in {model.dtype}: no half-precision head to compare"}
    # the engine's head holds a packed form: take the checkpoint's weight from an unpacked load
    from leapfrog.model.loader import load_model, read_checkpoint
    plain = load_model(read_checkpoint(llm.config.model), model.dtype, model.device, 16, pack=False)
    w = (plain.embed.weight if plain.lm_head is None else plain.lm_head.weight).detach()
    bf16_proj = PackedLinear(w, None)

    class Bf16Head(torch.nn.Module):
        def forward(self, hidden):
            return bf16_proj(hidden.to(w.dtype)).float()

    heads = {"fp32": fp32_head, "bf16": Bf16Head()}
    g = torch.Generator().manual_seed(0)
    head_us: dict[str, dict[int, list[float]]] = {k: {} for k in heads}
    with torch.inference_mode():
        for _ in range(repeats):
            for m in (1, 5, 8, 40):
                h = torch.randn(m, model.args.hidden_size, generator=g)
                for k, head in heads.items():
                    head(h)
                    t0 = time.perf_counter()
                    for _ in range(20):
                        head(h)
                    head_us[k].setdefault(m, []).append((time.perf_counter() - t0) / 20 * 1e6)
    ids = torch.randint(3, model.args.vocab_size, (129,), generator=g).tolist()
    runner.run([SeqChunk(0, 0, ids[:128], 0)])
    step_ms: dict[str, list[float]] = {k: [] for k in heads}
    for _ in range(repeats):
        for k, head in heads.items():
            model.head = head
            runner.run([SeqChunk(0, 128, ids[128:], 1)])
            t0 = time.perf_counter()
            for _ in range(20):
                runner.run([SeqChunk(0, 128, ids[128:], 1)])
            step_ms[k].append((time.perf_counter() - t0) / 20 * 1e3)
    tok_s: dict[str, list[float]] = {k: [] for k in heads}
    batches = workloads()["batch 1"]
    for r in range(max(3, repeats // 3)):
        for k in (list(heads) if r % 2 == 0 else list(reversed(heads))):
            model.head = heads[k]
            dt, _ = run(llm, batches)
            tok_s[k].append(MAX_TOKENS * len(batches) / dt)
    model.head = fp32_head
    med = statistics.median
    return {"head_us": {k: {m: med(v) for m, v in d.items()} for k, d in head_us.items()},
            "step_ms": {k: med(v) for k, v in step_ms.items()},
            "tok_s_batch1_plain": {k: med(v) for k, v in tok_s.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--head-repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench_out/batch_invariant_bench.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = bench_modes(args.rounds)
    head = bench_head(args.head_repeats)
    lines = [(f"Batch-invariant mode on the demo pair ({modes['dtype']}), {MAX_TOKENS} new tokens per prompt, "
              f"greedy, {args.threads} threads, median of {args.rounds} interleaved rounds"), "",
             "| workload | speculation | tok/s without | tok/s with | with / without |", "|---|---|---:|---:|---:|"]
    for r in modes["rows"]:
        lines.append(f"| {r['workload']} | {r['speculation']} | {r['tok_s_off']:.1f} | {r['tok_s_on']:.1f} | "
                     f"{r['ratio']:.2f} |")
    lines += [""] + [f"- {k}: {v}" for k, v in modes["checks"].items()]
    if "skipped" in head:
        lines += ["", f"LM head: {head['skipped']}"]
    else:
        hu, sm = head["head_us"], head["step_ms"]
        lines += ["", f"LM head on the demo target, fp32 vs bf16 weights, median of {args.head_repeats}", "",
                  "| rows | bf16 head us | fp32 head us | fp32 / bf16 |", "|---:|---:|---:|---:|"]
        for m in hu["fp32"]:
            lines.append(f"| {m} | {hu['bf16'][m]:.0f} | {hu['fp32'][m]:.0f} | {hu['fp32'][m] / hu['bf16'][m]:.2f} |")
        ts = head["tok_s_batch1_plain"]
        lines += ["", (f"One decode step (1 token, depth 128): bf16 head {sm['bf16']:.2f} ms, fp32 head "
                       f"{sm['fp32']:.2f} ms, fp32 / bf16 {sm['fp32'] / sm['bf16']:.3f}"),
                  (f"Batch 1, no speculation: bf16 head {ts['bf16']:.1f} tok/s, fp32 head {ts['fp32']:.1f} tok/s, "
                   f"fp32 / bf16 {ts['fp32'] / ts['bf16']:.3f} (drafts keep a bf16 head)")]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
            "machine": platform.machine(), "processor": platform.processor()}
    args.out.write_text(json.dumps({"meta": meta, "modes": modes, "head": head}, indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
