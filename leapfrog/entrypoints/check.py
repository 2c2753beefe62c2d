"""``leapfrog check``: evidence that speculation did not change the output, for one model and config.

Two parts, each comparing an engine without speculation ("base") with one using the
speculative config ("spec"), the same target checkpoint and dtype:

1. Greedy (temperature 0): both engines generate for the same prompts; token ids must be
   identical. At the first divergence of a prompt we recompute the target's logits for the
   common prefix (one plain forward, no KV cache) and compare the two candidate tokens: a
   margin below ``tie_tol`` times the row's largest |logit| is a *near-tie* (batched and
   unbatched fp arithmetic may round either way; not a bug, does not fail the check), anything
   larger is a *MISMATCH* (fails).
2. Sampling: for each sampling setting, each chosen prompt is sampled ``samples`` times by each
   engine (``max_tokens`` = ``num_tokens``, unseeded, different engine seeds); for every generated
   position a two-sample chi-square test (2 x bins contingency table: tokens whose expected count
   is >= 5 in both samples, the rest pooled into a tail bin) asks whether both engines draw from
   the same distribution. With K drafts per step, token 1 comes from the prefill (speculation
   never touches it), tokens 2.. come from verification: accepted, recovered or bonus tokens.
   The check fails if any p-value is below alpha / (number of tests) (Bonferroni), so on a
   correct engine the chance of a false alarm over the whole run is at most alpha.

Sizes: the default (quick) run samples one prompt ``QUICK_SAMPLES`` times per setting and engine
(about a minute on 2 cores for the built-in pair); ``--thorough`` samples two prompts
``THOROUGH_SAMPLES`` times. ``detectable_shift`` says what a size can see: the probability mass
that must move between two tokens for one test to catch it with 80 % power.

The functions are usable from Python: ``check_greedy``, ``check_sampling``, ``run_check``;
``cmd_check`` is the command-line shell.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from leapfrog.config import SEED_END, SEED_MIN
from leapfrog.entrypoints import prompts_file
from leapfrog.entrypoints.argtypes import nonneg_float, nonneg_int, output_file, positive_int, probability
from leapfrog.errors import ConfigError, LeapfrogError
from leapfrog.sampling_params import SamplingParams

DEFAULT_PROMPTS = [
    # Repetitive prompts first: prompt-lookup (n-gram) drafting finds matches in them, so the
    # sampling part (which uses the first --positions prompts) exercises verification.
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a",
    "def quicksort(arr):",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Once upon a time, there was a",
    "x = [1, 2, 3]\ny = [v * 2 for v in x]\nprint(",
]

DEFAULT_SETTINGS = [
    "temperature=1.0",
    "temperature=0.7,top_k=20",
    "temperature=1.0,top_p=0.9",
    "temperature=1.0,min_p=0.05",
]

QUICK_SAMPLES, QUICK_POSITIONS = 400, 1
THOROUGH_SAMPLES, THOROUGH_POSITIONS = 2000, 2
POWER = 0.8

#: --tie-tol's bound: a relative logit margin this wide is no numeric near-tie
MAX_TIE_TOL = 0.1
_SETTING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                 "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float}

Prompt = prompts_file.Prompt


# ---------------------------------------------------------------------------------- results
@dataclass
class Mismatch:
    """The first divergence of one prompt's greedy output with and without speculation."""
    prompt_index: int
    position: int                 # 1-based generated token (1 = the first new token)
    base_token: int | None        # None: the base output ended here
    spec_token: int | None        # None: the speculative output ended here
    base_logit: float | None      # target logits for prompt + common prefix (fresh forward)
    spec_logit: float | None
    margin: float | None          # base_logit - spec_logit
    relative_margin: float | None  # |margin| / max(1, max |logit| of the row)
    kind: str                     # "near-tie" | "MISMATCH"
    base_text: str | None = None
    spec_text: str | None = None

    @property
    def is_bug(self) -> bool:
        return self.kind == "MISMATCH"


@dataclass
class TestResult:
    """One two-sample chi-square test: one setting, one prompt, one generated position."""
    setting: str
    prompt_index: int
    position: int                 # 1-based generated token
    samples: int                  # per engine
    bins: int
    dof: int
    statistic: float
    p_value: float
    top: list[tuple[int, int, int]] = field(default_factory=list)  # (token, base count, spec count)


@dataclass
class CheckReport:
    model: str
    speculative_config: dict[str, Any]
    dtype: str
    greedy_prompts: int = 0
    greedy_max_tokens: int = 0
    greedy_tokens_compared: int = 0
    greedy_mismatches: list[Mismatch] = field(default_factory=list)
    greedy_spec_metrics: dict[str, Any] = field(default_factory=dict)
    sampling_settings: list[str] = field(default_factory=list)
    sampling_prompts: list[int] = field(default_factory=list)
    sampling_samples: int = 0
    sampling_tests: list[TestResult] = field(default_factory=list)
    sampling_spec_metrics: dict[str, Any] = field(default_factory=dict)
    alpha: float = 1e-3
    threshold: float | None = None   # alpha / number of tests
    detectable_shift: float | None = None   # see detectable_shift(), at the run's median dof
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def greedy_passed(self) -> bool:
        return not any(m.is_bug for m in self.greedy_mismatches)

    @property
    def failed_tests(self) -> list[TestResult]:
        if self.threshold is None:
            return []
        return [t for t in self.sampling_tests if t.p_value < self.threshold]

    @property
    def sampling_passed(self) -> bool:
        return not self.failed_tests

    @property
    def passed(self) -> bool:
        return self.greedy_passed and self.sampling_passed

    @property
    def untested(self) -> list[str]:
        """The parts that ran without the speculative engine drafting a token (nothing was
        checked there: a pass would say nothing)."""
        return [part for part, ran, m in (("greedy", self.greedy_prompts, self.greedy_spec_metrics),
                                          ("sampling", self.sampling_tests, self.sampling_spec_metrics))
                if ran and not m.get("num_draft_tokens")]

    @property
    def exit_code(self) -> int:
        """0 pass, 1 fail, 3 nothing to check in some part (2 is bad input, before any report)."""
        return 1 if not self.passed else 3 if self.untested else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(passed=self.passed, greedy_passed=self.greedy_passed, sampling_passed=self.sampling_passed,
                 untested=self.untested)
        return d


# ---------------------------------------------------------------------------------- helpers
def parse_setting(text: str | dict[str, Any] | SamplingParams) -> dict[str, Any]:
    """'temperature=0.7,top_k=20' -> {'temperature': 0.7, 'top_k': 20} (validated)."""
    if isinstance(text, SamplingParams):
        d = {k: getattr(text, k) for k in _SETTING_KEYS}
    elif isinstance(text, dict):
        d = dict(text)
    else:
        d = {}
        for part in str(text).split(","):
            part = part.strip()
            if not part:   # ('' and 'a=1,,b=2': a slip, not the defaults)
                raise ConfigError(f"sampling setting {text!r}: an empty item; expected key=value pairs "
                                  "separated by commas")
            if "=" not in part:
                raise ConfigError(f"sampling setting {text!r}: expected key=value pairs separated by commas")
            k, v = (s.strip() for s in part.split("=", 1))
            if k not in _SETTING_KEYS:
                raise ConfigError(f"sampling setting {text!r}: unknown key {k!r}; known: {sorted(_SETTING_KEYS)}")
            if k in d:   # (the last one won silently)
                raise ConfigError(f"sampling setting {text!r}: {k} is given twice")
            try:
                d[k] = _SETTING_KEYS[k](v)
            except ValueError:
                raise ConfigError(f"sampling setting {text!r}: {k}={v!r} is not a valid "
                                  f"{_SETTING_KEYS[k].__name__}") from None
    unknown = sorted(set(d) - set(_SETTING_KEYS))
    if unknown:
        raise ConfigError(f"sampling setting: unknown key(s) {unknown}; known: {sorted(_SETTING_KEYS)}")
    if SamplingParams(**d).temperature == 0:  # validates the values
        raise ConfigError(f"sampling setting {setting_name(d)}: temperature 0 is greedy, which the greedy part "
                          "checks; the sampling part needs a temperature above 0")
    return d


def setting_name(d: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items()) or "defaults"


def _prompt_input(p: Prompt) -> str | dict[str, Any]:
    return p if isinstance(p, str) else {"prompt_token_ids": list(p)}


def _decode(llm, t: int | None) -> str | None:
    tok = llm.get_tokenizer()
    if tok is None or t is None:
        return None
    return tok.decode([t])


def _generate(llm, inputs: list, sp: SamplingParams, bar=None, chunk: int = 128) -> list:
    """llm.generate in chunks of ``chunk`` sequences, advancing ``bar`` after each."""
    outs: list = []
    for i in range(0, len(inputs), chunk):
        part = inputs[i:i + chunk]
        outs += llm.generate(part, sp, use_tqdm=False)
        if bar is not None:
            bar.update(len(part))
    return outs


def _metrics_delta(llm, before: dict[str, Any]) -> dict[str, Any]:
    now = llm.get_metrics()
    d = {k: now[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
    return d


def target_logits(llm, ids: Sequence[int]) -> torch.Tensor:
    """The target's logits [V] for the next token after ``ids`` (one plain forward, no KV cache)."""
    model = llm.engine.model
    with torch.no_grad():
        t = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
        pos = torch.arange(t.shape[1], device=model.device)[None]
        h = model(t, pos).hidden[0, -1:]
        return model.compute_logits(h)[0].float().cpu()


def classify_margin(margin: float, scale: float, tie_tol: float) -> tuple[float, str]:
    """(relative margin, kind): a margin within tie_tol of the row's logit scale is a near-tie."""
    rel = abs(margin) / max(1.0, scale)
    return rel, ("near-tie" if rel <= tie_tol else "MISMATCH")


def detectable_shift(samples: int, threshold: float, dof: int = 5, power: float = POWER, base_p: float = 0.25) -> float:
    """The smallest probability mass δ that, moved from one token to another (both near
    ``base_p``), one two-sample chi-square test with ``samples`` draws per engine rejects with
    probability ``power`` at level ``threshold``. Under that change the statistic is noncentral
    chi-square with λ = (n/2) Σ (p1 - p2)² / p̄ = (n/2) · 2δ² / base_p (n = samples per engine)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    crit = chi2.isf(threshold, dof)
    lam = brentq(lambda x: ncx2.sf(crit, dof, x) - power, 1e-6, 1e6)
    return float(np.sqrt(lam * base_p / samples))


# ---------------------------------------------------------------------------------- greedy
def check_greedy(base_llm, spec_llm, prompts: Sequence[Prompt], max_tokens: int = 64,
                 tie_tol: float = 1e-3, ignore_eos: bool = True, bar=None) -> list[Mismatch]:
    """Greedy outputs with and without speculation; one Mismatch per prompt that diverges (at its
    first divergence: after it the two continuations have different prefixes). ``bar``: a
    progress bar advanced by one per generated sequence."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    inputs = [_prompt_input(p) for p in prompts]
    base = _generate(base_llm, inputs, sp, bar)
    spec = _generate(spec_llm, inputs, sp, bar)
    out = []
    for i, (b, s) in enumerate(zip(base, spec)):
        a, c = list(b.outputs[0].token_ids), list(s.outputs[0].token_ids)
        if a == c:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, c)) if x != y), min(len(a), len(c)))
        bt = a[pos] if pos < len(a) else None
        st = c[pos] if pos < len(c) else None
        bl = sl = margin = rel = None
        kind = "MISMATCH"
        if bt is not None and st is not None:
            logits = target_logits(base_llm, list(b.prompt_token_ids) + a[:pos])
            bl, sl = float(logits[bt]), float(logits[st])
            margin = bl - sl
            rel, kind = classify_margin(margin, float(logits.abs().max()), tie_tol)
        out.append(Mismatch(i, pos + 1, bt, st, bl, sl, margin, rel, kind,
                            _decode(base_llm, bt), _decode(base_llm, st)))
    return out


# ---------------------------------------------------------------------------------- sampling
def chi2_two_sample(a: np.ndarray, b: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float, int]:
    """Two-sample chi-square test of homogeneity on token counts ``a``, ``b`` [V].

    Bins: tokens whose expected count is >= min_expected in both samples; the others are pooled
    into one tail bin (merged into the smallest bin if the tail itself is too small).
    Returns (statistic, dof, p-value, bins); fewer than 2 bins -> (0, 0, 1.0, bins)."""
    try:
        from scipy.stats import chi2_contingency
    except ImportError:  # pragma: no cover - scipy is a dependency
        raise LeapfrogError("leapfrog check needs scipy for its chi-square tests: pip install scipy") from None
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    na, nb = a.sum(), b.sum()
    if na == 0 or nb == 0:
        return 0.0, 0, 1.0, 0
    pooled = a + b
    frac = min(na, nb) / (na + nb)
    big = pooled * frac >= min_expected
    cols_a, cols_b = list(a[big]), list(b[big])
    tail_a, tail_b = a[~big].sum(), b[~big].sum()
    if tail_a + tail_b > 0:
        if (tail_a + tail_b) * frac >= min_expected or not cols_a:
            cols_a.append(tail_a)
            cols_b.append(tail_b)
        else:
            j = int(np.argmin(np.array(cols_a) + np.array(cols_b)))
            cols_a[j] += tail_a
            cols_b[j] += tail_b
    bins = len(cols_a)
    if bins < 2:
        return 0.0, 0, 1.0, bins
    res = chi2_contingency(np.array([cols_a, cols_b]), correction=False)
    return float(res[0]), int(res[2]), float(res[1]), bins


def check_sampling(base_llm, spec_llm, prompts: Prompt | Sequence[Prompt], setting: Any = "temperature=1.0",
                   samples: int = 2000, num_tokens: int = 3,
                   prompt_indices: Sequence[int] | None = None, bar=None) -> list[TestResult]:
    """Sample the first ``num_tokens`` tokens ``samples`` times per prompt with each engine and run one
    two-sample chi-square test per (prompt, position). ``setting``: 'temperature=0.7,top_k=20', a
    dict or SamplingParams (its sampling fields). ``bar`` advances by one per sequence."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # one prompt
    prompts = list(prompts)
    idx = list(prompt_indices) if prompt_indices is not None else list(range(len(prompts)))
    d = parse_setting(setting)
    sp = SamplingParams(**d, max_tokens=num_tokens, ignore_eos=True)
    inputs = [_prompt_input(p) for p in prompts for _ in range(samples)]
    results: list[TestResult] = []
    draws = []
    for llm in (base_llm, spec_llm):
        outs = _generate(llm, inputs, sp, bar)
        draws.append([list(o.outputs[0].token_ids) for o in outs])
    V = base_llm.engine.vocab_size
    for i in range(len(prompts)):
        for pos in range(num_tokens):
            counts = []
            for dr in draws:
                toks = [ids[pos] for ids in dr[i * samples:(i + 1) * samples] if len(ids) > pos]
                counts.append(np.bincount(np.array(toks, dtype=np.int64), minlength=V))
            stat, dof, p, bins = chi2_two_sample(counts[0], counts[1])
            order = np.argsort(-(counts[0] + counts[1]), kind="stable")[:5]
            top = [(int(t), int(counts[0][t]), int(counts[1][t])) for t in order if counts[0][t] + counts[1][t]]
            results.append(TestResult(setting_name(d), idx[i], pos + 1, samples, bins, dof, stat, p, top))
    return results


# ---------------------------------------------------------------------------------- the whole check
def build_llms(model: str, speculative_config: dict[str, Any], *, dtype: str = "float32", seed: int = 0,
               max_num_seqs: int = 64, max_model_len: int | None = None, **kw) -> tuple[Any, Any]:
    """(base, spec) LLMs: same target and dtype, different engine seeds. The speculative engine
    runs with disable_by_batch_size lifted, so that every sequence of the check's large batches is
    speculated (the switch only turns speculation off; what it turns off is what is checked)."""
    from leapfrog import LLM
    from leapfrog.spec_decode.config import SpeculativeConfig

    if not isinstance(speculative_config, dict):
        raise ConfigError("leapfrog check needs a speculative config (a JSON object), got "
                          f"{speculative_config!r}")
    SpeculativeConfig.from_dict(speculative_config)  # validate before loading anything
    spec, _ = _speculative_llm(model, speculative_config, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
                               max_model_len=max_model_len, **kw)
    base = LLM(model=model, dtype=dtype, seed=seed, speculative_config=None, max_num_seqs=max_num_seqs,
               max_model_len=max_model_len, **kw)
    return base, spec


def _speculative_llm(model: str, speculative_config: dict[str, Any], *, seed: int, share_with: Any = None,
                     **kw) -> tuple[Any, str | None]:
    """The check's speculative engine: engine seed ``seed`` + 1, disable_by_batch_size lifted
    (``build_llms``); on ``share_with``'s loaded target where it may share it, else (a target that
    streams its weights beside a drafter: ``LLM.sharing_if_possible``) on a copy of its own
    -> (the LLM, why it holds its own copy or None)."""
    from leapfrog import LLM

    kw = dict(model=model, seed=seed + 1, speculative_config={**speculative_config, "disable_by_batch_size": None},
              **kw)
    return (LLM(**kw), None) if share_with is None else LLM.sharing_if_possible(share_with, **kw)


def pinned_sizes(speculative_config: dict[str, Any]) -> tuple[dict[str, Any], int] | None:
    """``speculative_config`` with its adaptive draft sizes ("adaptive": true, "num_draft_tokens":
    "auto") fixed at the most the controller may draft a step, and that many tokens; None where the
    sizes are fixed already. (The controller starts each batch size with plain steps and may settle
    on drafting nothing: sampling a large batch of short sequences, the check's sampling part, it
    drafted no token at all. It only chooses how many tokens to draft: every size is verified by
    the same code.)"""
    from leapfrog.spec_decode.config import EAGLE_METHODS, SpeculativeConfig

    cfg = SpeculativeConfig.from_dict(speculative_config)
    if not (cfg.adaptive or cfg.num_draft_tokens == "auto"):
        return None
    pinned = {k: v for k, v in speculative_config.items()
              if k not in ("adaptive", "adaptive_explore_interval", "num_draft_tokens")}
    n = cfg.num_speculative_tokens
    if cfg.method in EAGLE_METHODS and cfg.speculative_token_tree is None:
        n = pinned["num_draft_tokens"] = min(cfg.draft_budget, cfg.tree_candidates)   # (the grown tree's nodes)
    SpeculativeConfig.from_dict(pinned)
    return pinned, n


def build_sampling_llm(model: str, speculative_config: dict[str, Any], spec_llm, *, dtype: str = "float32",
                       seed: int = 0, max_num_seqs: int = 64, max_model_len: int | None = None,
                       **kw) -> tuple[Any, str] | None:
    """The sampling part's speculative engine where the config's draft sizes are adaptive
    (``pinned_sizes``): the same config with the sizes pinned, on ``spec_llm``'s loaded target
    where it may share it (else on a copy, which the note says) -> (that LLM, a note for the report); None where the sizes are fixed
    (the sampling part runs ``spec_llm``)."""
    got = pinned_sizes(speculative_config)
    if got is None:
        return None
    pinned, n = got
    llm, own = _speculative_llm(model, pinned, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, share_with=spec_llm, **kw)
    note = (f"the draft sizes are adaptive: the greedy part ran them as configured, the sampling part at the most "
            f"the controller may draft a step ({n} tokens), since it may choose to draft nothing there "
            "(every size is verified by the same code)")
    if own is not None:   # (a third copy of the target's weights in memory: said, not silent)
        note += f"; that engine loaded its own copy of the target ({own})"
    return llm, note


def run_check(base_llm, spec_llm, prompts: Sequence[Prompt], *, model: str = "", speculative_config=None,
              dtype: str = "", max_tokens: int = 64, settings: Sequence[Any] = tuple(DEFAULT_SETTINGS),
              positions: int = 2, samples: int = 2000, num_tokens: int = 3, alpha: float = 1e-3,
              tie_tol: float = 1e-3, log=None, progress: bool = False,
              sampling_llm: tuple[Any, str] | None = None) -> CheckReport:
    """Both parts; ``settings`` empty or ``samples`` 0 skips the sampling part, ``max_tokens`` 0 the
    greedy one. ``progress``: one bar over every generated sequence (throttled when not a terminal).
    ``sampling_llm``: the sampling part's speculative engine and a note on it (``build_sampling_llm``;
    default: ``spec_llm``)."""
    from leapfrog.progress import progress_bar

    t_start = time.perf_counter()
    rep = CheckReport(model=model, speculative_config=speculative_config or {}, dtype=dtype, alpha=alpha)
    if (speculative_config or {}).get("disable_by_batch_size") is not None:
        rep.notes.append("disable_by_batch_size was lifted so that every sequence was speculated")
    say = log or (lambda s: None)
    chosen = list(range(min(positions, len(prompts))))
    sampling = bool(settings and samples > 0 and chosen)
    if max_tokens > 0:
        say(f"greedy: {len(prompts)} prompts x {max_tokens} tokens x 2 engines")
    if sampling:
        n_tests = len(settings) * len(chosen) * num_tokens
        shift = detectable_shift(samples, alpha / n_tests)
        say(f"sampling: {len(settings)} settings x {len(chosen)} prompts x {samples} samples x 2 engines; "
            f"each of the {n_tests} tests catches (power {POWER:g}) about {shift:.2f} of probability moved "
            "between two tokens of probability 0.25 (--thorough or --samples N for finer)")
    total = 2 * len(prompts) * (max_tokens > 0) + 2 * len(settings) * len(chosen) * samples * sampling
    bar = progress_bar(total=total, desc="leapfrog check", unit="seq", disable=not progress)
    if max_tokens > 0:
        before = spec_llm.get_metrics()
        rep.greedy_mismatches = check_greedy(base_llm, spec_llm, prompts, max_tokens, tie_tol, bar=bar)
        rep.greedy_spec_metrics = _metrics_delta(spec_llm, before)
        rep.greedy_prompts, rep.greedy_max_tokens = len(prompts), max_tokens
        rep.greedy_tokens_compared = len(prompts) * max_tokens - sum(
            max_tokens - (m.position - 1) for m in rep.greedy_mismatches)
        if not rep.greedy_spec_metrics["num_draft_tokens"]:
            rep.warnings.append("greedy part: the speculative engine drafted no tokens, so it tested nothing")
    if sampling:
        sampler_llm = spec_llm
        if sampling_llm is not None:
            sampler_llm = sampling_llm[0]
            rep.notes.append(sampling_llm[1])
        before = sampler_llm.get_metrics()
        parsed = [parse_setting(s) for s in settings]
        for d in parsed:
            bar.set_postfix_str(setting_name(d), refresh=False)
            rep.sampling_tests += check_sampling(base_llm, sampler_llm, [prompts[i] for i in chosen], d,
                                                 samples, num_tokens, chosen, bar=bar)
        rep.sampling_settings = [setting_name(d) for d in parsed]
        rep.sampling_prompts, rep.sampling_samples = chosen, samples
        rep.sampling_spec_metrics = _metrics_delta(sampler_llm, before)
        tested = [t for t in rep.sampling_tests if t.dof > 0]
        rep.threshold = alpha / max(len(tested), 1)
        if tested:
            rep.detectable_shift = detectable_shift(samples, rep.threshold, int(np.median([t.dof for t in tested])))
        if not rep.sampling_spec_metrics["num_draft_tokens"]:
            rep.warnings.append("sampling part: the speculative engine drafted no tokens, so it tested nothing "
                                "(try other --prompts-file prompts or more --sample-tokens)")
    bar.close()
    rep.seconds = time.perf_counter() - t_start
    return rep


def _tok(t: int | None, text: str | None) -> str:
    if t is None:
        return "<end>"
    return f"{t} {text!r}" if text is not None else str(t)


def format_report(rep: CheckReport) -> str:
    L = [f"leapfrog check: {rep.model}  dtype {rep.dtype}",
         f"  speculative config: {json.dumps(rep.speculative_config)}"]
    if rep.greedy_prompts:
        m = rep.greedy_spec_metrics
        acc = f"{m['acceptance_rate']:.2f}" if m.get("acceptance_rate") is not None else "-"
        same = rep.greedy_prompts - len(rep.greedy_mismatches)
        L.append(f"\nGreedy (temperature 0): {rep.greedy_prompts} prompts x {rep.greedy_max_tokens} tokens; "
                 f"drafted {m['num_draft_tokens']} tokens, accepted {m['num_accepted_tokens']} ({acc})")
        L.append(f"  {same}/{rep.greedy_prompts} prompts token-for-token identical")
        for x in rep.greedy_mismatches:
            where = f"  prompt {x.prompt_index}, token {x.position}: base {_tok(x.base_token, x.base_text)} " \
                    f"vs speculative {_tok(x.spec_token, x.spec_text)}"
            if x.margin is not None:
                where += f"; target logit margin {x.margin:.3g} (relative {x.relative_margin:.2g})"
            verdict = ("numeric near-tie (both tokens are the target's argmax up to rounding): not a bug"
                       if x.kind == "near-tie" else "a real difference: speculation changed the output")
            L.append(f"{where}\n    -> {x.kind}: {verdict}")
        L.append("  greedy: " + ("PASS" if rep.greedy_passed else "FAIL"))
    if rep.sampling_tests:
        m = rep.sampling_spec_metrics
        acc = f"{m['acceptance_rate']:.2f}" if m.get("acceptance_rate") is not None else "-"
        n = sum(1 for t in rep.sampling_tests if t.dof > 0)
        ns = len(rep.sampling_settings)
        L.append(f"\nSampling: {ns} setting{'s' if ns != 1 else ''} x prompts {rep.sampling_prompts} x "
                 f"{max(t.position for t in rep.sampling_tests)} tokens; {rep.sampling_samples} samples per "
                 f"engine each; drafted {m['num_draft_tokens']} tokens, accepted {m['num_accepted_tokens']} ({acc})")
        L.append(f"  {n} two-sample chi-square tests; fail if p < alpha / {n} = {rep.threshold:.2g} (Bonferroni: "
                 f"on a correct engine a false alarm happens in at most {rep.alpha:g} of runs)")
        L.append("  token 1 comes from the prefill (never speculated); tokens 2+ from verification")
        if rep.detectable_shift is not None and rep.detectable_shift >= 0.25:   # (all a 0.25 token has)
            L.append(f"  power: none to speak of: with {rep.sampling_samples} samples a test misses even a token of probability "
                     "0.25 losing all of it; use --thorough or more --samples")
        elif rep.detectable_shift is not None:
            L.append(f"  power: each test catches (in {POWER:.0%} of runs) {rep.detectable_shift:.3f} of probability "
                     "moved between two tokens of probability 0.25; smaller differences can pass "
                     "(--thorough, or more --samples, sees finer: the size shrinks as 1/sqrt(samples))")
        width = max(len(s) for s in rep.sampling_settings)
        by: dict[tuple[str, int], list[TestResult]] = {}
        for t in rep.sampling_tests:
            by.setdefault((t.setting, t.prompt_index), []).append(t)
        failed = {id(t) for t in rep.failed_tests}
        L.append(f"  {'setting':<{width}}  prompt  p-value of token 1, 2, ... (* = FAIL, - = one bin: nothing to test)")
        for (s, i), ts in by.items():
            cells = "  ".join(("-" if not t.dof else f"{t.p_value:.2g}" + ("*" if id(t) in failed else ""))
                              .ljust(8) for t in ts)
            L.append(f"  {s:<{width}}  {i:>6}  {cells.rstrip()}")
        L.append("  sampling: " + ("PASS" if rep.sampling_passed else "FAIL"))
    for note in rep.notes:
        L.append(f"\nnote: {note}")
    for w in rep.warnings:
        L.append(f"\nwarning: {w}")
    if not rep.passed:
        result = "FAIL: speculation changed the output"
    elif rep.untested:
        result = (f"NOT TESTED: the speculative engine drafted no tokens in the {' and '.join(rep.untested)} "
                  "part, so speculation was never exercised there (other prompts, --max-tokens or "
                  "--sample-tokens, or a config that drafts)")
    else:
        result = "PASS: speculation did not change the output"
    L.append(f"\nRESULT: {result}  ({rep.seconds:.0f} s)")
    return "\n".join(L)


def read_prompts(path: str | None) -> list[Prompt]:
    """The prompts of ``--prompts-file`` (entrypoints/prompts_file.py), or the default ones."""
    return list(DEFAULT_PROMPTS) if path is None else prompts_file.read_prompts(path)


def cmd_check(args) -> int:
    from leapfrog.entrypoints.cli import _spec_arg

    spec, given = _spec_arg(args.speculative_config)
    model = args.model
    if model is None:   # the built-in pair with the speculation `generate` uses
        from leapfrog.demo import default_model
        model, default_spec = default_model(args.dtype, getattr(args, "device", "auto"))
        if not given:
            spec = default_spec
        print(f"[leapfrog] no --model given: using the built-in default model at {model}", file=sys.stderr)
    if spec is None:
        raise ConfigError("leapfrog check needs --speculative-config (a JSON object) with --model, e.g. "
                          '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    if not isinstance(spec, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {type(spec).__name__}")
    for name in ("num_prompts", "positions", "samples", "max_tokens", "sample_tokens"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 < args.alpha < 1:
        raise ConfigError("--alpha must be in (0, 1)")
    if args.tie_tol >= MAX_TIE_TOL:   # (1e308: every divergence a near-tie, a check that cannot fail)
        raise ConfigError(f"--tie-tol {args.tie_tol:g}: must be below {MAX_TIE_TOL:g} (a relative logit margin; "
                          "wider ones are no numeric near-ties)")
    if not SEED_MIN <= args.seed < SEED_END - 1:   # (the engine's range, less one: named with the value given)
        raise ConfigError(f"--seed {args.seed}: must be an integer in [-2**63, 2**64 - 1) (the speculative "
                          "engine runs with seed + 1)")
    if args.samples == 0 or args.positions == 0:   # the sampling part is skipped: its flags would do nothing
        skipped = "--samples 0" if args.samples == 0 else "--positions 0"
        unread = [f for f, given in (("--setting", args.setting), ("--thorough", args.thorough),
                                     ("--sample-tokens", args.sample_tokens is not None),
                                     ("--positions" if args.samples == 0 else "--samples",
                                      (args.positions if args.samples == 0 else args.samples) not in (None, 0)))
                  if given]
        if unread:
            raise ConfigError(f"{', '.join(unread)}: the sampling part's options, and {skipped} skips it")
    settings = [parse_setting(s) for s in (args.setting or DEFAULT_SETTINGS)]
    if args.sample_tokens is None:
        from leapfrog.spec_decode.config import SpeculativeConfig
        args.sample_tokens = min(SpeculativeConfig.from_dict(spec).num_speculative_tokens + 2, 6)
    if args.samples is None:
        args.samples = THOROUGH_SAMPLES if args.thorough else QUICK_SAMPLES
    positions_given = args.positions is not None
    if args.positions is None:
        args.positions = THOROUGH_POSITIONS if args.thorough else QUICK_POSITIONS
    if args.max_tokens == 0 and (args.samples == 0 or args.positions == 0):
        raise ConfigError("nothing to check: --max-tokens 0 skips the greedy part and --samples/--positions 0 "
                          "the sampling part")
    prompts = read_prompts(args.prompts_file)
    if args.num_prompts is not None:
        prompts = prompts[:args.num_prompts]
    if not prompts:
        raise ConfigError("no prompts to check")
    if positions_given and args.positions > len(prompts):   # (it was cut to the prompts there are)
        raise ConfigError(f"--positions {args.positions}: there are {len(prompts)} prompts to sample from "
                          "(--num-prompts, --prompts-file)")
    # Size the KV rows for the check: max_num_seqs rows of the longest prompt plus the new tokens.
    max_model_len = args.max_model_len
    if max_model_len is None:
        lens = [len(p) for p in prompts if not isinstance(p, str)]
        if any(isinstance(p, str) for p in prompts):
            from leapfrog.model.loader import load_tokenizer, resolve_model_path
            tok = load_tokenizer(args.tokenizer or resolve_model_path(model))
            lens += [len(tok.encode(p)) for p in prompts if isinstance(p, str)]
        max_model_len = max(lens) + max(args.max_tokens, args.sample_tokens) + 1
    engine = dict(dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                  tokenizer=args.tokenizer, device=args.device, skip_tokenizer_init=args.skip_tokenizer_init,
                  batch_invariant=args.batch_invariant)
    base, spec_llm = build_llms(str(model), spec, **engine)
    sampled = args.samples > 0 and args.positions > 0
    pinned = build_sampling_llm(str(model), spec, spec_llm, **engine) if sampled else None
    rep = run_check(base, spec_llm, prompts, model=str(model), speculative_config=spec, dtype=args.dtype,
                    max_tokens=args.max_tokens, settings=settings, positions=args.positions, samples=args.samples,
                    num_tokens=args.sample_tokens, alpha=args.alpha, tie_tol=args.tie_tol,
                    log=lambda s: print(f"[leapfrog check] {s}", file=sys.stderr), progress=not args.no_progress,
                    sampling_llm=pinned)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep.to_dict(), f, indent=2)
    return rep.exit_code


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the built-in demo model)")
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (needed with --model; '
                        "default without --model: the built-in pair's own speculation, as in `generate`)")
    p.add_argument("--thorough", action="store_true",
                   help=f"sample {THOROUGH_POSITIONS} prompts {THOROUGH_SAMPLES} times per setting and engine "
                        f"(default: {QUICK_POSITIONS} prompt x {QUICK_SAMPLES}, about a minute on 2 cores for the "
                        "built-in pair); finer differences show, in about 10x the time")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="token-id prompts only (JSONL lines with prompt_token_ids)")
    p.add_argument("--prompts-file", default=None,
                   help="one prompt per line, or JSONL with 'prompt' or 'prompt_token_ids' (default: built-in)")
    p.add_argument("--num-prompts", type=positive_int, default=None, help="use the first N prompts")
    p.add_argument("--max-tokens", type=nonneg_int, default=64, help="greedy tokens per prompt (0 skips the greedy part)")
    p.add_argument("--samples", type=nonneg_int, default=None,
                   help=f"samples per prompt and engine (0 skips sampling; default {QUICK_SAMPLES}, "
                        f"{THOROUGH_SAMPLES} with --thorough)")
    p.add_argument("--positions", type=nonneg_int, default=None,
                   help="how many prompts (the first ones) the sampling part uses (default "
                        f"{QUICK_POSITIONS}, {THOROUGH_POSITIONS} with --thorough)")
    p.add_argument("--sample-tokens", type=positive_int, default=None,
                   help="generated tokens tested per sample (default: K + 2, at most 6, so that the first "
                        "verification step carries all K drafts and a bonus token)")
    p.add_argument("--setting", action="append", default=None,
                   help="sampling setting, e.g. 'temperature=0.7,top_k=20' (repeatable; default: 4 settings)")
    p.add_argument("--alpha", type=probability, default=1e-3, help="false-alarm rate of the whole sampling part")
    p.add_argument("--tie-tol", type=nonneg_float, default=1e-3,
                   help="greedy: relative logit margin below which a divergence is a numeric near-tie")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batch-invariant", action="store_true",
                   help="run both engines batch-invariant (bf16 greedy outputs must then be identical)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0, help="engine seed (the speculative engine uses seed + 1)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="KV rows (sampling batches)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: longest prompt + max(--max-tokens, --sample-tokens) + 1")
    p.add_argument("--json", default=None, metavar="OUT", type=output_file, help="write the full report as JSON")
