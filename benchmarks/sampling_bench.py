"""Unseeded sampled decode: the sampler's inverse-CDF draw against the exponential race, side by side.

An unseeded sampled row draws its token with one uniform from the request's generator, by
inverse CDF (sampling/sampler.py ``sample``); before, every row ran the exponential race, which
draws V float64 uniforms per token (8192 for the built-in model) and takes their logarithms.
This benchmark times both in one process on one loaded engine per config, alternating
(race, inverse, inverse, race, ...) round by round: the race contender patches ``sampler.sample``
with the race for every row (what one-token steps drew before; multi-step graphs are not
patched, so only eager and one-token compiled configs compare), and, with an EAGLE head, the
head's chain randomness (``EagleProposer._chain_draws``: V uniforms per level for every sampled
row, as the sampled chain graph raced before). It reports median tokens/s and the median of
per-round ratios, and, without the engine, the draw alone for [batch, V] rows (eagle3 configs:
the host's draw of a batch of chains' randomness, V uniforms per level against one).

    python benchmarks/sampling_bench.py                          # eager, batch 1, 8 and 32
    python benchmarks/sampling_bench.py --configs compiled:1 compiled:1:eagle3 --rounds 8

A config is MODE:BATCH[:eagle3] with MODE ``eager`` or ``compiled`` (one token, or one
speculation step, per engine step); BATCH is max_num_seqs, the prompts go BATCH at a time;
``eagle3``: the built-in speculative_config (the shipped EAGLE-3 head's 5-deep chain). The
built-in demo target by default (``--model``), its held-out prompts, temperature 0.7, no seeds
(a seeded request races with its position's noise either way).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest.mock import patch

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR, default_model
from leapfrog.model.loader import load_tokenizer
from leapfrog.sampling import sampler
from leapfrog.spec_decode.proposers.eagle import EagleProposer
from leapfrog.train.distill import heldout_prompts


def race_for_every_row(p: torch.Tensor, rngs) -> torch.Tensor:
    """The draw before inverse CDF: every row's token the race's winner (V uniforms per row)."""
    return (p / sampler.exponentials(rngs, p.shape[-1], p.device)).argmax(dim=-1)


def race_chain_draws(self: EagleProposer, rs, levels, chain):
    """An EAGLE head's chain randomness before inverse CDF: every sampled row races, with V
    uniforms per level from its position noise or its generator (stream rows: none)."""
    dev, steps, vocab = self.runner.device, chain.steps, chain.model.args.vocab_size
    rngs = [r.rng(d) if d < n else None for r, n in zip(rs, levels) for d in range(steps)]
    e = sampler.exponentials(rngs, vocab, dev).view(len(rs), steps, vocab)
    return e, torch.zeros(len(rs), dtype=torch.bool, device=dev), torch.zeros(len(rs), steps, dtype=torch.float64,
                                                                               device=dev)


def ms_per_call(fns: dict, reps: int) -> dict[str, float]:
    """ms per call of each function (after one warm-up call)."""
    out = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = (time.perf_counter() - t0) / reps * 1e3
    return out


def draw_alone(batch: int, vocab: int, reps: int = 50) -> dict[str, float]:
    """ms per draw of [batch, vocab] rows, one generator per row, each way."""
    p = torch.softmax(torch.randn(batch, vocab), -1)
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    return ms_per_call({"race": lambda: race_for_every_row(p, gens), "inverse": lambda: sampler.sample(p, gens)},
                       reps)


def chain_draw_alone(batch: int, vocab: int, levels: int, reps: int = 50) -> dict[str, float]:
    """ms per host draw of an EAGLE sampled chain's randomness for ``batch`` unseeded requests of
    ``levels`` levels each way: V uniforms per level (race) against one (inverse CDF)."""
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    return ms_per_call({"race": lambda: sampler.noise([g for g in gens for _ in range(levels)], vocab, "cpu"),
                        "inverse": lambda: sampler.stream_rows(gens, [levels] * batch, levels)}, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["eager:1", "eager:8", "eager:32"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a checkpoint (default: the built-in demo target)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from demo_bench import heldout_documents

    model = args.model or str(DEMO_DIR / "target")
    tok = load_tokenizer(model)
    prompts = heldout_prompts(tok, heldout_documents(DEMO_DIR), args.num_prompts, prompt_tokens=args.prompt_tokens)
    sps = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)] * len(prompts)
    rows = []
    for config in args.configs:
        mode, batch, *spec = config.split(":")
        batch = int(batch)
        if mode not in ("eager", "compiled") or spec not in ([], ["eagle3"]):
            ap.error(f"config {config}: MODE:BATCH[:eagle3], mode eager or compiled")
        if spec and args.model:
            ap.error(f"config {config}: eagle3 runs the built-in pair (no --model)")
        spec_config = default_model(args.dtype)[1] if spec else None
        if spec and (spec_config or {}).get("method") != "eagle3":
            ap.error("the built-in EAGLE-3 head is not installed")
        llm = LLM(model=model, dtype=args.dtype, max_num_seqs=batch, enforce_eager=mode == "eager", seed=0,
                  max_model_len=args.prompt_tokens + args.max_tokens + 8, speculative_config=spec_config)

        def tokens_per_s() -> float:
            n, t = 0, 0.0
            for i in range(0, len(prompts), batch):
                t0 = time.perf_counter()
                outs = llm.generate(prompts[i:i + batch], sps[i:i + batch], use_tqdm=False)
                t += time.perf_counter() - t0
                n += sum(len(o.outputs[0].token_ids) for o in outs)
            return n / t

        llm.generate(prompts[:batch], sps[:batch], use_tqdm=False)   # warm-up
        speeds: dict[str, list[float]] = {"race": [], "inverse": []}
        for r in range(args.rounds):
            for name in (("race", "inverse") if r % 2 == 0 else ("inverse", "race")):
                if name == "race":
                    with patch.object(sampler, "sample", race_for_every_row), \
                            patch.object(EagleProposer, "_chain_draws", race_chain_draws):
                        speeds[name].append(tokens_per_s())
                else:
                    speeds[name].append(tokens_per_s())
            print(f"[sampling_bench] {config} round {r + 1}: race {speeds['race'][-1]:.0f}, "
                  f"inverse {speeds['inverse'][-1]:.0f} tokens/s", file=sys.stderr)
        ratios = [a / b for a, b in zip(speeds["inverse"], speeds["race"])]
        alone = draw_alone(batch, llm.engine.vocab_size) if not spec else \
            chain_draw_alone(batch, llm.engine.vocab_size, spec_config["num_speculative_tokens"])
        rows.append((config, statistics.median(speeds["race"]), statistics.median(speeds["inverse"]),
                     statistics.median(ratios), min(ratios), max(ratios), alone))
        del llm
    print(f"\nunseeded sampled decode, T = {args.temperature}, {args.num_prompts} prompts x {args.max_tokens} tokens, "
          f"{args.threads} threads, {args.rounds} alternating rounds (tokens/s medians; the draw alone in ms)")
    print("| config | race | inverse CDF | inverse / race [min, max] | draw alone: race | inverse CDF |")
    print("|---|---:|---:|---|---:|---:|")
    for config, race, inv, ratio, lo, hi, alone in rows:
        print(f"| {config} | {race:.0f} | {inv:.0f} | {ratio:.2f}x [{lo:.2f}, {hi:.2f}] | {alone['race']:.3f} | "
              f"{alone['inverse']:.3f} |")


if __name__ == "__main__":
    main()
