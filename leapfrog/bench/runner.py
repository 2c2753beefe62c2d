"""``leapfrog bench`` runner: speculative configs vs no speculation on a workload, interleaved.

One ``LLM`` per contender ("none" = no speculation, always present) is built once. For each
temperature and batch size, after ``warmup`` untimed batches per contender, every repeat walks the
workload category by category in batches of ``batch_size``; each batch is run by every contender
in turn (A B A B ..., each batch in the next row of a balanced Latin square, ``run_order``), so
slow drift of the machine hits all contenders alike, and no contender always runs right after the
same other one (an engine's first steps after another's run pay for the caches that one left).
Speedups are per-repeat ratios of tokens/s against "none" of the same repeat: the median is
reported with a 95% t-interval over the repeats (on log ratios, so it stays > 0) when there are at
least ``MIN_CI_REPEATS`` of them: with 2 the t quantile is 12.7 and the interval
spans orders of magnitude, so fewer repeats get no interval (the table says so) and only the
min-max range of the repeats, which the plots draw as whiskers.

Predicted outputs: a contender ``{"prediction": "item"}`` passes each item's prediction
(``WorkloadItem.prediction``: EditEval's input code, the rewrite workload's edited continuation);
``{"prediction": "own", "changed_lines": n}`` passes the target's own greedy output for the item
(one untimed run of "none" before the rounds) with an identifier renamed in n lines
(``edits.edit_lines``): what
the mechanism gives when the caller's expectation is right but for n lines. Other keys of such a
contender are its speculative_config for requests without a prediction (none here). Their rows
add the prediction usage (accepted / rejected prediction tokens) and the similarity of output and
prediction (difflib ratio over tokens). Suffix decoding's global cache is emptied before every
warm-up and repeat, so a repeat never drafts from the outputs of the same items in an earlier one.
"""

from __future__ import annotations

import contextlib
import csv
import difflib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import numpy as np

from leapfrog.bench.hf_backend import HF_PREFIX
from leapfrog.bench.workloads import WorkloadItem
from leapfrog.errors import ConfigError
from leapfrog.outputs import SpecMetrics

ALL = "all"
MIN_ACCEPTANCE = 0.5   # below this acceptance rate speculation should be off

CSV_FIELDS = ["contender", "category", "temperature", "greedy_share", "batch_size", "num_items", "repeats", "tokens_per_s",
              "speedup", "speedup_ci_low", "speedup_ci_high", "acceptance_rate", "mean_acceptance_length",
              "acceptance_by_position", "ttft_mean_s", "latency_p50_s", "latency_p99_s", "equal_rate",
              "speculative_config"]


@dataclass
class BenchResult:
    model: str
    contenders: dict[str, dict | None]          # name -> speculative config (None = "none")
    rows: list[dict[str, Any]]                  # one per contender x category x temperature x batch size
    run_counts: dict[str, int]                  # timed generate() calls per contender (interleaving proof)
    recommendations: list[dict[str, Any]]       # best config per temperature x batch size x category
    settings: dict[str, Any] = field(default_factory=dict)
    skipped_items: list[str] = field(default_factory=list)
    peer_ratios: list[dict[str, Any]] = field(default_factory=list)   # leapfrog vs transformers (--backend)
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def row(self, contender: str, category: str = ALL, temperature: float | None = None,
            batch_size: int | None = None) -> dict[str, Any]:
        for r in self.rows:
            if (r["contender"] == contender and r["category"] == category
                    and (temperature is None or r["temperature"] == temperature)
                    and (batch_size is None or r["batch_size"] == batch_size)):
                return r
        raise KeyError((contender, category, temperature, batch_size))


# ---------------------------------------------------------------------------------- helpers
PREDICTION_KEYS = ("prediction", "changed_lines")
PREDICTION_MODES = ("item", "own")


def split_contender(spec: dict | None) -> tuple[dict | None, str | None, int]:
    """A contender's (speculative_config, prediction mode or None, changed lines)."""
    if spec is None or "prediction" not in spec:
        return spec, None, 0
    mode, changed = spec["prediction"], spec.get("changed_lines", 0)
    if mode not in PREDICTION_MODES:
        raise ConfigError(f"contender {spec}: 'prediction' must be one of {list(PREDICTION_MODES)}")
    if isinstance(changed, bool) or not isinstance(changed, int) or changed < 0 or (changed and mode != "own"):
        raise ConfigError(f"contender {spec}: 'changed_lines' is an integer >= 0, with prediction 'own' only")
    rest = {k: v for k, v in spec.items() if k not in PREDICTION_KEYS}
    return rest or None, mode, changed


def contender_name(spec: dict | None, taken: set[str]) -> str:
    llm_spec, mode, changed = split_contender(spec)
    if mode is not None:
        base = f"prediction-{mode}" + (f"-c{changed}" if mode == "own" else "")
        if llm_spec is not None:
            base += "+" + contender_name(llm_spec, set())
    elif spec is None:
        base = "none"
    else:
        base = f"{spec.get('method', '?')}-k{spec.get('num_speculative_tokens', '?')}"
        for key, short in (("eagle_topk", "topk"), ("num_draft_tokens", "n")):  # tree shape, compactly
            if key in spec:
                base += f"-{short}{spec[key]}"
        if spec.get("draft_quantization"):   # (a quantized drafter: its own contender)
            base += f"-{spec['draft_quantization']}"
        extra = {k: v for k, v in spec.items()
                 if k not in ("method", "num_speculative_tokens", "model", "eagle_topk", "num_draft_tokens",
                              "draft_quantization")}
        if base in taken and spec.get("model"):   # the short name is taken: say which drafter (two heads
            m = Path(str(spec["model"]))           # compared; folders are often named alike: parent too)
            base += f"@{m.parent.name}/{m.name}" if m.parent.name else f"@{m.name}"
        if base in taken and extra:   # still taken: spell out the other keys
            base += "-" + ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
    name, i = base, 2
    while name in taken:
        name, i = f"{base}#{i}", i + 1
    return name


#: fewer repeats give no confidence interval (with 2, t(0.975, 1) = 12.7: an interval like [0.0, 1.6e6])
MIN_CI_REPEATS = 3


def run_order(names: Sequence[str], r: int) -> list[str]:
    """The order the contenders ``names`` run the r-th batch in (counted over all repeats: the
    last of one batch runs right before the first of the next, so the row moves every batch): row r
    (mod n) of a balanced Latin square (Williams: row 0 is 0, 1, n-1, 2, n-2, ..., row i adds i mod
    n), where each contender comes first equally often and, for an even n, right after each other
    one equally often over n rows (odd n: over 2n, every other row mirrored). The order rotated by
    one each repeat put the same contender right before each one in every repeat:
    with none, two fixed chains and "auto", "auto" always ran right after the chain of 7 and none
    right after "auto" (an engine's first steps after another's run are slower: at a batch of 32,
    T = 0.7, an "auto" that drafted nothing measured 0.92x none there, 0.95-1.00x with the chain
    of 7 left out, stop 97).

    >>> [run_order("abcd", r) for r in range(4)]
    [['a', 'b', 'd', 'c'], ['b', 'c', 'a', 'd'], ['c', 'd', 'b', 'a'], ['d', 'a', 'c', 'b']]
    >>> [run_order("ab", r) for r in range(2)], [run_order("abc", r) for r in range(3)]
    ([['a', 'b'], ['b', 'a']], [['a', 'b', 'c'], ['a', 'c', 'b'], ['c', 'a', 'b']])
    """
    n = len(names)
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:   # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [names[(j + r) % n] for j in first]
    return row[::-1] if n % 2 and r % 2 else row


def t_interval(ratios: Sequence[float], level: float = 0.95) -> tuple[float | None, float | None]:
    """Two-sided t-interval of the (geometric) mean ratio, computed on log ratios so that it stays
    positive; (None, None) with fewer than MIN_CI_REPEATS values."""
    vals = [math.log(v) for v in ratios if v is not None and math.isfinite(v) and v > 0]
    if len(vals) < MIN_CI_REPEATS:
        return None, None
    from scipy import stats
    m = statistics.fmean(vals)
    se = statistics.stdev(vals) / math.sqrt(len(vals))
    h = float(stats.t.ppf(0.5 + level / 2, len(vals) - 1)) * se
    return math.exp(m - h), math.exp(m + h)


def render(items: Sequence[WorkloadItem], tok) -> list[list[int]]:
    """Token ids of each item: chat items through the tokenizer's chat template when it has one,
    else their contents joined as plain text."""
    out = []
    has_template = bool(getattr(tok, "chat_template", None))
    for it in items:
        if it.messages is not None:
            if has_template:
                ids = tok.apply_chat_template(it.messages, tokenize=True, add_generation_prompt=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                out.append([int(t) for t in ids])
            else:
                out.append(list(tok.encode("\n\n".join(m["content"] for m in it.messages))))
        else:
            out.append(list(tok.encode(it.prompt or "")))
    return out


def _fmt(v, spec: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


# ---------------------------------------------------------------------------------- main entry
def run_bench(model: str, specs: Sequence[dict | None], items: Sequence[WorkloadItem], *,
              temperatures: Sequence[float] = (0.0,), max_tokens: int = 64, batch_sizes: Sequence[int] = (1,),
              repeats: int = 3, warmup: int = 1, out_dir: str | Path | None = "bench_out", dtype: str = "auto",
              threads: int | None = None, tokenizer: str | None = None, seed: int = 0,
              max_model_len: int | None = None, plots: bool = True, progress: bool = True,
              log: Callable[[str], None] | None = None, backends: Sequence[str] = ("leapfrog",),
              request_seed: int | None = None, enforce_eager: bool = True,
              num_scheduler_steps: int = 1, continuous: bool = False, share_target: bool | None = None,
              greedy_share: float = 0.0) -> BenchResult:
    """Benchmark each speculative config in ``specs`` against no speculation on ``items``; see the module doc.

    ``request_seed``: sampled requests are seeded (item i with request_seed + i, the same in every
    contender and repeat), so sampled outputs can be compared and seeded verification measured.

    ``enforce_eager=False`` runs every leapfrog contender on the compiled fast path (model/compiled.py;
    compiled at load, before any timing).

    ``num_scheduler_steps`` > 1 (with ``enforce_eager=False``): no speculation runs multi-step
    decode, and every contender that can (config.supports_rounds: draft models, EAGLE chains and
    "auto" tree sizes) multi-step speculation rounds; the others run one round per step
    (``settings["multi_step"]`` lists who ran with the steps).

    ``backends`` containing "transformers" adds, per leapfrog contender, its transformers counterpart
    (``leapfrog.bench.hf_backend``) to the same interleaved rounds.

    ``continuous``: each category's items go to each engine in one call, at most ``batch_size``
    running at a time (continuous batching: a finished request's place goes to the next one
    waiting), instead of one static batch of ``batch_size`` items after another. A static batch
    with speculation ends with its slowest request, the batch drained to a few sequences that
    use a step's weight streaming poorly (at T = 0.7 requests accept very unequally), which no
    speculation, all ending at max_tokens together, never pays; a server with a queue does not
    either.

    ``share_target``: every leapfrog contender runs on no speculation's loaded target model
    (``LLM(share_target_with=...)``: the same tensors) instead of a copy of its own. Engines that
    each load a copy can measure apart by several per cent even when identical (where each
    copy's pages landed; ``benchmarks/tree_bench.py --twin``), and interleaved batch by batch each
    starts cold on its copy: at batch 1 the EAGLE-3 chain of 7 paid 2.6 ms a prompt in its first
    steps after none's run (3-4 % of its time; none under 1 % of its longer run), 0.5 ms on one
    copy. Sharing leaves the contenders differing only in their settings, as one server's engine
    runs: they share the target's KV cache too (``LLM(share_kv_cache=True)``; each keeps its own
    drafter and its drafter's cache), as three identical engines with caches of their own
    measured 0.96-1.02 of one another in one run (a batch of 16, T = 0.7), and 0.99-1.00 sharing it.
    None (default): shared where the engine allows it (``engine.check_shareable``: not a target that
    streams its weights), else that contender loads its own copy, said in the log and listed in
    ``settings["own_target"]``;
    False: a copy each; True: shared or refused (NotShareable, a ConfigError).

    ``greedy_share``: a mixed load, as a server sees one. In the cells of a temperature above 0
    this share of the items runs greedy (``greedy_item``: spread evenly through the workload, the
    same items in every contender and repeat) and the rest at the cell's temperature; a batch then
    holds both kinds, whose speculation costs differ (the adaptive controller keeps their tables
    apart: spec_decode/adaptive.py ``mostly_sampled``). The greedy items' outputs must equal none's
    (``equal_rate`` counts them, and the sampled ones too when seeded)."""
    from leapfrog.progress import progress_bar

    from leapfrog import LLM, SamplingParams

    say = log or (lambda s: print(f"[leapfrog bench] {s}", file=sys.stderr))
    if not items:
        raise ConfigError("the workload is empty")
    if repeats < 1 or warmup < 0 or max_tokens < 1:
        raise ConfigError("need repeats >= 1, warmup >= 0 and max_tokens >= 1")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ConfigError("batch sizes must be >= 1")
    if continuous and "transformers" in backends:
        raise ConfigError("continuous batching runs leapfrog engines only (transformers generate takes static batches)")
    if not (isinstance(greedy_share, (int, float)) and 0.0 <= greedy_share <= 1.0):
        raise ConfigError(f"greedy share must be a number in [0, 1], got {greedy_share!r}")
    if greedy_share and "transformers" in backends:
        raise ConfigError("a mixed load (greedy share) runs leapfrog engines only (transformers generate takes one "
                          "temperature per batch)")
    if not temperatures or any(not math.isfinite(t) or t < 0 for t in temperatures):
        raise ConfigError(f"temperatures must be finite and >= 0, got {list(temperatures)}")
    if greedy_share and not any(temperatures):   # (mixes greedy requests into sampled cells only)
        raise ConfigError(f"greedy share {greedy_share}: mixes greedy requests into the cells of a temperature "
                          "above 0, and every temperature here is 0; add a temperature above 0")
    if warmup == 0:
        say("warning: --warmup 0: each contender's first timed batch pays one-time costs (the first run of a "
            "shape, caches), which bias the first contender's figures")
    for s in specs:
        if s is not None and not isinstance(s, dict):
            raise ConfigError(f"a speculative config must be a JSON object, got {type(s).__name__}")
    unknown = set(backends) - {"leapfrog", "transformers"}
    if unknown:
        raise ConfigError(f"unknown backend(s) {sorted(unknown)}; choose from leapfrog, transformers")
    if threads:
        import torch
        torch.set_num_threads(int(threads))

    contenders: dict[str, dict | None] = {"none": None}
    for s in specs:
        if s is None:
            continue
        contenders[contender_name(s, set(contenders))] = s
    names = list(contenders)

    from leapfrog.config import supports_rounds
    llms, multi_step, own_target = {}, [], []
    for name, spec in contenders.items():
        engine_spec = split_contender(spec)[0]
        steps = num_scheduler_steps if engine_spec is None or supports_rounds(engine_spec) else 1
        say(f"loading {name}" + (f" ({steps} steps per engine step)" if steps > 1 else "") + " ...")

        kw = dict(model=str(model), tokenizer=tokenizer, dtype=dtype, seed=seed, speculative_config=engine_spec,
                  max_num_seqs=max(batch_sizes), max_model_len=max_model_len, enforce_eager=enforce_eager,
                  num_scheduler_steps=steps)
        owner = llms["none"] if share_target is not False and name != "none" else None
        if owner is None or share_target:   # (a copy each, or shared or refused: NotShareable)
            llms[name] = LLM(share_target_with=owner, share_kv_cache=owner is not None, **kw)
        else:   # (engine.check_shareable, or a drafter beside a streaming target: its own copy)
            llms[name], refused = LLM.sharing_if_possible(owner, share_kv_cache=True, **kw)
            if refused is not None:
                say(f"{name} loads its own copy of the target: {refused}")
                owner = None
        if name != "none" and owner is None:
            own_target.append(name)
        if steps > 1:
            multi_step.append(name)
    base = llms["none"]
    shared = len(llms) > 1 and not own_target   # (every leapfrog contender on none's target)
    peers: dict[str, str] = {}     # transformers contender -> the leapfrog contender it mirrors
    if "transformers" in backends:
        from leapfrog.bench.hf_backend import HFGenerator, hf_mode_for, hf_name
        for name, spec in list(contenders.items()):
            mode = hf_mode_for(spec)
            if mode is None:
                say(f"transformers has no counterpart of {name}; skipped")
                continue
            hn = hf_name(name, mode)
            say(f"loading {hn} (transformers) ...")
            llms[hn] = HFGenerator(str(model), mode, base.engine.dtype, base.engine.device, base.engine.eos_ids)
            contenders[hn] = spec
            peers[hn] = name
        names = list(contenders)
    tok = base.get_tokenizer()
    if tok is None:
        raise ConfigError("leapfrog bench needs the model's tokenizer")
    limit_len = base.engine.max_model_len
    ids_all = render(items, tok)
    kept: list[tuple[WorkloadItem, list[int]]] = []
    skipped, empty = [], []
    for it, ids in zip(items, ids_all):
        if not ids:
            empty.append(it.id)
        elif len(ids) + max_tokens > limit_len:
            skipped.append(it.id)
        else:
            kept.append((it, ids))
    if empty:
        say(f"skipped {len(empty)} items whose prompt is empty (e.g. {empty[0]})")
    if skipped:
        say(f"skipped {len(skipped)} items longer than max_model_len {limit_len} - max_tokens {max_tokens}")
    if not kept:
        raise ConfigError(f"no workload item to run: {len(empty)} empty, {len(skipped)} longer than max_model_len "
                          f"{limit_len} - max_tokens {max_tokens}")
    skipped += empty
    predictions = _predictions(contenders, kept, base, max_tokens, seed, say)
    categories = sorted({it.category for it, _ in kept})
    by_cat = {c: [(i, ids) for i, (it, ids) in enumerate(kept) if it.category == c] for c in categories}

    run_counts = {n: 0 for n in names}
    rows: list[dict[str, Any]] = []
    peer_rows: list[dict[str, Any]] = []
    n_batches = {bs: len(by_cat) if continuous else sum(math.ceil(len(v) / bs) for v in by_cat.values())
                 for bs in batch_sizes}
    total = sum(len(temperatures) * repeats * n_batches[bs] * len(names) for bs in batch_sizes)
    bar = progress_bar(total=total, desc="leapfrog bench", disable=not progress, file=sys.stderr)
    for temp in temperatures:
        sp = SamplingParams(temperature=float(temp), max_tokens=max_tokens, seed=None)
        mixed = greedy_share if temp > 0 else 0.0
        greedy = {i for i in range(len(kept)) if greedy_item(i, mixed)}   # items run at T = 0 in this cell
        for bs in batch_sizes:
            def params(n: str, idxs: list[int]) -> SamplingParams | list[SamplingParams]:
                pred = predictions.get(n)
                if pred is None and (request_seed is None or n in peers) and not greedy:   # transformers: no seeds
                    return sp
                return [SamplingParams(temperature=0.0 if i in greedy else float(temp), max_tokens=max_tokens,
                                       prediction=None if pred is None else pred[i],
                                       seed=None if request_seed is None else request_seed + i)
                        for i in idxs]

            for _ in range(warmup):
                first = [{"prompt_token_ids": ids} for _, ids in kept[:bs]]
                for n in names:
                    _clear_suffix_cache(llms[n])
                    llms[n].generate(first, params(n, list(range(min(bs, len(kept))))), use_tqdm=False)
            # per repeat, contender, category: tokens and seconds; per item: outputs
            toks = {(r, n, c): 0 for r in range(repeats) for n in names for c in categories}
            secs = {(r, n, c): 0.0 for r in range(repeats) for n in names for c in categories}
            outs: dict[tuple[int, str], dict[int, Any]] = {(r, n): {} for r in range(repeats) for n in names}
            row = 0   # (run_order's row: the next one every batch)
            for r in range(repeats):
                for n in names:
                    _clear_suffix_cache(llms[n])
                for c in categories:
                    group = by_cat[c]
                    per_call = len(group) if continuous else bs
                    for j in range(0, len(group), per_call):
                        chunk = group[j:j + per_call]
                        prompts = [{"prompt_token_ids": ids} for _, ids in chunk]
                        order, row = run_order(names, row), row + 1
                        for n in order:
                            sps = params(n, [idx for idx, _ in chunk])
                            t0 = time.perf_counter()
                            with _running_at_most(llms[n], bs if continuous else None):
                                res = llms[n].generate(prompts, sps, use_tqdm=False)
                            dt = time.perf_counter() - t0
                            run_counts[n] += 1
                            secs[(r, n, c)] += dt
                            for (idx, _), o in zip(chunk, res):
                                toks[(r, n, c)] += len(o.outputs[0].token_ids)
                                outs[(r, n)][idx] = o
                            bar.update(1)
            for n in names:
                for c in [*categories, ALL]:
                    cats = categories if c == ALL else [c]
                    idxs = [i for cc in cats for i, _ in by_cat[cc]]
                    rows.append(_row(n, contenders[n], c, temp, bs, idxs, cats, repeats, toks, secs, outs,
                                     predictions.get(n), tok, greedy_share=mixed,
                                     comparable=(set(idxs) if temp == 0 or (request_seed is not None and n not in peers)
                                                 else greedy.intersection(idxs))))
            for hn, n in peers.items():
                for c in [*categories, ALL]:
                    cats = categories if c == ALL else [c]
                    for a, b in ([(n, hn)] + ([(n, "hf-none")] if n != "none" and "hf-none" in peers else [])):
                        peer_rows.append(_peer_row(a, b, c, temp, bs, cats, repeats, toks, secs))
    bar.close()

    recs = recommend([r for r in rows if r["contender"] not in peers])
    result = BenchResult(model=str(model), contenders=contenders, rows=rows, run_counts=run_counts,
                         recommendations=recs, skipped_items=skipped, peer_ratios=peer_rows,
                         settings=dict(temperatures=list(temperatures), max_tokens=max_tokens,
                                       batch_sizes=list(batch_sizes), repeats=repeats, warmup=warmup, dtype=dtype,
                                       resolved_dtype=str(base.engine.dtype).replace("torch.", ""),
                                       backends=list(backends), threads=threads, num_items=len(kept),
                                       categories=categories, request_seed=request_seed,
                                       enforce_eager=enforce_eager, num_scheduler_steps=num_scheduler_steps,
                                       multi_step=multi_step, continuous=continuous,
                                       share_target=shared, own_target=own_target,
                                       greedy_share=greedy_share))
    if out_dir is not None:
        write_outputs(result, Path(out_dir), plots=plots)
    return result


@contextlib.contextmanager
def _running_at_most(llm, n: int | None):
    """While inside: the engine's scheduler runs at most ``n`` requests at a time (None: as built)."""
    sched = llm.engine.scheduler if n is not None else None
    old = None if sched is None else sched.max_num_seqs
    if sched is not None:
        sched.max_num_seqs = min(n, old)
    try:
        yield
    finally:
        if sched is not None:
            sched.max_num_seqs = old


def _clear_suffix_cache(llm) -> None:
    """Empty a suffix proposer's global cache (LLMs of other methods and transformers: nothing)."""
    proposer = getattr(getattr(llm, "engine", None), "proposer", None)
    if hasattr(proposer, "clear_cache"):
        proposer.clear_cache()


def _predictions(contenders: dict[str, dict | None], kept, base, max_tokens: int, seed: int,
                 say: Callable[[str], None]) -> dict[str, list[str | list[int]]]:
    """contender -> the prediction (text or token ids) of every kept item (module docstring)."""
    from leapfrog import SamplingParams

    from leapfrog.bench.edits import edit_lines
    out: dict[str, list[str | list[int]]] = {}
    own: list[tuple[str, list[int]]] | None = None
    for name, spec in contenders.items():
        _, mode, changed = split_contender(spec)
        if mode == "item":
            if any(it.prediction is None for it, _ in kept):
                raise ConfigError(f"contender {name}: the workload has items without a prediction (EditEval and "
                                  "the built-in rewrite workload have them)")
            out[name] = [it.prediction for it, _ in kept]
        elif mode == "own":
            if own is None:
                say("the target's own outputs for the 'own' predictions (untimed) ...")
                res = base.generate([{"prompt_token_ids": ids} for _, ids in kept],
                                    SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
                own = [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in res]
            rng = random.Random(seed)
            # unedited: the very token ids (decoding and encoding again need not give them back)
            out[name] = [ids if not changed else
                         "".join(edit_lines(text.splitlines(keepends=True), changed, rng, ops=("rename",)))
                         for text, ids in own]
    return out


def _rates(name, ref, cats, repeats, toks, secs) -> tuple[list[float | None], list[float | None]]:
    """Per repeat: tokens/s of ``name``, and its ratio to ``ref``'s tokens/s in the same repeat."""
    tps, ratios = [], []
    for r in range(repeats):
        t = sum(toks[(r, name, c)] for c in cats)
        s = sum(secs[(r, name, c)] for c in cats)
        bt = sum(toks[(r, ref, c)] for c in cats)
        bsec = sum(secs[(r, ref, c)] for c in cats)
        v = t / s if s > 0 else None
        b = bt / bsec if bsec > 0 else None
        tps.append(v)
        ratios.append(v / b if v and b else None)
    return tps, ratios


def _peer_row(a, b, cat, temp, bs, cats, repeats, toks, secs) -> dict[str, Any]:
    """leapfrog contender ``a`` against transformers contender ``b``: tokens/s ratio per repeat."""
    _, ratios = _rates(a, b, cats, repeats, toks, secs)
    ok = [x for x in ratios if x is not None]
    lo, hi = t_interval(ok)
    return {"leapfrog": a, "transformers": b, "category": cat, "temperature": float(temp), "batch_size": int(bs),
            "ratio": statistics.median(ok) if ok else None, "ratio_ci_low": lo, "ratio_ci_high": hi,
            "ratio_repeats": ratios}


def _prediction_stats(outs, idxs, repeats, name, preds: list[str], tok) -> dict[str, Any]:
    """Prediction usage and output/prediction similarity (difflib ratio over token ids)."""
    acc = rej = 0
    sims = []
    for r in range(repeats):
        for i in idxs:
            o = outs[(r, name)][i]
            acc += o.metrics.accepted_prediction_tokens or 0
            rej += o.metrics.rejected_prediction_tokens or 0
            if r == 0:
                pred = preds[i] if isinstance(preds[i], list) else tok.encode(preds[i], add_special_tokens=False)
                sims.append(difflib.SequenceMatcher(None, o.outputs[0].token_ids, pred, autojunk=False).ratio())
    return {"accepted_prediction_tokens": acc, "rejected_prediction_tokens": rej,
            "prediction_similarity": statistics.fmean(sims) if sims else None}


def greedy_item(i: int, share: float) -> bool:
    """Whether item ``i`` of a mixed load runs greedy: ``share`` of the items, spread evenly (item i
    when floor((i + 1) * share) passes an integer: every other item at 0.5, one in four at 0.25)."""
    return math.floor((i + 1) * share) > math.floor(i * share)


def _row(name, spec, cat, temp, bs, idxs, cats, repeats, toks, secs, outs, preds=None, tok=None,
         comparable: Collection[int] = (), greedy_share: float = 0.0) -> dict[str, Any]:
    """One row of the table; ``comparable``: the items whose output must equal none's (greedy or
    seeded)."""
    tps, ratios = _rates(name, "none", cats, repeats, toks, secs)
    ratios_ok = [x for x in ratios if x is not None]
    lo, hi = t_interval(ratios_ok)
    spec_m = SpecMetrics()
    ttft, lat = [], []
    same = total = 0
    for r in range(repeats):
        for i in idxs:
            o = outs[(r, name)][i]
            spec_m.merge(o.metrics.spec)
            if o.metrics.time_to_first_token is not None:
                ttft.append(o.metrics.time_to_first_token)
            if o.metrics.latency is not None:
                lat.append(o.metrics.latency)
            if i in comparable:   # greedy, or seeded: the output must equal none's
                total += 1
                same += o.outputs[0].token_ids == outs[(r, "none")][i].outputs[0].token_ids
    per_pos = [a / d if d else None for a, d in zip(spec_m.num_accepted_tokens_per_pos,
                                                   spec_m.num_draft_tokens_per_pos)]
    return {
        "contender": name, "category": cat, "temperature": float(temp), "greedy_share": greedy_share,
        "batch_size": int(bs),
        "num_items": len(idxs), "repeats": repeats,
        "tokens_per_s": statistics.median([x for x in tps if x is not None]) if any(tps) else None,
        "tokens_per_s_repeats": tps,
        "speedup": statistics.median(ratios_ok) if ratios_ok else None,
        "speedup_ci_low": lo, "speedup_ci_high": hi, "speedup_repeats": ratios,
        "acceptance_rate": spec_m.acceptance_rate, "mean_acceptance_length": spec_m.mean_acceptance_length,
        "acceptance_by_position": per_pos,
        "num_draft_tokens": spec_m.num_draft_tokens, "num_accepted_tokens": spec_m.num_accepted_tokens,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "latency_p50_s": float(np.percentile(lat, 50)) if lat else None,
        "latency_p99_s": float(np.percentile(lat, 99)) if lat else None,
        "equal_rate": same / total if total else None,
        "speculative_config": spec,
        **(_prediction_stats(outs, idxs, repeats, name, preds, tok) if preds is not None else {}),
    }


def recommend(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best contender per (temperature, batch size, category); speculation off ("none") where no config
    has speedup >= 1 and acceptance >= 0.5."""
    keys = sorted({(r["temperature"], r["batch_size"], r["category"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2] == ALL, k[2]))
    recs = []
    for temp, bs, cat in keys:
        cand = [r for r in rows if (r["temperature"], r["batch_size"], r["category"]) == (temp, bs, cat)
                and r["contender"] != "none"]
        good = [r for r in cand if r["speedup"] is not None and r["speedup"] >= 1
                and r["acceptance_rate"] is not None and r["acceptance_rate"] >= MIN_ACCEPTANCE]
        off = [r["contender"] for r in cand if r not in good]
        if good:
            best = max(good, key=lambda r: r["speedup"])
            recs.append(dict(temperature=temp, batch_size=bs, category=cat, best=best["contender"],
                             speedup=best["speedup"], acceptance_rate=best["acceptance_rate"],
                             speculation="on", off_configs=off))
        else:
            why = "no config reaches speedup >= 1 with acceptance >= 0.5"
            recs.append(dict(temperature=temp, batch_size=bs, category=cat, best="none", speedup=1.0,
                             acceptance_rate=None, speculation="off", reason=why, off_configs=off))
    return recs


def _adaptive(spec: dict | None) -> bool:
    return bool(spec) and (spec.get("adaptive") is True or spec.get("num_draft_tokens") == "auto")


def _family(spec: dict) -> tuple:
    """A drafter: its method, checkpoint and quantization (the settings an adaptive size picks among
    are the same drafter's fixed ones)."""
    return spec.get("method"), spec.get("model"), spec.get("draft_quantization")


def adaptive_vs_fixed(rows: list[dict[str, Any]], contenders: dict[str, dict | None]) -> list[dict[str, Any]]:
    """The adaptive goal, per adaptive contender (``"adaptive": true`` or ``num_draft_tokens: "auto"``),
    temperature and batch size (category "all"): its speedup over none, and its speedup over the best
    fixed setting of the same drafter in this run (the highest median speedup among the other
    contenders of its method, checkpoint and quantization, picked after the fact: a max over noisy
    medians, so the ratio reads low by the noise; transformers' counterparts are not leapfrog's
    settings). Contenders without a fixed sibling are left out."""
    out = []
    by_key = {(r["contender"], r["temperature"], r["batch_size"]): r for r in rows if r["category"] == ALL}
    for name, spec in contenders.items():
        if not _adaptive(spec):
            continue
        fixed = [n for n, s in contenders.items() if s and not _adaptive(s) and _family(s) == _family(spec)
                 and not n.startswith(HF_PREFIX)]   # (transformers' counterparts share the spec)
        if not fixed:
            continue
        for (n, temp, bs), r in by_key.items():
            if n != name or r["speedup"] is None:
                continue
            sib = [(by_key[(f, temp, bs)]["speedup"], f) for f in fixed
                   if (f, temp, bs) in by_key and by_key[(f, temp, bs)]["speedup"]]   # (None or 0: not measured)
            if not sib:
                continue
            best, best_name = max(sib)
            out.append(dict(contender=name, temperature=temp, batch_size=bs, speedup=r["speedup"],
                            best_fixed=best_name, best_fixed_speedup=best, vs_best_fixed=r["speedup"] / best))
    return sorted(out, key=lambda d: (d["contender"], d["temperature"], d["batch_size"]))


def format_adaptive(goal: list[dict[str, Any]], vs_none: float = 0.98, vs_best: float = 0.95) -> str:
    """The adaptive goal's table: speedup over none (goal >= ``vs_none``) and over the best fixed
    setting (goal >= ``vs_best``), with a line per contender counting the cells that meet both."""
    if not goal:
        return ""
    L = [f"{'adaptive':<30} {'temp':>4} {'bs':>3} {'vs none':>7} {'vs best fixed':>13}  best fixed"]
    L.append("-" * len(L[0]))
    for g in goal:
        mark = "" if g["speedup"] >= vs_none and g["vs_best_fixed"] >= vs_best else "  (short)"
        L.append(f"{g['contender'][:30]:<30} {g['temperature']:>4g} {g['batch_size']:>3} {g['speedup']:>7.2f} "
                 f"{g['vs_best_fixed']:>13.2f}  {g['best_fixed']} ({g['best_fixed_speedup']:.2f}x){mark}")
    for name in dict.fromkeys(g["contender"] for g in goal):
        mine = [g for g in goal if g["contender"] == name]
        met = sum(g["speedup"] >= vs_none and g["vs_best_fixed"] >= vs_best for g in mine)
        L.append(f"{name}: {met} of {len(mine)} cells >= {vs_none:g}x none and >= {vs_best:g}x the best fixed "
                 f"(median {statistics.median(g['vs_best_fixed'] for g in mine):.2f}x the best fixed)")
    return "Adaptive sizes against the same drafter's fixed settings:\n" + "\n".join(L)


# ---------------------------------------------------------------------------------- reporting
def format_table(result: BenchResult) -> str:
    head = (f"{'contender':<22} {'category':<14} {'temp':>4} {'bs':>3} {'tok/s':>8} {'speedup':>7} "
            f"{'95% CI':>13} {'accept':>6} {'mean len':>8} {'TTFT ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'equal':>5}")
    L = [head, "-" * len(head)]
    share = result.settings.get("greedy_share") or 0.0
    if share:
        L.insert(0, f"(a mixed load: in the rows of a temperature above 0, {share:.0%} of the requests run greedy; "
                    "'equal' counts those against none's outputs)")
    if result.rows and result.rows[0]["repeats"] < MIN_CI_REPEATS:
        L.insert(0, f"(no 95% CI: {result.rows[0]['repeats']} repeat(s) are too few to give one; "
                    f"--repeats {MIN_CI_REPEATS} or more for intervals)")
    for r in result.rows:
        ci = (f"[{r['speedup_ci_low']:.2f}, {r['speedup_ci_high']:.2f}]"
              if r["speedup_ci_low"] is not None else "-")
        ms = (lambda v: _fmt(None if v is None else v * 1000, ".1f"))
        L.append(f"{r['contender'][:22]:<22} {r['category'][:14]:<14} {r['temperature']:>4g} {r['batch_size']:>3} "
                 f"{_fmt(r['tokens_per_s'], '.1f'):>8} {_fmt(r['speedup']):>7} {ci:>13} "
                 f"{_fmt(r['acceptance_rate']):>6} {_fmt(r['mean_acceptance_length']):>8} "
                 f"{ms(r['ttft_mean_s']):>8} {ms(r['latency_p50_s']):>8} {ms(r['latency_p99_s']):>8} "
                 f"{_fmt(r['equal_rate']):>5}")
    pred = [r for r in result.rows if "prediction_similarity" in r]
    if pred:
        L += ["", f"{'predicted outputs':<22} {'category':<14} {'temp':>4} {'bs':>3} {'accepted':>9} {'rejected':>9} "
              f"{'similarity':>10}"]
        for r in pred:
            L.append(f"{r['contender'][:22]:<22} {r['category'][:14]:<14} {r['temperature']:>4g} {r['batch_size']:>3} "
                     f"{r['accepted_prediction_tokens']:>9} {r['rejected_prediction_tokens']:>9} "
                     f"{_fmt(r['prediction_similarity']):>10}")
    return "\n".join(L)


def format_peers(result: BenchResult) -> str:
    """leapfrog vs transformers on the same checkpoint (tokens/s ratio, median of repeats, 95% CI)."""
    if not result.peer_ratios:
        return ""
    L = [f"{'leapfrog':<18} {'transformers':<22} {'category':<14} {'temp':>4} {'bs':>3} {'ratio':>6} {'95% CI':>13}"]
    L.append("-" * len(L[0]))
    for r in result.peer_ratios:
        ci = f"[{r['ratio_ci_low']:.2f}, {r['ratio_ci_high']:.2f}]" if r["ratio_ci_low"] is not None else "-"
        L.append(f"{r['leapfrog'][:18]:<18} {r['transformers'][:22]:<22} {r['category'][:14]:<14} "
                 f"{r['temperature']:>4g} {r['batch_size']:>3} {_fmt(r['ratio']):>6} {ci:>13}")
    return "leapfrog vs transformers (tokens/s ratio):\n" + "\n".join(L)


def format_recommendation(result: BenchResult) -> str:
    L = ["Recommendation (best config per temperature, batch size and category; "
         f"speculation off where speedup < 1 or acceptance < {MIN_ACCEPTANCE}):"]
    for rec in result.recommendations:
        where = f"  temp {rec['temperature']:g}, batch {rec['batch_size']}, {rec['category']}: "
        if rec["speculation"] == "on":
            line = where + (f"use {rec['best']} (speedup {rec['speedup']:.2f}x, "
                            f"acceptance {rec['acceptance_rate']:.2f})")
        else:
            line = where + "turn speculation OFF (" + rec["reason"] + ")"
        if rec["off_configs"] and rec["speculation"] == "on":
            line += f"; not worth it: {', '.join(rec['off_configs'])}"
        L.append(line)
    counts = ", ".join(f"{k} {v}" for k, v in result.run_counts.items())
    L.append(f"Interleaved runs per contender: {counts}")
    return "\n".join(L)


def write_outputs(result: BenchResult, out: Path, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result.files["json"] = str(out / "bench.json")
    result.files["csv"] = str(out / "bench.csv")
    if plots:
        result.files.update(write_plots(result, out))
    with open(out / "bench.json", "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=2)
    with open(out / "bench.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in result.rows:
            row = dict(r)
            row["acceptance_by_position"] = ";".join(_fmt(x, ".4f", "") for x in r["acceptance_by_position"])
            row["speculative_config"] = json.dumps(r["speculative_config"]) if r["speculative_config"] else "none"
            w.writerow(row)


def _k_groups(contenders: dict[str, dict | None]) -> list[list[tuple[int, str]]]:
    """Sets of >= 2 configs that differ only in num_speculative_tokens: [(K, name), ...] sorted by K."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for name, spec in contenders.items():
        if spec is None or "num_speculative_tokens" not in spec or name.startswith("hf-"):
            continue
        key = json.dumps({k: v for k, v in spec.items() if k != "num_speculative_tokens"}, sort_keys=True)
        groups.setdefault(key, []).append((int(spec["num_speculative_tokens"]), name))
    return [sorted(g) for g in groups.values() if len({k for k, _ in g}) >= 2]


def _repeat_range(values: Sequence[float | None], y: float) -> tuple[float, float]:
    """(min, max) of the repeats' values around ``y`` (the median), (y, y) when none."""
    ok = [v for v in values if v is not None]
    return (min(ok + [y]), max(ok + [y])) if ok else (y, y)


def write_plots(result: BenchResult, out: Path) -> dict[str, str]:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}

    def save(fig, ax, name: str, title: str, ylabel: str = "speedup vs none") -> None:
        """The finish every plot shares: labels, the 1.0x line for speedups, legend, PNG."""
        if ylabel.startswith("speedup"):
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        files[f"plot_{name}"] = str(out / f"{name}.png")
        fig.savefig(files[f"plot_{name}"], dpi=100)
        plt.close(fig)

    spec_names = [n for n in result.contenders if n != "none"]
    t0 = result.settings["temperatures"][0]
    bs0 = result.settings["batch_sizes"][0]
    cats = result.settings["categories"] + [ALL]

    def get(n, c=ALL, t=t0, b=bs0):
        return result.row(n, c, t, b)

    # speedup by category
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * max(1, len(spec_names)) / 2), 4))
    width = 0.8 / max(1, len(spec_names))
    for i, n in enumerate(spec_names):
        ys = [get(n, c)["speedup"] or 0 for c in cats]
        spans = [_repeat_range(get(n, c)["speedup_repeats"], y) for y, c in zip(ys, cats)]
        err = [[y - lo for y, (lo, _) in zip(ys, spans)], [hi - y for y, (_, hi) in zip(ys, spans)]]
        ax.bar([x + i * width for x in range(len(cats))], ys, width, yerr=err, label=n, capsize=2)
    ax.set_xticks([x + width * (len(spec_names) - 1) / 2 for x in range(len(cats))], cats, rotation=30)
    save(fig, ax, "speedup_by_category", f"speedup by category (temp {t0:g}, batch {bs0})\n"
         "whiskers: min-max over the repeats")

    # speedup vs K
    groups = _k_groups(result.contenders)
    if groups:
        fig, ax = plt.subplots(figsize=(6, 4))
        for g in groups:
            for b in result.settings["batch_sizes"]:
                ax.plot([k for k, _ in g], [get(n, b=b)["speedup"] for _, n in g], marker="o",
                        label=f"{g[0][1].split('-k')[0]} batch {b}")
        ax.set_xticks(sorted({k for g in groups for k, _ in g}))   # integers only: K is a count
        ax.set_xlabel("num_speculative_tokens (K)")
        save(fig, ax, "speedup_vs_k", f"speedup vs K (all categories, temp {t0:g})")

    # speedup vs batch size
    fig, ax = plt.subplots(figsize=(6, 4))
    bss = result.settings["batch_sizes"]
    for n in spec_names:
        ax.plot(bss, [get(n, b=b)["speedup"] for b in bss], marker="o", label=n)
    if len(bss) > 1 and max(bss) / min(bss) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(bss, [str(b) for b in bss])   # the batch sizes run, nothing in between
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    save(fig, ax, "speedup_vs_batch", f"speedup vs batch size (all categories, temp {t0:g})")

    # acceptance by position
    fig, ax = plt.subplots(figsize=(6, 4))
    longest = 1
    for n in spec_names:
        pp = get(n)["acceptance_by_position"]
        longest = max(longest, len(pp))
        ax.plot(range(1, len(pp) + 1), [np.nan if v is None else v for v in pp], marker="o", label=n)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlim(0.5, longest + 0.5)
    ax.set_xlabel("draft position")
    ax.set_ylim(0, 1.05)
    save(fig, ax, "acceptance_by_position", f"acceptance by position (all categories, temp {t0:g}, batch {bs0})",
         ylabel="acceptance rate")
    return files
