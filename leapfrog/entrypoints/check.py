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

The functions are usable from Python: ``check_greedy``, ``check_sampling``, ``run_check``;
``cmd_check`` is the command-line shell.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

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

_SETTING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                 "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float}

Prompt = str | list[int]


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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(passed=self.passed, greedy_passed=self.greedy_passed, sampling_passed=self.sampling_passed)
        return d


# ---------------------------------------------------------------------------------- helpers
def parse_setting(text: str | dict[str, Any] | SamplingParams) -> dict[str, Any]:
    """'temperature=0.7,top_k=20' -> {'temperature': 0.7, 'top_k': 20} (validated)."""
    if isinstance(text, SamplingParams):
        return {k: getattr(text, k) for k in _SETTING_KEYS}
    if isinstance(text, dict):
        d = dict(text)
    else:
        d = {}
        for part in str(text).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ConfigError(f"sampling setting {text!r}: expected key=value pairs separated by commas")
            k, v = (s.strip() for s in part.split("=", 1))
            if k not in _SETTING_KEYS:
                raise ConfigError(f"sampling setting {text!r}: unknown key {k!r}; known: {sorted(_SETTING_KEYS)}")
            try:
                d[k] = _SETTING_KEYS[k](v)
            except ValueError:
                raise ConfigError(f"sampling setting {text!r}: {k}={v!r} is not a valid "
                                  f"{_SETTING_KEYS[k].__name__}") from None
    unknown = sorted(set(d) - set(_SETTING_KEYS))
    if unknown:
        raise ConfigError(f"sampling setting: unknown key(s) {unknown}; known: {sorted(_SETTING_KEYS)}")
    SamplingParams(**d)  # validates the values
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


# ---------------------------------------------------------------------------------- greedy
def check_greedy(base_llm, spec_llm, prompts: Sequence[Prompt], max_tokens: int = 64,
                 tie_tol: float = 1e-3, ignore_eos: bool = True) -> list[Mismatch]:
    """Greedy outputs with and without speculation; one Mismatch per prompt that diverges (at its
    first divergence: after it the two continuations have different prefixes)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    inputs = [_prompt_input(p) for p in prompts]
    base = base_llm.generate(inputs, sp, use_tqdm=False)
    spec = spec_llm.generate(inputs, sp, use_tqdm=False)
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
                   prompt_indices: Sequence[int] | None = None) -> list[TestResult]:
    """Sample the first ``num_tokens`` tokens ``samples`` times per prompt with each engine and run one
    two-sample chi-square test per (prompt, position). ``setting``: 'temperature=0.7,top_k=20', a
    dict or SamplingParams (its sampling fields)."""
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
        outs = llm.generate(inputs, sp, use_tqdm=False)
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
               max_num_seqs: int = 256, max_model_len: int | None = None, **kw) -> tuple[Any, Any]:
    """(base, spec) LLMs: same target and dtype, different engine seeds. The speculative engine's
    rows are capped at disable_by_batch_size so that speculation is not switched off by the batch."""
    from leapfrog import LLM
    from leapfrog.spec_decode.config import SpeculativeConfig

    if not isinstance(speculative_config, dict):
        raise ConfigError("leapfrog check needs a speculative config (a JSON object), got "
                          f"{speculative_config!r}")
    cfg = SpeculativeConfig.from_dict(speculative_config)  # validate before loading anything
    spec_rows = min(max_num_seqs, cfg.disable_by_batch_size or max_num_seqs)
    spec = LLM(model=model, dtype=dtype, seed=seed + 1, speculative_config=speculative_config,
               max_num_seqs=spec_rows, max_model_len=max_model_len, **kw)
    base = LLM(model=model, dtype=dtype, seed=seed, speculative_config=None, max_num_seqs=max_num_seqs,
               max_model_len=max_model_len, **kw)
    return base, spec


def run_check(base_llm, spec_llm, prompts: Sequence[Prompt], *, model: str = "", speculative_config=None,
              dtype: str = "", max_tokens: int = 64, settings: Sequence[Any] = tuple(DEFAULT_SETTINGS),
              positions: int = 2, samples: int = 2000, num_tokens: int = 3, alpha: float = 1e-3,
              tie_tol: float = 1e-3, log=None) -> CheckReport:
    """Both parts; ``settings`` empty or ``samples`` 0 skips the sampling part, ``max_tokens`` 0 the greedy one."""
    rep = CheckReport(model=model, speculative_config=speculative_config or {}, dtype=dtype, alpha=alpha)
    say = log or (lambda s: None)
    if max_tokens > 0:
        say(f"greedy: {len(prompts)} prompts x {max_tokens} tokens ...")
        before = spec_llm.get_metrics()
        rep.greedy_mismatches = check_greedy(base_llm, spec_llm, prompts, max_tokens, tie_tol)
        rep.greedy_spec_metrics = _metrics_delta(spec_llm, before)
        rep.greedy_prompts, rep.greedy_max_tokens = len(prompts), max_tokens
        rep.greedy_tokens_compared = len(prompts) * max_tokens - sum(
            max_tokens - (m.position - 1) for m in rep.greedy_mismatches)
        if not rep.greedy_spec_metrics["num_draft_tokens"]:
            rep.warnings.append("greedy part: the speculative engine drafted no tokens, so it tested nothing")
    chosen = list(range(min(positions, len(prompts))))
    if settings and samples > 0 and chosen:
        before = spec_llm.get_metrics()
        parsed = [parse_setting(s) for s in settings]
        for d in parsed:
            say(f"sampling {setting_name(d)}: {len(chosen)} prompts x {samples} samples x 2 engines ...")
            rep.sampling_tests += check_sampling(base_llm, spec_llm, [prompts[i] for i in chosen], d,
                                                 samples, num_tokens, chosen)
        rep.sampling_settings = [setting_name(d) for d in parsed]
        rep.sampling_prompts, rep.sampling_samples = chosen, samples
        rep.sampling_spec_metrics = _metrics_delta(spec_llm, before)
        n = sum(1 for t in rep.sampling_tests if t.dof > 0)
        rep.threshold = alpha / max(n, 1)
        if not rep.sampling_spec_metrics["num_draft_tokens"]:
            rep.warnings.append("sampling part: the speculative engine drafted no tokens, so it tested nothing "
                                "(try other --prompts-file prompts or more --sample-tokens)")
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
    for w in rep.warnings:
        L.append(f"\nwarning: {w}")
    L.append("\nRESULT: " + ("PASS: speculation did not change the output" if rep.passed
                             else "FAIL: speculation changed the output"))
    return "\n".join(L)


def read_prompts(path: str | None) -> list[Prompt]:
    """One prompt per line (\\n escapes allowed) or JSONL with "prompt" or "prompt_token_ids"."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    out: list[Prompt] = []
    for ln in open(path, encoding="utf-8").read().splitlines():
        if not ln.strip():
            continue
        if ln.lstrip().startswith("{"):
            try:
                d = json.loads(ln)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: invalid JSON line: {e}") from None
            if "prompt_token_ids" in d:
                out.append([int(t) for t in d["prompt_token_ids"]])
            elif isinstance(d.get("prompt"), str):
                out.append(d["prompt"])
            else:
                raise ConfigError(f"{path}: a JSON line needs 'prompt' or 'prompt_token_ids'")
        else:
            out.append(ln.replace("\\n", "\n"))
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


def cmd_check(args) -> int:
    from leapfrog.entrypoints.cli import _spec_arg

    spec, _ = _spec_arg(args.speculative_config)
    if spec is None:
        raise ConfigError("leapfrog check needs --speculative-config (a JSON object), e.g. "
                          '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    if not isinstance(spec, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {type(spec).__name__}")
    for name in ("num_prompts", "positions", "samples", "max_tokens", "sample_tokens"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 < args.alpha < 1:
        raise ConfigError("--alpha must be in (0, 1)")
    settings = [parse_setting(s) for s in (args.setting or DEFAULT_SETTINGS)]
    if args.sample_tokens is None:
        from leapfrog.spec_decode.config import SpeculativeConfig
        args.sample_tokens = min(SpeculativeConfig.from_dict(spec).num_speculative_tokens + 2, 6)
    prompts = read_prompts(args.prompts_file)
    if args.num_prompts is not None:
        prompts = prompts[:args.num_prompts]
    if not prompts:
        raise ConfigError("no prompts to check")
    model = args.model
    if model is None:
        from leapfrog.demo import default_model
        model, _ = default_model()
        print(f"[leapfrog] no --model given: using the built-in default model at {model}", file=sys.stderr)
    # Size the KV rows for the check: max_num_seqs rows of the longest prompt plus the new tokens.
    max_model_len = args.max_model_len
    if max_model_len is None:
        lens = [len(p) for p in prompts if not isinstance(p, str)]
        if any(isinstance(p, str) for p in prompts):
            from leapfrog.model.loader import load_tokenizer, resolve_model_path
            tok = load_tokenizer(args.tokenizer or resolve_model_path(model))
            lens += [len(tok.encode(p)) for p in prompts if isinstance(p, str)]
        max_model_len = max(lens) + max(args.max_tokens, args.sample_tokens) + 1
    base, spec_llm = build_llms(str(model), spec, dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs,
                                max_model_len=max_model_len, tokenizer=args.tokenizer, device=args.device,
                                skip_tokenizer_init=args.skip_tokenizer_init, batch_invariant=args.batch_invariant)
    rep = run_check(base, spec_llm, prompts, model=str(model), speculative_config=spec, dtype=args.dtype,
                    max_tokens=args.max_tokens, settings=settings, positions=args.positions, samples=args.samples,
                    num_tokens=args.sample_tokens, alpha=args.alpha, tie_tol=args.tie_tol,
                    log=lambda s: print(f"[leapfrog check] {s}", file=sys.stderr))
    print(format_report(rep))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep.to_dict(), f, indent=2)
    return 0 if rep.passed else 1


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the built-in demo model)")
    p.add_argument("--speculative-config", default=None, required=True,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="token-id prompts only (JSONL lines with prompt_token_ids)")
    p.add_argument("--prompts-file", default=None,
                   help="one prompt per line, or JSONL with 'prompt' or 'prompt_token_ids' (default: built-in)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (0 skips the greedy part)")
    p.add_argument("--samples", type=int, default=2000, help="samples per prompt and engine (0 skips sampling)")
    p.add_argument("--positions", type=int, default=2, help="how many prompts (the first ones) the sampling part uses")
    p.add_argument("--sample-tokens", type=int, default=None,
                   help="generated tokens tested per sample (default: K + 2, at most 6, so that the first "
                        "verification step carries all K drafts and a bonus token)")
    p.add_argument("--setting", action="append", default=None,
                   help="sampling setting, e.g. 'temperature=0.7,top_k=20' (repeatable; default: 4 settings)")
    p.add_argument("--alpha", type=float, default=1e-3, help="false-alarm rate of the whole sampling part")
    p.add_argument("--tie-tol", type=float, default=1e-3,
                   help="greedy: relative logit margin below which a divergence is a numeric near-tie")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batch-invariant", action="store_true",
                   help="run both engines batch-invariant (bf16 greedy outputs must then be identical)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0, help="engine seed (the speculative engine uses seed + 1)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="KV rows (sampling batches)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: longest prompt + max(--max-tokens, --sample-tokens) + 1")
    p.add_argument("--json", default=None, metavar="OUT", help="write the full report as JSON")
