"""The one sampler: logits -> processed probabilities -> tokens.

Three callers share it (never re-implement a transform elsewhere): the target's normal
decode, the draft model's proposals (its q), and the verifier (the target's p, the bonus
and recovered tokens). Rows are independent; every row carries its request's
SamplingParams and the token history that penalties and min_tokens read.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from leapfrog.sampling import native
from leapfrog.sampling import processors as P
from leapfrog.sampling.grammar import GrammarState
from leapfrog.sampling_params import SamplingParams


@dataclass(frozen=True)
class BadWords:
    """A request's bad_words as token ids (each word as written and, where it differs, with a
    leading space: ``LLMEngine.encode_bad_words``), indexed once so a row's check costs one dict lookup
    per distinct word length, not one comparison per word (a request with 100k bad words made
    every step of its batch take 2.9 s for 6 rows in that loop; indexed, 0.4 ms)."""
    words: tuple[tuple[int, ...], ...] = ()
    always: frozenset[int] = field(init=False, compare=False)   # one-token words: banned everywhere
    ends: dict[int, dict[tuple[int, ...], list[int]]] = field(init=False, repr=False, compare=False)
    # (prefix length n >= 1 -> the last n output tokens -> the tokens they ban next)

    def __post_init__(self) -> None:
        words = tuple(tuple(w) for w in self.words if len(w))
        ends: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for w in words:
            if len(w) > 1:
                last = ends.setdefault(len(w) - 1, {}).setdefault(w[:-1], [])
                if w[-1] not in last:
                    last.append(w[-1])
        object.__setattr__(self, "words", words)
        object.__setattr__(self, "always", frozenset(w[0] for w in words if len(w) == 1))
        object.__setattr__(self, "ends", ends)

    def __bool__(self) -> bool:
        return bool(self.words)

    def ending(self, output_ids: Sequence[int]) -> list[list[int]]:
        """The last tokens of the words of several tokens whose others end ``output_ids`` (the
        prompt does not count: vLLM's rule), as the index's own lists, one per matching prefix
        (the one-token words aside: RuleTensors.never masks them; RuleTensors.group keeps a long
        list's tensor)."""
        out: list[list[int]] = []
        m = len(output_ids)
        for n, by_prefix in self.ends.items():
            if n <= m and (group := by_prefix.get(tuple(output_ids[m - n:]))) is not None:
                out.append(group)
        return out


@dataclass
class OutputCounts:
    """How often each token occurs in a request's first ``n`` output tokens (penalties), kept as
    its output grows: counted afresh for each row, 8k output tokens cost a step of 6 rows
    11-12 ms with a 128k vocabulary (now 1.7-2.2 ms)."""
    counts: Tensor   # [V] float32
    n: int = 0

    def upto(self, output_ids: Sequence[int], committed: int) -> Tensor:
        """The counts of ``output_ids[:committed]`` (the request's output, not its drafts:
        committed tokens never change, so only the new ones are added)."""
        if committed < self.n:   # (never in the engine: its output only grows)
            self.counts.zero_()
            self.n = 0
        if committed > self.n:
            new = torch.tensor(output_ids[self.n:committed], dtype=torch.long, device=self.counts.device)
            self.counts.index_put_((new,), torch.ones(len(new), device=self.counts.device), accumulate=True)
            self.n = committed
        return self.counts


@dataclass(frozen=True)
class RuleTensors:
    """The tensors of a request's rules that depend on its params and prompt only, built at its
    first row and kept for every row of every step after (Request.rule_tensors): rebuilt per row,
    a 128k vocabulary cost 110 ms a step of 6 rows for an allowed_token_ids of the whole
    vocabulary, 350 ms for a logit_bias of it, 26 ms for a penalty's 32k-token prompt, 100k
    one-token bad words 0.24 s (stop ids under min_tokens ~0.1 s)."""
    outside: Tensor | None       # [V] bool: not in allowed_token_ids (None: no such list)
    bias_ids: Tensor | None      # [M] long: logit_bias's tokens (None: no bias, or a dense one)
    bias_values: Tensor | None   # [M] float32
    bias_dense: Tensor | None    # [V] float32: a logit_bias of DENSE_BIAS_SHARE of the vocabulary or more
    prompt_seen: Tensor | None   # [V] bool: in the prompt (None: no penalties)
    never: Tensor | None         # [V] bool: one-token bad words (None: none)
    stops: Tensor | None         # [V] bool: EOS and stop_token_ids, banned under min_tokens (None: no min_tokens)
    groups: dict = field(default_factory=dict, compare=False)   # id(a BadWords.ending list) -> its ids [n]
    output_counts: OutputCounts | None = field(default=None, compare=False)   # (penalties: the request's own)

    def group(self, last: list[int], device: torch.device | str) -> Tensor:
        """A long list of bad words' last tokens (one prefix, BadWords.ending) as a tensor, built
        the first time a row ends with its prefix (128k words after one token: 118 ms a step)."""
        t = self.groups.get(id(last))
        if t is None:
            t = self.groups[id(last)] = torch.tensor(last, dtype=torch.long, device=device)
        return t

    @staticmethod
    def of(spec: "RowSpec", vocab_size: int, device: torch.device | str) -> "RuleTensors":
        """The params' tensors come from ``spec.shared`` when another request with the same
        params (a choice of the same API request) built them; the prompt's are this request's."""
        base = _kept(spec.shared, (vocab_size, str(device)), lambda: RuleTensors._of_params(spec, vocab_size, device))
        if not spec.params.has_penalties:
            return base
        return dataclasses.replace(base, prompt_seen=_mask(spec.prompt_ids, vocab_size, device),   # (groups shared)
                                   output_counts=OutputCounts(torch.zeros(vocab_size, device=device)))

    @staticmethod
    def _of_params(spec: "RowSpec", vocab_size: int, device: torch.device | str) -> "RuleTensors":
        params = spec.params
        bias_ids = bias_values = bias_dense = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            bias_values = torch.tensor([float(v) for v in params.logit_bias.values()], dtype=torch.float32,
                                       device=device)
            if len(params.logit_bias) >= DENSE_BIAS_SHARE * vocab_size:   # (ids are unique: a dict's keys)
                bias_dense = torch.zeros(vocab_size, dtype=torch.float32, device=device).index_put_(
                    (bias_ids,), bias_values)
                bias_ids = bias_values = None
        allowed = params.allowed_token_ids
        return RuleTensors(
            outside=_mask(allowed, vocab_size, device, False) if allowed is not None else None,
            bias_ids=bias_ids, bias_values=bias_values, bias_dense=bias_dense, prompt_seen=None,
            never=_mask(spec.bad_words.always, vocab_size, device) if spec.bad_words.always else None,
            stops=_mask(spec.stop_ids, vocab_size, device) if params.min_tokens and spec.stop_ids else None)


def _kept(memo: dict | None, key: tuple, build: Callable[[], RuleTensors]) -> RuleTensors:
    """``memo[key]``, built the first time (no memo: built at every call)."""
    got = memo.get(key) if memo is not None else None
    if got is None:
        got = build()
        if memo is not None:
            memo[key] = got
    return got


def _mask(ids: Sequence[int], vocab_size: int, device: torch.device | str, value: bool = True) -> Tensor:
    """[V] bool: ``value`` at ``ids``, the opposite elsewhere."""
    m = torch.full((vocab_size,), not value, dtype=torch.bool, device=device)
    if len(ids):
        m[torch.tensor(list(ids), dtype=torch.long, device=device)] = value
    return m


@dataclass(frozen=True)
class RowSpec:
    """What processing one logits row needs."""
    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]        # generated tokens before this row (drafts included)
    stop_ids: tuple[int, ...] = ()   # EOS + stop_token_ids, suppressed while < min_tokens
    bad_words: BadWords = BadWords()   # bad_words, tokenized and indexed (Request.bad_words)
    grammar: GrammarState | None = None   # structured outputs: the request's matcher (sampling/grammar.py)
    memo: dict | None = field(default=None, compare=False)
    # (the request's RuleTensors by (vocab size, device), filled at its first row; None: built per row)
    shared: dict | None = field(default=None, compare=False)
    # (the params' own part of them, shared by the requests of one Prepared: request.py)
    committed: int | None = None
    # (how many of output_ids are the request's output, the rest drafts; None: unknown, counted per row)

    def rule_tensors(self, vocab_size: int, device: torch.device | str) -> RuleTensors:
        return _kept(self.memo, (vocab_size, str(device)), lambda: RuleTensors.of(self, vocab_size, device))


@dataclass
class RowBatch:
    """Tensors for N rows (see RowSpec)."""
    greedy: Tensor        # [N] bool
    temperature: Tensor   # [N]
    top_k: Tensor         # [N] long (0 = off)
    top_p: Tensor         # [N]
    min_p: Tensor         # [N]
    penalties: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None  # seen, counts, rep, pres, freq
    masked: Tensor | None   # [N, V] bool: allowed_token_ids, bad_words, min_tokens (None: no row masks)
    bias: P.LogitBias | None   # logit_bias's entries (None: no row has any)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool


def build_rows(specs: Sequence[RowSpec], vocab_size: int, device: torch.device | str = "cpu") -> RowBatch:
    ps = [s.params for s in specs]
    f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
    penalties = None
    if any(p.has_penalties for p in ps):
        N = len(specs)
        seen = torch.zeros(N, vocab_size, dtype=torch.bool, device=device)
        counts = torch.zeros(N, vocab_size, dtype=torch.float32, device=device)
        rows: list[int] = []
        ids: list[int] = []
        for i, s in enumerate(specs):
            if s.params.has_penalties:
                rt = s.rule_tensors(vocab_size, device)
                seen[i] = rt.prompt_seen
                start = 0
                if s.committed is not None and s.memo is not None:   # (the request's output counted as it grew)
                    counts[i] = rt.output_counts.upto(s.output_ids, s.committed)
                    start = s.committed
                rows += [i] * (len(s.output_ids) - start)
                ids += s.output_ids[start:]
        if ids:   # (one scatter for every row's output counts)
            counts.index_put_((torch.tensor(rows, dtype=torch.long, device=device),
                               torch.tensor(ids, dtype=torch.long, device=device)),
                              torch.ones(len(ids), dtype=torch.float32, device=device), accumulate=True)
        seen |= counts > 0
        penalties = (seen, counts, f([p.repetition_penalty for p in ps]),
                     f([p.presence_penalty for p in ps]), f([p.frequency_penalty for p in ps]))
    masked, bias = _token_rules(specs, vocab_size, device)
    return RowBatch(
        greedy=torch.tensor([p.greedy for p in ps], device=device),
        temperature=f([1.0 if p.greedy else p.temperature for p in ps]),
        top_k=torch.tensor([min(max(p.top_k, 0), vocab_size) for p in ps], dtype=torch.long, device=device),
        top_p=f([p.top_p for p in ps]),
        min_p=f([p.min_p for p in ps]),
        penalties=penalties,
        masked=masked,
        bias=bias,
        all_greedy=all(p.greedy for p in ps),
        any_top_k=any(0 < p.top_k < vocab_size for p in ps),
        any_top_p=any(p.top_p < 1 for p in ps),
        any_min_p=any(p.min_p > 0 for p in ps),
    )


_SHORT_GROUP = 64   # bad words' last tokens after one prefix: up to this many, listed per row
#: a logit_bias of at least this share of the vocabulary is kept as a dense row [V] and added to
#: its rows whole, else as entries added by one scatter with accumulation, whose cost grows with
#: the entries (benchmarks/rules_bench.py, 6 rows, 128k vocabulary, a step's rows built and
#: applied: the whole vocabulary biased 4.4 ms as entries against 0.27 ms dense; 5 % of it 0.28
#: against 0.33, 8 % 0.42 against 0.23, so the two cross at about 6 %)
DENSE_BIAS_SHARE = 1 / 16


def _token_rules(specs: Sequence[RowSpec], vocab_size: int, device: torch.device | str
                 ) -> tuple[Tensor | None, P.LogitBias | None]:
    """Per-row masks (a grammar, allowed_token_ids, bad_words ending here, stop tokens under
    min_tokens) and logit_bias (entries, dense rows); None for either where no row has any."""
    masked = None
    bias: list[tuple[int, Tensor, Tensor]] = []   # (row, ids [M], values [M])
    dense: list[tuple[int, Tensor]] = []          # (row, values [V])
    for i, s in enumerate(specs):
        p = s.params
        groups = s.bad_words.ending(s.output_ids) if s.bad_words else []
        ban = [t for g in groups if len(g) <= _SHORT_GROUP for t in g]
        stops = bool(s.stop_ids) and len(s.output_ids) < p.min_tokens
        allowed = None
        if s.grammar is not None:   # the grammar's state after the committed output and this row's drafts
            allowed = s.grammar.allowed(list(s.output_ids[s.grammar.num_consumed:]))
        if groups or stops or s.bad_words.always or p.allowed_token_ids is not None or allowed is not None:
            if masked is None:
                masked = torch.zeros(len(specs), vocab_size, dtype=torch.bool, device=device)
            if allowed is not None:
                masked[i] = ~allowed.to(device)
            rt = s.rule_tensors(vocab_size, device)
            for m in (rt.outside, rt.never, rt.stops if stops else None):
                if m is not None:
                    masked[i] |= m
            if ban:
                masked[i, torch.tensor(ban, dtype=torch.long, device=device)] = True
            for g in groups:
                if len(g) > _SHORT_GROUP:
                    masked[i, rt.group(g, device)] = True
        if p.logit_bias:
            rt = s.rule_tensors(vocab_size, device)
            if rt.bias_dense is not None:
                dense.append((i, rt.bias_dense))
            else:
                bias.append((i, rt.bias_ids, rt.bias_values))
    if not bias and not dense:
        return masked, None
    long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return masked, P.LogitBias(
        sparse=(torch.cat([torch.full((len(ids),), i, dtype=torch.long, device=device) for i, ids, _ in bias]),
                torch.cat([ids for _, ids, _ in bias]), torch.cat([v for _, _, v in bias])) if bias else None,
        dense=(long([i for i, _ in dense]), torch.stack([v for _, v in dense])) if dense else None)


def penalised_logits(logits: Tensor, rows: RowBatch) -> Tensor:
    """Token rules (masks, logit_bias) and penalties: what greedy decoding takes the argmax of."""
    if rows.masked is not None or rows.bias is not None:
        logits = P.apply_token_rules(logits, rows.masked, rows.bias)
    if rows.penalties is not None:
        logits = P.apply_penalties(logits, *rows.penalties)
    return logits


def processed_logits(logits: Tensor, rows: RowBatch) -> Tensor:
    """logits [N, V] float32 -> the logits the sampler draws from (masked tokens -inf)."""
    logits = penalised_logits(logits, rows) / rows.temperature[:, None]
    if rows.any_min_p:
        logits = P.apply_min_p(logits, rows.min_p)
    if rows.any_top_k:
        logits = P.apply_top_k(logits, rows.top_k)
    if rows.any_top_p:
        logits = P.apply_top_p(logits, rows.top_p)
    return logits


def probs(logits: Tensor, rows: RowBatch, proposal: bool = False) -> Tensor:
    """[N, V] processed distribution; greedy rows are a point mass on the argmax.
    ``proposal``: a drafter's q, where a row may have no token left (an EAGLE-3 draft vocabulary
    without any of the allowed tokens): such a row becomes a point mass on its raw argmax (any q
    is lossless; the target rejects that token). Elsewhere such a row raises."""
    if rows.all_greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits, rows), logits.shape[-1]).float()
    p = _finite(torch.softmax(processed_logits(logits, rows), dim=-1), logits, proposal)
    if rows.greedy.any():
        g = torch.nn.functional.one_hot(penalised_logits(logits, rows).argmax(-1), logits.shape[-1]).float()
        p = torch.where(rows.greedy[:, None], g, p)
    return p


def _finite(p: Tensor, logits: Tensor, proposal: bool = False) -> Tensor:
    """p [N, V] checked with one host sync (never draw from NaN: a row's sum is NaN then): a
    non-finite row raises, or, for a drafter's q (``proposal``, see ``probs``), becomes a point
    mass on its raw argmax."""
    if bool(torch.isfinite(p.sum(-1)).all()):
        return p
    bad = (~torch.isfinite(p)).any(-1)
    if not proposal:
        raise FloatingPointError(f"non-finite probabilities in sampler rows {bad.nonzero().flatten().tolist()} "
                                 "(non-finite logits?)")
    point = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(p.dtype)
    return torch.where(bad[:, None], point, p)


def temperature_probs(logits: Tensor, temperatures: Sequence[float | None]) -> Tensor:
    """``probs`` for rows that nothing but a temperature processes (SamplingParams.plain_temperature;
    None: a greedy row on the raw logits, a point mass on its argmax), without building sampler
    rows: softmax(logits / T), the same operations ``probs`` runs for such rows."""
    t = torch.tensor([1.0 if x is None else x for x in temperatures], dtype=torch.float32, device=logits.device)
    p = _finite(torch.softmax(logits / t[:, None], dim=-1), logits)             # [N, V]
    greedy = [i for i, x in enumerate(temperatures) if x is None]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        p[idx] = torch.nn.functional.one_hot(logits[idx].argmax(-1), logits.shape[-1]).to(p.dtype)
    return p


def greedy_tokens(logits: Tensor, rows: RowBatch | None = None) -> Tensor:
    """[N] argmax of the penalised logits."""
    if rows is not None and (rows.penalties is not None or rows.masked is not None or rows.bias is not None):
        logits = penalised_logits(logits, rows)
    return logits.argmax(dim=-1)


class NoiseRows:
    """A seeded request's position noise, kept while in use: a position's V uniforms U (and the
    race's exponentials E = -log U) are a pure function of (key, position) (``position_noise``),
    and a speculating request asks for the same positions again and again (its drafter races
    under q at n..n+K-1, the verifier under p at n..n+K, and the rejected positions come back
    next step). Kept, each position's rows are computed once while the request needs them (the
    C++ races compute what they read themselves and keep nothing: these are the rows that graphs
    and the Python race take). Bounded: at most ``budget`` bytes (the most recently used; a long
    chain of rounds past the bound computes them again), and the positions before the request's
    output are forgotten (``drop_below``: its tokens there are fixed). Per request
    (``Request.noise_rows``)."""

    def __init__(self, budget: int = 2 << 20):
        self.budget = budget
        # position -> [U, E]: [V] float64 CPU uniforms and their exponentials (None until computed)
        self._rows: OrderedDict[int, list[Tensor | None]] = OrderedDict()
        self._floor = 0

    def __len__(self) -> int:
        return len(self._rows)

    @staticmethod
    def _width(entry: list[Tensor | None]) -> int:
        return next(x.numel() for x in entry if x is not None)

    def get(self, position: int, vocab_size: int) -> list[Tensor | None] | None:
        """The position's [U, E] (either None until computed), or None when not kept."""
        entry = self._rows.get(position)
        if entry is None or self._width(entry) != vocab_size:
            return None
        self._rows.move_to_end(position)
        return entry

    def put(self, position: int, entry: list[Tensor | None]) -> None:
        if position < self._floor:
            return
        self._rows[position] = entry
        self._rows.move_to_end(position)
        while len(self._rows) > max(1, self.budget // (16 * self._width(entry))):
            self._rows.popitem(last=False)   # the least recently used

    def drop_below(self, position: int) -> None:
        """Forget the positions before ``position`` (the request's output reached it)."""
        if position > self._floor:
            self._floor = position
            for n in [n for n in self._rows if n < position]:
                del self._rows[n]


@dataclass(frozen=True)
class PositionKey:
    """Counter-based randomness of a seeded request: the noise behind output position
    ``position`` is a pure function of (``key``, ``position``), whatever K, batch or method."""
    key: int        # the request's 64-bit key (see seed_key)
    position: int   # output position n (0 = the first generated token)
    # where the request keeps drawn positions (the same noise, drawn once); not part of the key
    rows: NoiseRows | None = field(default=None, compare=False, hash=False, repr=False)


#: where a row's randomness comes from: a seeded position, an unseeded request's stream, or
#: nothing (greedy rows)
Rng = PositionKey | torch.Generator | None

_MASK64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float64).tiny


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers with good avalanche."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def seed_key(seed: int) -> int:
    """Any Python integer (negative, or beyond 64 bits) -> a 64-bit request key; distinct
    seeds of up to 64 bits give distinct keys (a chain of bijections)."""
    x, m = _mix64(0x6C656170 ^ (seed < 0)), abs(seed)
    while True:
        x = _mix64(x ^ (m & _MASK64))
        m >>= 64
        if not m:
            return x


_GOLDEN = 0x9E3779B97F4A7C15
#: log's odd series 2 atanh(s) = 2 s sum_n z^n / (2n + 1), z = s^2, coefficients in Horner's order
#: (n = 11 .. 0: |s| <= 0.172, so z^12 / 25 < 2e-20); sampling/native.py NOISE_CPP's SERIES
_SERIES = tuple(1.0 / (2 * n + 1) for n in range(11, -1, -1))
_SQRT_HALF = 0.7071067811865476
_LN2 = 0.6931471805599453


def row_key(pk: PositionKey) -> int:
    """The 64-bit key of a seeded position's noise row (``position_noise``)."""
    return _mix64(pk.key ^ _mix64(pk.position + _GOLDEN & _MASK64))


def signed64(x: int) -> int:
    """A uint64 as the int64 of its bits (how a key travels in an int64 tensor)."""
    return x - (1 << 64) if x >> 63 else x


def position_noise(keys: Sequence[int], vocab_size: int, exponential: bool) -> Tensor:
    """[N, V] float64 CPU: the noise rows of row keys ``keys`` (``row_key``), the uniforms U or the
    race's exponentials E = -log U. Counter-based: column v's U is ((h >> 12) + 0.5) 2^-52 with
    h = splitmix64's output v + 1 from the row key, in [2^-53, 1 - 2^-53]; E is -log U by a fixed
    sequence of float64 operations (frexp, then the odd series of 2 atanh((m - 1) / (m + 1))),
    relative error under 5e-16. The same bits from sampling/native.py's C++ (``noise_rows``,
    used once loaded; its races compute a row's E only at the columns that can win) and from
    these torch operations (any device, no compiler). Until stop 116 a position's noise came
    from torch's CPU generator seeded per position: 8192 float64 uniforms took 46 us and their
    log 16 more (with the Python around them about 0.1 ms a seeded token, a quarter of plain
    seeded decode's time at batch 16); the op computes a row of E in about 18 us, a race reads
    a handful of columns' logs."""
    k = torch.tensor([signed64(x) for x in keys], dtype=torch.int64)
    if native.noise_op_loaded():
        return native.noise_rows(k, vocab_size, exponential)
    u = _twin_uniforms(k, vocab_size)
    return _twin_neg_log(u) if exponential else u


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _twin_mix64(x: Tensor) -> Tensor:
    """_mix64 on int64 tensors (wrapping products: the uint64 bits)."""
    x = (x ^ _shr(x, 30)) * signed64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * signed64(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def _twin_uniforms(keys: Tensor, vocab_size: int) -> Tensor:
    """[N, V] float64: position_noise's U from int64 row keys [N]."""
    col = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * signed64(_GOLDEN)
    h = _twin_mix64(keys[:, None] + col)                                        # [N, V] int64
    return (_shr(h, 12).double() + 0.5) * 2.0 ** -52


def _twin_neg_log(u: Tensor) -> Tensor:
    """-log u for u in (0, 1) float64, op for op NOISE_CPP's neg_log."""
    m, x = torch.frexp(u)                                                       # u = m 2^x, m in [0.5, 1)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    x = x - small.to(x.dtype)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    poly = torch.full_like(z, _SERIES[0])
    for c in _SERIES[1:]:
        poly = poly * z + c
    t = s * poly
    return -(x.double() * _LN2 + (t + t))


def noise(rngs: Sequence[Rng], vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """[N, V] float64 uniforms in (0, 1) per row (rows with no randomness get exp(-1): E = 1), on
    ``device``. float64: a float32 grid (2^-24) would under-sample tokens with p below ~1e-7.
    A seeded row's noise is ``position_noise``'s, computed on the host whatever ``device`` is,
    one function of (key, position): one-token steps sample on the host while CUDA graphs
    (multi-step decode, speculation rounds, sampled draft chains) race on the GPU (a CUDA
    generator drew other numbers: found on the H100, multi-step seeded output differed)."""
    return _rows(rngs, vocab_size, device, exponential=False)


def exponentials(rngs: Sequence[Rng], vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """[N, V] float64 the race's exponentials E = -log U of ``noise``'s rows (1 for rows with no
    randomness), on ``device``: a seeded position's E is computed on the host and kept with its
    U (``NoiseRows``) for the graphs and Python races that take rows (multi-step and
    speculation-round graphs); the C++ races compute the same numbers from the row key where
    they read them (``position_noise``), so every race at that position divides by the same bits."""
    return _rows(rngs, vocab_size, device, exponential=True)


def _rows(rngs: Sequence[Rng], vocab_size: int, device: torch.device | str, exponential: bool) -> Tensor:
    """``noise`` (U) or ``exponentials`` (E = -log U): [N, V] float64, the rows' blocks joined at once."""
    parts: list[Tensor] = []
    seen: dict[PositionKey, Tensor] = {}   # a tree's rows at one depth share their position's noise: drawn once
    i = 0
    while i < len(rngs):
        r, j = rngs[i], i + 1
        if r is None:
            while j < len(rngs) and rngs[j] is None:
                j += 1
            parts.append(torch.full((j - i, vocab_size), 1.0 if exponential else 0.36787944117144233,
                                    dtype=torch.float64))
        elif isinstance(r, PositionKey):   # (position_noise: on the host, the same noise on every device)
            if r not in seen:
                seen[r] = _position_row(r, vocab_size, exponential)[None]
            parts.append(seen[r])
        else:   # consecutive rows of one stream in one call (the same draws as row by row)
            while j < len(rngs) and rngs[j] is r:
                j += 1
            u = torch.empty(j - i, vocab_size, dtype=torch.float64, device=r.device)
            torch.rand(j - i, vocab_size, generator=r, dtype=torch.float64, out=u)
            u.clamp_(min=_TINY)   # U = 0 would give E = inf and let a p = 0 token win a 0-0 tie
            parts.append((torch.log(u).neg_() if exponential else u).to("cpu"))
        i = j
    if not parts:
        return torch.empty(0, vocab_size, dtype=torch.float64, device=device)
    return torch.cat(parts).to(device)   # (a copy: the kept rows are never handed out)


def noise_keys(rngs: Sequence[Rng], device: torch.device | str = "cpu") -> Tensor:
    """[N, 2] int64: each race row's noise key (``row_key``'s bits) and 1, or 0 and 0 for a row
    with no randomness (E = 1): what the C++ races (the verify op, ``race_rows``, the EAGLE chain
    op) take in place of ``exponentials``' rows. For the race's rows only (seeded positions and
    greedy rows; a stream row draws by inverse CDF)."""
    if any(isinstance(r, torch.Generator) for r in rngs):
        raise TypeError("noise_keys: a stream row draws by inverse CDF, not by a race")
    return torch.tensor([[signed64(row_key(r)), 1] if isinstance(r, PositionKey) else [0, 0] for r in rngs],
                        dtype=torch.int64, device=device).view(len(rngs), 2)


def _position_row(pk: PositionKey, vocab_size: int, exponential: bool) -> Tensor:
    """[V] float64 CPU: a seeded position's uniforms U in (0, 1), or E = -log U: the kept ones
    where the request has them (``NoiseRows``), else computed (``position_noise``) and kept."""
    entry = None if pk.rows is None else pk.rows.get(pk.position, vocab_size)
    if entry is None:
        entry = [None, None]
    i = 1 if exponential else 0
    if entry[i] is None:
        entry[i] = position_noise([row_key(pk)], vocab_size, exponential)[0]
        if pk.rows is not None:
            pk.rows.put(pk.position, entry)
    return entry[i]


def sample(p: Tensor, rngs: Sequence[Rng]) -> Tensor:
    """Draw one token per row of p [N, V] -> [N] long.

    Seeded rows (a PositionKey) and rows without randomness (None: greedy point masses) run an
    exponential race (the Gumbel-max trick): x = argmax_v p[v] / E[v], E[v] = -log U[v] ~ Exp(1)
    i.i.d., gives P(x = v) = p[v] exactly. Seeded rows take U from (key, position): the token at
    position n is then a pure function of p_n and the seed, which is what makes seeded output
    independent of speculation (``spec/verify/greedy.py``), and a drafter racing under q with the
    same noise couples with the target (``race_top``). E is finite, so a token with p > 0 always
    beats every token with p = 0.

    Unseeded rows (a request's generator) need no coupling: each takes one float64 uniform from
    its stream and draws by inverse CDF (``inverse_cdf_draw``), where the race would draw V of
    them (8192 float64 per row for the built-in model, about 0.2 ms of the CPU per drawn token,
    5 ms per step at batch 32). Consecutive rows of one stream take consecutive draws, so a row
    draws what it draws alone or in a batch, and multi-step decode's graph, taking the same
    uniforms, draws what one-token steps draw.
    """
    stream = [i for i, r in enumerate(rngs) if isinstance(r, torch.Generator)]
    if not stream:
        return _race_top(p, rngs, 1)[1][:, 0]
    if len(stream) == len(rngs):
        return inverse_cdf_draw(p, stream_uniforms(rngs, p.device))
    out = torch.empty(len(rngs), dtype=torch.long, device=p.device)
    keyed = [i for i, r in enumerate(rngs) if not isinstance(r, torch.Generator)]   # (not empty here)
    idx = torch.tensor(keyed, device=p.device)
    out[idx] = _race_top(p[idx], [rngs[i] for i in keyed], 1)[1][:, 0]
    idx = torch.tensor(stream, device=p.device)
    out[idx] = inverse_cdf_draw(p[idx], stream_uniforms([rngs[i] for i in stream], p.device))
    return out


def stream_uniforms(generators: Sequence[torch.Generator], device: torch.device | str = "cpu") -> Tensor:
    """[N] float64 uniforms in [0, 1), one per row from its generator: consecutive rows of one
    generator take consecutive draws (one call), as they would row by row."""
    w = torch.empty(len(generators), dtype=torch.float64)
    i = 0
    while i < len(generators):
        g, j = generators[i], i + 1
        while j < len(generators) and generators[j] is g:
            j += 1
        if g.device.type == w.device.type:
            torch.rand(j - i, generator=g, dtype=torch.float64, out=w[i:j])
        else:   # (a generator on another device draws there; the host gathers the row's uniforms)
            w[i:j] = torch.rand(j - i, generator=g, dtype=torch.float64, device=g.device).cpu()
        i = j
    return w.to(device)


def inverse_cdf_draw(mass: Tensor, w: Tensor) -> Tensor:
    """A draw from the distribution proportional to ``mass`` [..., V] (non-negative, a positive
    total) with one uniform w [...] float64 in [0, 1) per row -> [...] long: the first token whose
    cumulative mass (float64 sums) exceeds t = w x the total, so each token's probability is its
    share to float rounding (as ``torch.multinomial``). t is kept below the total (where w x total
    rounds up to it), so the token found is one where the sum grows: never a token of zero mass.
    A binary search per row (the sums are sorted). Traced into compiled graphs too
    (model/compiled.py: multi-step decode, rejection sampling in speculation rounds)."""
    cdf = mass.double().cumsum(-1)                                                 # [..., V]
    total = cdf[..., -1:]                                                          # [..., 1]
    t = torch.minimum(w[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, t, right=True)[..., 0].clamp(max=mass.shape[-1] - 1)


class RaceTop(NamedTuple):
    values: Tensor    # [N, k] float64 p / E of each finisher (0 past the tokens with p > 0)
    indices: Tensor   # [N, k] long, -1 past the tokens with p > 0


def race_top(p: Tensor, rngs: Sequence[Rng], k: int) -> RaceTop:
    """The first k finishers of ``sample``'s exponential race per row of p [N, V], best first
    (column 0 is what ``sample`` draws with the same rngs).

    Drafting for a seeded request: its target token at an output position is the race winner
    under p with that position's noise, so the drafter's k best tokens under q with the same
    noise are the k likeliest to be it (a tree's children: any of them may match)."""
    values, columns = _race_top(p, rngs, min(k, p.shape[-1]))
    return RaceTop(values, columns.masked_fill(values <= 0, -1))


def _race_top(p: Tensor, rngs: Sequence[Rng], k: int) -> tuple[Tensor, Tensor]:
    """The k largest p / E per row of p [N, V] (keyed and greedy rows), best first -> values [N, k]
    float64, columns [N, k]: sampling/native.py's race where it serves (CPU p; it computes E
    only at the columns that can finish in the top k), else p divided by ``exponentials``
    (the same bits)."""
    keys = noise_keys(rngs)   # [N, 2] (refuses stream rows)
    if p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) and native.noise_op_loaded():
        return native.race_rows(p, keys, k)
    r = p / exponentials(rngs, p.shape[-1], p.device)   # [N, V] float64 (float32 p promotes exactly)
    if k == 1:   # (argmax: the first of equal maxima)
        i = r.argmax(dim=-1, keepdim=True)
        return r.gather(-1, i), i
    top = r.topk(k, dim=-1)
    return top.values, top.indices


def stream_rows(generators: Sequence[torch.Generator | None], counts: Sequence[int], width: int,
                device: torch.device | str = "cpu") -> Tensor:
    """[N, width] float64: row i holds the next counts[i] uniforms of generators[i] (None: none),
    zeros after them, on ``device``: the unseeded rows' uniforms that graphs take (multi-step
    decode, sampled draft chains, speculation rounds)."""
    w = torch.zeros(len(generators), width, dtype=torch.float64)
    for i, (g, n) in enumerate(zip(generators, counts)):
        if g is not None and n:
            w[i, :n] = uniforms(n, g, dtype=torch.float64)
    return w.to(device)


def uniforms(n: int, generator: torch.Generator, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> Tensor:
    """[n] U(0, 1) draws from one request's generator (rejection sampling), on ``device``
    (drawn on the generator's own device: a request's stream is a CPU generator)."""
    return torch.rand(n, generator=generator, device=generator.device, dtype=dtype).to(device)
