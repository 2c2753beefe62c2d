"""A batch's token rules per step, side by side in one run: a long logit_bias kept dense or as entries.

The sampler builds a step's rows (``sampler.build_rows``: the rules' masks, the logit_bias
entries, the penalties) and applies them to the logits (``sampler.penalised_logits``) at every
step, for every row of every request. A request's rule tensors are built once and kept
(``RuleTensors``); this times what is left per step, for ``--rows`` rows of one request (a chain
of drafts verified: drafts + 1 rows) whose logit_bias covers ``--bias-share`` of a ``--vocab``
vocabulary. Contenders, interleaved round by round:

- ``dense``: the bias kept as a dense row [V] added to the request's rows (the sampler keeps it so
  when it covers ``sampler.DENSE_BIAS_SHARE`` of the vocabulary or more; patched to 0 here, so
  smaller shares compare too: where the two cross),
- ``entries``: the same bias as (row, id, value) entries added by one scatter with accumulation
  (what every bias was before; ``DENSE_BIAS_SHARE`` patched above 1).

Both give the same logits (checked here, and in tests/sampling/test_token_rules.py). Reported:
median milliseconds per step and the median of per-round ratios against ``entries``.

    python benchmarks/rules_bench.py [--vocab 128256] [--rows 6] [--bias-share 1.0] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from leapfrog import SamplingParams
from leapfrog.sampling import sampler
from leapfrog.sampling.sampler import RowSpec


def step_ms(specs: list[RowSpec], logits: torch.Tensor, vocab: int, reps: int) -> tuple[float, torch.Tensor]:
    """Milliseconds per step (build_rows + penalised_logits, the mean of ``reps``) and the last logits."""
    t0 = time.perf_counter()
    for _ in range(reps):
        out = sampler.penalised_logits(logits, sampler.build_rows(specs, vocab))
    return 1e3 * (time.perf_counter() - t0) / reps, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--bias-share", type=float, default=1.0, help="the logit_bias's share of the vocabulary")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10, help="steps per contender and round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(args.vocab, generator=g)[:max(1, int(args.bias_share * args.vocab))].tolist()
    values = (torch.rand(len(ids), generator=g) * 20 - 10).tolist()
    sp = SamplingParams(temperature=0.7, logit_bias=dict(zip(ids, values)))
    logits = torch.randn(args.rows, args.vocab, generator=g)
    shares = {"dense": 0.0, "entries": 2.0}   # (DENSE_BIAS_SHARE patched: always dense, never)
    memos = {name: ({}, {}) for name in shares}   # (each contender's kept rule tensors: RowSpec memo, shared)

    def specs(name: str) -> list[RowSpec]:
        memo, shared = memos[name]
        return [RowSpec(sp, [1], [5] * r, memo=memo, shared=shared, committed=0) for r in range(args.rows)]

    times: dict[str, list[float]] = {name: [] for name in shares}
    ratios: list[float] = []
    outs = {}
    for r in range(args.rounds + 1):
        for name in (shares if r % 2 else reversed(list(shares))):
            with mock.patch.object(sampler, "DENSE_BIAS_SHARE", shares[name]):
                ms, outs[name] = step_ms(specs(name), logits, args.vocab, args.reps)
            if r:   # (round 0: the kept tensors built, warm-up)
                times[name].append(ms)
        if r:
            ratios.append(times["dense"][-1] / times["entries"][-1])
    assert torch.equal(outs["dense"], outs["entries"]), "the two ways gave different logits"
    print(f"{args.rows} rows of one request, logit_bias of {len(ids)} tokens ({args.bias_share:.0%} of "
          f"{args.vocab}), {args.threads} threads, median of {args.rounds} rounds x {args.reps} steps")
    print("| contender | ms per step | vs entries |\n|---|---:|---:|")
    for name in shares:
        ratio = statistics.median(ratios) if name == "dense" else 1.0
        print(f"| {name} | {statistics.median(times[name]):.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
