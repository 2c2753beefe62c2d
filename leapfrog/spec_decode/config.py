"""``speculative_config``: the vLLM dict, validated into a frozen dataclass."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

from leapfrog.errors import ConfigError

METHODS = ("draft_model", "ngram", "eagle", "eagle3", "suffix")
EAGLE_METHODS = ("eagle", "eagle3")
TREE_METHODS = (*EAGLE_METHODS, "suffix")  # methods that propose trees (verify/tree.py)
MODEL_FREE = ("ngram", "suffix")
SUFFIX_KEYS = ("suffix_cache_max_depth", "suffix_cache_max_requests", "max_spec_factor", "max_spec_offset",
               "min_token_prob")
# vLLM's names for the suffix keys (accepted as aliases)
VLLM_SUFFIX_ALIASES = {"suffix_decoding_max_tree_depth": "suffix_cache_max_depth",
                       "suffix_decoding_max_cached_requests": "suffix_cache_max_requests",
                       "suffix_decoding_max_spec_factor": "max_spec_factor",
                       "suffix_decoding_min_token_prob": "min_token_prob"}
MAX_DRAFT_TOKENS = 128
MAX_SPECULATIVE_TOKENS = 32
SELF_DRAFT = "self"  # draft_model's model: the target's own weights


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """"draft_model" (a smaller model of the same tokenizer), "ngram" (prompt lookup), "eagle"
    (an EAGLE-1 head), "eagle3" (an EAGLE-3 head) or "suffix" (SuffixDecoding: suffix trees over
    the request's own tokens and over earlier requests' outputs)."""
    num_speculative_tokens: int
    """K: drafts per step (the adaptive controller's upper bound when adaptive is on); for
    EAGLE, the depth of the draft tree (draft steps of the head); for suffix, the most tree
    nodes one step drafts."""
    model: str | None = None
    """Draft checkpoint (directory or hub id): the draft model, or the EAGLE head. draft_model
    also takes "self": the target's own weights (with draft_quantization: a quantized self-draft)."""
    prompt_lookup_min: int = 2
    """Shortest suffix n-gram matched (ngram)."""
    prompt_lookup_max: int = 5
    """Longest suffix n-gram matched (ngram); longer matches are tried first."""
    draft_dtype: str | None = None
    """Draft model dtype (default: the target's)."""
    draft_quantization: str | None = None
    """draft_model, eagle, eagle3: weight-only "int8" or "int4" quantization of the drafter's
    linears and its own LM head at load (model/quant.py); with model "self", the quantized
    self-draft. An EAGLE-1 head's logits stay the target's LM head's."""
    disable_by_batch_size: int | None = None
    """Speculation is off for steps whose batch has more running requests than this."""
    adaptive: bool = False
    """Choose K per step (0..num_speculative_tokens) to maximise goodput (spec/adaptive.py)."""
    adaptive_explore_interval: int = 16
    """Adaptive: every this many steps try a K next to the best one to refresh its cost."""
    eagle_topk: int = 4
    """EAGLE: children expanded per tree level (EAGLE-2's dynamic tree); 1 gives a chain."""
    num_draft_tokens: int | str | None = None
    """EAGLE: tree nodes verified per step (the best by path confidence), or "auto" (chosen
    per batch-size bucket from the measured verify cost). Default: depth x topk, at most 16."""
    speculative_token_tree: str | list | None = None
    """EAGLE: a static tree instead of the dynamic one, as vLLM writes it: a list of paths of
    child ranks, e.g. "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]" ((0, 1) = the second most likely
    child of the most likely first token); every path's parent must be in the list."""
    min_draft_confidence: float | None = None
    """draft_model, and eagle/eagle3 chains (eagle_topk 1): each step, a greedy request's chain
    ends at the first draft whose path confidence (the product of the drafter's probabilities
    along the chain) is below this, instead of at num_speculative_tokens; eagerly no drafter
    forward runs once every chain in the batch has ended. Long chains where the drafter is sure,
    short ones where it is not: with it, raise num_speculative_tokens (README, "Trees and EAGLE":
    what it measured). Sampled requests draft their full chains. None: off."""

    suffix_cache_max_depth: int = 24
    """suffix: the deepest path of the suffix trees (matched context + drafted continuation);
    vLLM's suffix_decoding_max_tree_depth."""
    suffix_cache_max_requests: int = 1000
    """suffix: the global tree keeps the outputs of this many finished requests, the oldest
    evicted first (0 = no global tree: only the request's own tokens); vLLM's
    suffix_decoding_max_cached_requests."""
    max_spec_factor: float = 1.0
    """suffix: a match of m tokens drafts at most m * max_spec_factor + max_spec_offset nodes."""
    max_spec_offset: float = 0.0
    """suffix: see max_spec_factor."""
    min_token_prob: float = 0.1
    """suffix: a node is drafted only if its estimated path probability is at least this."""
    max_model_len: int | None = None
    """Drafts only at positions under this (vLLM's speculative max_model_len): a sequence past it
    decodes without speculation. Default: for draft_model, the smaller of the draft's trained
    context (max_position_embeddings) and the target's max_model_len, so a short-context draft
    model is not asked where it never was trained; else the target's max_model_len."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        d = dict(d)
        for alias, name in VLLM_SUFFIX_ALIASES.items():
            if alias in d:
                if name in d:
                    raise ConfigError(f"speculative_config: {alias!r} and {name!r} are the same setting; give one")
                d[name] = d.pop(alias)
        known = {f.name for f in fields(cls)}
        unknown = sorted((k for k in d if k not in known), key=str)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {unknown}; known keys: {sorted(known)}")
        for k in ("eagle_topk", *SUFFIX_KEYS, "prompt_lookup_min", "prompt_lookup_max", "draft_dtype",
                  "adaptive_explore_interval"):
            if k in d and d[k] is None:   # (null = not given, as vLLM reads it and as the other optional keys)
                del d[k]
        if "method" not in d:
            raise ConfigError(f"speculative_config needs 'method', one of {list(METHODS)}")
        if "num_speculative_tokens" not in d:
            raise ConfigError("speculative_config needs 'num_speculative_tokens'")
        if "eagle_topk" in d and d.get("speculative_token_tree") is not None:
            raise ConfigError("speculative_config: eagle_topk with speculative_token_tree: the static tree "
                              "sets each node's children; leave eagle_topk out")
        if "eagle_topk" in d and d["method"] not in EAGLE_METHODS:
            raise ConfigError(f"speculative_config: eagle_topk applies to methods {list(EAGLE_METHODS)} only, "
                              f"not {d['method']!r}")
        given = [k for k in SUFFIX_KEYS if k in d]
        if given and d["method"] != "suffix":
            raise ConfigError(f"speculative_config: {given[0]} applies to method 'suffix' only, not {d['method']!r}")
        # keys another method reads: refused, never silently ignored
        given = [k for k in ("prompt_lookup_min", "prompt_lookup_max") if k in d]
        if given and d["method"] != "ngram":
            raise ConfigError(f"speculative_config: {given[0]} applies to method 'ngram' only, not {d['method']!r}")
        if "draft_dtype" in d and d["method"] not in ("draft_model", *EAGLE_METHODS):
            raise ConfigError(f"speculative_config: draft_dtype applies to methods 'draft_model', 'eagle' and "
                              f"'eagle3' (a drafter with weights), not {d['method']!r}")
        if "adaptive_explore_interval" in d and d.get("adaptive") is not True and d.get("num_draft_tokens") != "auto":
            raise ConfigError("speculative_config: adaptive_explore_interval applies with \"adaptive\": true or "
                              "\"num_draft_tokens\": \"auto\" (the controller that explores)")
        return cls(**d)

    def __post_init__(self) -> None:
        from leapfrog.model.loader import DTYPES
        from leapfrog.model.quant import QUANT_METHODS
        from leapfrog.spec_decode.proposers.base import PROPOSERS

        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        # Types and ranges first (a list as method would otherwise be an unhashable TypeError below).
        _check(self, "method", str, choices=sorted(set(METHODS) | set(PROPOSERS)))
        _check(self, "num_speculative_tokens", int, lo=1, hi=MAX_SPECULATIVE_TOKENS)
        _check(self, "model", str, optional=True)
        _check(self, "prompt_lookup_min", int, lo=1)
        _check(self, "prompt_lookup_max", int, lo=1)
        _check(self, "draft_dtype", str, optional=True, choices=["auto", *DTYPES])
        _check(self, "draft_quantization", str, optional=True, choices=list(QUANT_METHODS))
        if self.draft_quantization is not None and self.method not in ("draft_model", "eagle", "eagle3"):
            raise ConfigError(f"speculative_config: draft_quantization applies to methods 'draft_model', 'eagle' "
                              f"and 'eagle3' (a drafter with weights), not {self.method!r}")
        if self.model == SELF_DRAFT and self.method != "draft_model":
            raise ConfigError(f"speculative_config: model {SELF_DRAFT!r} (the target as its own draft) applies to "
                              f"method 'draft_model' only, not {self.method!r}")
        _check(self, "disable_by_batch_size", int, lo=1, optional=True)
        _check(self, "max_model_len", int, lo=2, optional=True)
        _check(self, "adaptive", bool)
        _check(self, "adaptive_explore_interval", int, lo=2)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} > "
                              f"prompt_lookup_max={self.prompt_lookup_max}")
        _check(self, "eagle_topk", int, lo=1, hi=MAX_DRAFT_TOKENS)
        _check(self, "suffix_cache_max_depth", int, lo=2, hi=1024)
        _check(self, "suffix_cache_max_requests", int, lo=0)
        for name in ("max_spec_factor", "max_spec_offset", "min_token_prob"):
            v = getattr(self, name)
            lo, hi = {"min_token_prob": (0.0, 1.0), "max_spec_factor": (0.0, 1e6)}.get(name, (-1e6, 1e6))
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ConfigError(f"speculative_config.{name}={v!r}: must be a number in [{lo:g}, {hi:g}]")
        if self.method in ("draft_model", *EAGLE_METHODS) and not self.model:
            what = "the draft checkpoint" if self.method == "draft_model" else "the EAGLE head's checkpoint"
            raise ConfigError(f"speculative_config: method {self.method!r} needs 'model' ({what})")
        tree_keys = [k for k in ("num_draft_tokens", "speculative_token_tree") if getattr(self, k) is not None]
        if tree_keys and self.method not in EAGLE_METHODS:
            raise ConfigError(f"speculative_config: {tree_keys[0]} applies to methods {list(EAGLE_METHODS)} "
                              f"only, not {self.method!r}")
        if self.method in EAGLE_METHODS:
            self._check_tree()
        if self.min_draft_confidence is not None:
            self._check_min_draft_confidence()
        if self.method in MODEL_FREE and self.model:
            raise ConfigError(f"speculative_config: method {self.method!r} takes no 'model'")

    def _check_min_draft_confidence(self) -> None:
        v = self.min_draft_confidence
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
            raise ConfigError(f"speculative_config.min_draft_confidence={v!r}: must be a number in (0, 1] (or null)")
        if self.method not in ("draft_model", *EAGLE_METHODS):
            raise ConfigError(f"speculative_config: min_draft_confidence applies to methods 'draft_model', 'eagle' "
                              f"and 'eagle3' (a drafter with probabilities), not {self.method!r}")
        if self.adaptive or self.num_draft_tokens == "auto":
            raise ConfigError("speculative_config: min_draft_confidence with adaptive sizes: both choose how long "
                              "the drafts are (one from the drafter's confidence, one from measured costs); "
                              "drop one of them")
        if self.method in EAGLE_METHODS and (self.eagle_topk != 1 or self.speculative_token_tree is not None):
            raise ConfigError("speculative_config: min_draft_confidence ends chains; it needs \"eagle_topk\": 1 "
                              "(trees already keep their most confident nodes: num_draft_tokens)")

    def _check_tree(self) -> None:
        n = self.num_draft_tokens
        if n is not None and n != "auto" and (isinstance(n, bool) or not isinstance(n, int)
                                               or not 1 <= n <= MAX_DRAFT_TOKENS):
            raise ConfigError(f"speculative_config.num_draft_tokens={n!r}: must be an integer in "
                              f"[1, {MAX_DRAFT_TOKENS}] or \"auto\" (or null)")
        if self.speculative_token_tree is not None:
            paths = parse_token_tree(self.speculative_token_tree)
            object.__setattr__(self, "speculative_token_tree", paths)
            depth = max(len(p) for p in paths)
            if depth != self.num_speculative_tokens:
                raise ConfigError(f"speculative_config: speculative_token_tree is {depth} deep but "
                                  f"num_speculative_tokens={self.num_speculative_tokens}; make them equal")
            if n is not None and n != len(paths):
                raise ConfigError(f"speculative_config: num_draft_tokens={n!r} but speculative_token_tree has "
                                  f"{len(paths)} nodes; leave num_draft_tokens out")
        if self.adaptive and n is not None and n != "auto":
            raise ConfigError("speculative_config: adaptive with a fixed num_draft_tokens; use "
                              "num_draft_tokens='auto' to let the tree size adapt")
        if self.adaptive and self.speculative_token_tree is not None:   # (it cut the tree, undocumented)
            raise ConfigError("speculative_config: adaptive with a static speculative_token_tree, which fixes the "
                              "nodes; leave the tree out and use num_draft_tokens='auto' to let the tree size adapt")
        if isinstance(n, int) and self.speculative_token_tree is None:
            k, w = self.num_speculative_tokens, self.eagle_topk
            most = min(_candidates(k, w), sum(w ** d for d in range(1, k + 1)))   # nor more than the full tree
            if n > most:
                raise ConfigError(f"speculative_config: num_draft_tokens={n} but a tree {k} deep with eagle_topk={w} "
                                  f"grows at most {most} candidate nodes; raise eagle_topk or "
                                  "num_speculative_tokens, or lower num_draft_tokens")

    @property
    def tree(self) -> bool:
        return self.method in TREE_METHODS

    @property
    def auto_tree(self) -> bool:
        """EAGLE tree size chosen per step by goodput (num_draft_tokens "auto", or adaptive with a tree)."""
        return self.method in EAGLE_METHODS and self.speculative_token_tree is None and (
            self.num_draft_tokens == "auto" or self.adaptive)

    def tree_shape(self, n: int) -> tuple[int, int]:
        """(levels, width) of the dynamic tree grown to verify ``n`` nodes: one level per node up
        to the depth, and as many children per frontier node as n nodes over the depth can use,
        at most eagle_topk (a chain for n <= depth). What drafting costs: ``levels`` head
        forwards over ``width`` rows per request."""
        depth = self.num_speculative_tokens
        return max(1, min(depth, n)), max(1, min(self.eagle_topk, math.ceil(n / depth)))

    @property
    def grown_tree_shape(self) -> tuple[int, int]:
        """(levels, width) of the largest dynamic tree a step grows: the tree of draft_budget nodes
        (tree_shape), or with "auto" sizes the full depth x eagle_topk tree (on the fast path every
        size is cut from it)."""
        if self.auto_tree:
            return self.num_speculative_tokens, self.eagle_topk
        return self.tree_shape(self.draft_budget)

    @property
    def tree_candidates(self) -> int:
        """Candidates that tree grows (EAGLE-2: ``width`` children of the root, then ``width``
        children of each of the ``width`` frontier nodes per deeper level)."""
        return _candidates(*self.grown_tree_shape)

    @property
    def draft_budget(self) -> int:
        """The most tokens one step drafts per request: tree nodes for EAGLE, else K."""
        if self.method not in EAGLE_METHODS:
            return self.num_speculative_tokens
        if self.speculative_token_tree is not None:
            return len(self.speculative_token_tree)
        if isinstance(self.num_draft_tokens, int):
            return self.num_draft_tokens
        full = sum(self.eagle_topk ** d for d in range(1, self.num_speculative_tokens + 1))
        if self.auto_tree:
            return min(full, 64)
        return min(full, self.eagle_topk * self.num_speculative_tokens, 16)


def _candidates(levels: int, width: int) -> int:
    """Candidate nodes a dynamic tree grows (EAGLE-2): ``width`` children of the root, then
    ``width`` children of each of the ``width`` frontier nodes per deeper level."""
    return width + (levels - 1) * width ** 2


def parse_token_tree(tree: str | list) -> list[tuple[int, ...]]:
    """vLLM's ``speculative_token_tree`` (a string or a list of paths of child ranks) -> paths,
    parents before children; ConfigError naming what is wrong."""
    import ast
    shown = repr(tree) if len(repr(tree)) <= 200 else repr(tree)[:200] + "..."
    try:
        raw = ast.literal_eval(tree) if isinstance(tree, str) else tree
        if not isinstance(raw, (list, tuple)):   # (a dict or set would give its keys)
            raise TypeError(f"a {type(raw).__name__}")
        if bad := [p for p in raw if not isinstance(p, (list, tuple))]:   # (bytes, dicts and sets were read too)
            raise TypeError(f"the path {bad[0]!r} is of type {type(bad[0]).__name__}")
        paths = [tuple(p) for p in raw]
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ConfigError(f"speculative_config.speculative_token_tree={shown}: not a list of tuples "
                          f"of child ranks like \"[(0,), (1,), (0, 0)]\" ({type(e).__name__}: {e})") from None
    if not paths or len(paths) > MAX_DRAFT_TOKENS:
        raise ConfigError(f"speculative_config.speculative_token_tree: 1 to {MAX_DRAFT_TOKENS} paths, "
                          f"got {len(paths)}")
    seen = set()
    for p in sorted(paths, key=len):
        if not p or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_DRAFT_TOKENS for i in p):
            raise ConfigError(f"speculative_config.speculative_token_tree: path {p!r} must be a non-empty "
                              f"tuple of child ranks in [0, {MAX_DRAFT_TOKENS})")
        if p in seen:
            raise ConfigError(f"speculative_config.speculative_token_tree: path {p!r} appears twice")
        if len(p) > 1 and p[:-1] not in seen:
            raise ConfigError(f"speculative_config.speculative_token_tree: path {p!r} has no parent "
                              f"{p[:-1]!r} in the tree")
        seen.add(p)
    return sorted(paths, key=lambda p: (len(p), p))


_KINDS = {int: "an integer", str: "a string", bool: "true or false"}


def _check(cfg: SpeculativeConfig, name: str, kind: type, *, lo: int | None = None, hi: int | None = None,
           choices: list[str] | None = None, optional: bool = False) -> None:
    """``cfg.<name>`` is a ``kind`` (an int is never a bool) in [lo, hi] / ``choices``, else a
    ConfigError naming the field, the value and what it must be."""
    v = getattr(cfg, name)
    if optional and v is None:
        return
    typed = isinstance(v, kind) and (kind is bool or not isinstance(v, bool))
    if not typed or (lo is not None and v < lo) or (hi is not None and v > hi) or (choices and v not in choices):
        want = _KINDS[kind] + (f" >= {lo}" if lo is not None and hi is None else "")
        want += f" in [{lo}, {hi}]" if hi is not None else ""
        if choices is not None:
            want = f"one of {choices}" if typed else f"{want} (one of {choices})"
        raise ConfigError(f"speculative_config.{name}={v!r}: must be {want}"
                          + (" (or null)" if optional else ""))
