"""EAGLE proposers: a one-layer head on the target's own features drafts a tree (EAGLE-2's
dynamic tree, or a static tree given as vLLM's ``speculative_token_tree``).

Alignment (EAGLE's): head position t reads the target's feature f_t of token x_t (EAGLE-1:
the final-norm state; EAGLE-3: fc over low/middle/high layer states) together with the next
token x_{t+1}, and predicts x_{t+2}. With N tokens x_0..x_{N-1} (the last one just sampled, no
target feature yet), the head's committed positions are 0..N-2.

One ``propose`` (per request, all requests in the same forwards):
  1. catch up: head positions ``computed .. N-2`` from the target states the engine handed over
     (``on_target_states``: committed tokens only, so nothing is ever rolled back; zeros where
     the engine captured none, while speculation was off: ``_ready``), one forward;
     the last position's logits give the depth-1 candidates, its output state h their feature;
  2. grow the tree for ``num_speculative_tokens`` levels: each level runs the head once over the
     frontier nodes (each attends to the committed prefix and its own ancestors, positions by
     depth: ``SeqChunk.context / extra_cols / first_pos``), fed back their parent's output state;
     dynamic: every frontier node proposes its ``eagle_topk`` most likely children, scored by
     path confidence (sum of the head's log-probabilities along the path), and the best
     ``eagle_topk`` of them form the next frontier (EAGLE-2); static: the children ranks the
     tree lists;
  3. rerank every node drawn by path confidence and keep the best ``num_draft_tokens`` (with
     their ancestors: a path's confidence never exceeds its parent's); parents come before
     children, siblings best first.

Greedy requests get point-mass drafts (the head's top tokens: deterministic given the context).
Sampled requests draft from q processed by the one sampler with the request's own settings
(temperature, top-k/top-p, penalties over the drafted path), with the randomness the target
uses at that output position (``Request.rng``). Seeded requests are verified by matching: the
target's token at a position is the winner of the exponential race under p with that position's
(seed, position) noise, so racing q with the same noise couples the draft to it. Where the
step's requests all draw temperature-only and the fused sampled chain loop serves them, a
seeded request drafts the chain of the race's winners (one child per level, whatever the tree
settings, as unseeded requests do): its tree grown level by level in Python ran the built-in
pair 0.78x no speculation at batch 1 and 0.30x at batch 16 (T = 0.7, 16 nodes, stop 114) where
the fused chain ran 1.56x and 0.73x; the level-by-level expansion (greedy trees in the batch,
other sampling settings) draws the same chain (``_grown_width``). Only a static tree gives a
seeded request siblings: a node's children are the race's first finishers under q
(``sampler.race_top``), each scored by its share of the finishers' race values q / E, any of
which may match (which children are drafted never changes the output, only how much of it one
step accepts). Unseeded requests get a *sampled chain* (one child per level, whatever
the tree settings): x ~ q (an inverse-CDF draw with one uniform of the request's generator, as
the sampler draws unseeded rows), and q goes to lossless rejection sampling (accept with
min(1, p/q): about sum min(p, q) per token, where a point mass on argmax q gets only
p(argmax q), which a flat target at T = 0.7 keeps near 0.4). Siblings chosen by their sampled
values would bias RRS (verify/tree.py), hence one child per level.
The tree's head KV lives in scratch columns after the committed ones and is simply overwritten
next step: accepted tokens are recomputed from the target's real features (EAGLE does the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from leapfrog.model.compiled import CompiledSampledChain, ascending
from leapfrog.model.runner import ModelRunner, SeqChunk
from leapfrog.request import Request
from leapfrog.sampling import sampler
from leapfrog.spec_decode.adaptive import tree_depth_cap
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.draft import DraftBatch, chain_ended, chain_length
from leapfrog.spec_decode.proposers.base import TargetInfo, register_proposer
from leapfrog.spec_decode.verify.result import AcceptanceResult
from leapfrog.utils import env_off

#: plain steps' states logged before they are handed to their requests (``on_plain_states``)
_LOG_STEPS = 64


@dataclass
class _Node:
    token: int
    parent: int          # index into the request's node list, -1 = the root
    score: float         # path confidence: sum of log q along the path
    depth: int
    rank: int            # rank among its parent's candidates (static trees)
    feat: torch.Tensor | None  # [H] the feature it runs with: its parent's output state (None: a fused chain's)
    col: int = -1        # head KV column once the node has been run (expanded)
    q: torch.Tensor | None = None  # [V] the draft distribution it was sampled from (unseeded sampled chains)
    sampled: bool = False          # drawn for an unseeded sampled request: a chain, one child per level


@dataclass
class _Cand:
    """A node's candidate children: log q and token ids, best first (greedy requests: the top
    tokens; seeded sampled ones: the race's first finishers under q), or the one token drawn for
    an unseeded sampled request (``sampled``) with the q the verifier needs."""
    vals: list[float]
    ids: list[int]
    q: torch.Tensor | None = None   # [V]
    sampled: bool = False


@dataclass
class _Feats:
    """A request's target features not yet consumed by the head, positions start..end-1: raw
    states as the target gives them (EAGLE-3's fc runs batched inside the head's catch-up
    forward, not once per request and step), kept as the parts they arrived in until read."""
    start: int
    parts: list[torch.Tensor]   # [n_i, F] each, in position order
    n: int

    @property
    def end(self) -> int:
        return self.start + self.n

    def rows(self) -> torch.Tensor:
        """[m, F] all of them, one tensor."""
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts)]
        return self.parts[0]

    def drop_before(self, pos: int) -> None:
        k = pos - self.start
        if k > 0:
            self.parts, self.start, self.n = [self.rows()[k:]], pos, self.n - k


class EagleProposer:
    def __init__(self, cfg: SpeculativeConfig, target: TargetInfo) -> None:
        from leapfrog.model.eagle import load_eagle_head
        from leapfrog.model.loader import DTYPES
        from leapfrog.model.quant import check_quantization
        from leapfrog.parallel.replica import unsharded_view

        dtype = DTYPES[cfg.draft_dtype] if cfg.draft_dtype not in (None, "auto") else target.dtype
        # (before loading: a draft_quantization without kernels here fails first, as for draft models)
        check_quantization(cfg.draft_quantization, dtype, target.device, "speculative_config.draft_quantization")
        self.head = load_eagle_head(cfg.model, target.model, dtype, target.device, target.allow_pickle)
        # a tensor-parallel target holds a vocabulary slice: the head (rank 0 only) gets whole
        # copies of what it shares (its embedding unless it has one; EAGLE-1: the LM head)
        self.head.bind_target(unsharded_view(target.model, target.checkpoint, target.allow_pickle,
                                             need_embed=self.head.embed is None, need_head=self.head.kind == "eagle"))
        if self.head.kind != cfg.method:
            from leapfrog.errors import ConfigError
            raise ConfigError(f"speculative_config: method {cfg.method!r} but {cfg.model} is an "
                              f"{self.head.kind!r} head; use \"method\": \"{self.head.kind}\"")
        if cfg.draft_quantization is not None:   # q only steers proposals, as for draft models
            self.head.quantize(cfg.draft_quantization)
        # q only ranks candidates (verification uses the target's logits): a half-precision LM head
        # reads half the bytes per draft level, as for draft models
        self.head.pack_for_inference(fp32_head=False, pack_layers=target.enforce_eager)
        self._dtype = self.head.dtype   # (read once: on the step's host path a module lookup costs microseconds)
        width = self.head.cfg.target_hidden_size if self.head.kind == "eagle" else self.head.cfg.feature_size
        self._zero_row = torch.zeros(1, width, dtype=self._dtype, device=target.device)   # (_zeros)
        #: an EAGLE-3 head's own vocabulary (target ids) where temperature-only q are computed
        #: (``_draft_probs``, CompiledSampledChain.vocab): when ascending (a checkpoint's d2t could
        #: list them in another order, where an inverse-CDF draw over them would pick other tokens)
        vocab = self.head.own_vocab
        self._sample_vocab = vocab if vocab is not None and ascending(vocab) else None
        #: what the engine hands over after every target forward (engine._commit)
        self.target_states = "hidden" if self.head.kind == "eagle" else tuple(self.head.target_layer_ids)
        self.cfg = cfg
        self.depth = cfg.num_speculative_tokens
        self.topk = cfg.eagle_topk
        self.static = cfg.speculative_token_tree
        Vd = self.head.cfg.draft_vocab_size if self.head.kind == "eagle3" else self.head.args.vocab_size
        if self.static and (rank := max(max(p) for p in self.static)) >= Vd:
            from leapfrog.errors import ConfigError
            raise ConfigError(f"speculative_config.speculative_token_tree: child rank {rank} "
                              f"but the head drafts from {Vd} tokens (ranks 0..{Vd - 1})")
        self.budget = cfg.draft_budget
        scratch = self.depth * max(self.topk, len(self.static or ()))  # tree columns after the prefix
        self.runner = ModelRunner(self.head, target.num_rows, target.max_model_len + scratch)
        self.chunk = target.max_num_batched_tokens
        self.computed: dict[str, int] = {}
        self._feats: dict[str, _Feats] = {}
        #: plain steps' states not yet handed to ``_feats`` (``on_plain_states``): (request ids,
        #: their start positions, the states [B, F]) per step, in order
        self._log: list[tuple[list[str], list[int], torch.Tensor]] = []
        self.static_children = _static_children(self.static) if self.static else None
        self.max_rank = max((p[-1] for p in self.static or ()), default=0)
        if target.enforce_eager and not env_off("LEAPFROG_EAGER_FUSED_DRAFTS"):
            self._fuse(compile=False)

    @property
    def feats(self) -> dict[str, _Feats]:
        """request -> its target features not yet consumed by the head (plain steps' logged
        states handed over first: every reader sees them in position order)."""
        if self._log:
            self._flush()
        return self._feats

    # ------------------------------------------------------------------ lifecycle
    def start(self, req: Request) -> None:
        feats = self.feats   # (before the id is known again: logged states of an earlier run of it are dropped)
        self.computed[req.request_id] = 0
        feats.pop(req.request_id, None)

    def finish(self, req: Request) -> None:
        self.computed.pop(req.request_id, None)
        self._feats.pop(req.request_id, None)   # (its logged states are skipped when handed over)

    def reset(self, req: Request) -> None:
        """After a failed batched step, retried request by request: the target features are of
        committed tokens only and stay valid; the head's KV from the earliest kept feature on may
        be half-written (or complete, leaving no position to draft from), so it is recomputed
        from there (_catch_up keeps the last caught-up position's feature for this)."""
        f = self.feats.get(req.request_id)
        self.computed[req.request_id] = 0 if f is None else min(f.start, self.computed.get(req.request_id, 0))

    def on_target_states(self, req: Request, start: int, states: torch.Tensor) -> None:
        """The target's states [n, F] of the committed tokens at positions start..start+n-1."""
        if self._log:   # (a plain step's states come first)
            self._flush()
        self._add(req.request_id, start, states)

    def on_plain_states(self, reqs: list[Request], states: torch.Tensor) -> None:
        """A step without drafts: the target's states [B, F] of the token each of ``reqs``
        commits, at its ``num_computed`` (before the commit). Logged as one entry and handed to
        the requests when a reader next needs them (``feats``): while "auto" drafts nothing at a
        batch size (every step plain), slicing and handing over each request's row every step
        was about 2 % of a plain step at a batch of 16 (AMX Xeon, T = 0.7); a run of steps of the
        same requests goes over as one [n, F] block each. At most _LOG_STEPS steps are kept."""
        self._log.append(([r.request_id for r in reqs], [r.num_computed for r in reqs], states))
        if len(self._log) >= _LOG_STEPS:
            self._flush()

    def _flush(self) -> None:
        """Hand the logged plain steps' states to their requests (finished ones are skipped): a run
        of entries of the same requests, each one position on from the last, as one block per
        request; anything else (a retried step's states sent again, a changed batch) entry by entry."""
        log, self._log = self._log, []
        i = 0
        try:
            while i < len(log):
                ids, starts, _ = log[i]
                j = i + 1
                while j < len(log) and log[j][0] == ids and all(s == t + j - i for s, t in zip(log[j][1], starts)):
                    j += 1
                if j - i > 1:
                    block = torch.stack([x for _, _, x in log[i:j]], dim=1).to(self._dtype)   # [B, n, F]
                    for b, (rid, s) in enumerate(zip(ids, starts)):
                        if rid in self.computed:
                            self._add(rid, s, block[b])
                else:
                    for b, (rid, s) in enumerate(zip(ids, starts)):
                        if rid in self.computed:
                            self._add(rid, s, log[i][2][b:b + 1])
                i = j
        finally:   # (a failure part way: the entries not handed over stay, in order, for the next reader)
            if i < len(log):
                self._log[:0] = log[i:]

    def _add(self, rid: str, start: int, states: torch.Tensor) -> None:
        """``on_target_states`` of request ``rid``, the log already handed over."""
        # (called per request and step: no cast when the dtype is the head's, shape not len(),
        # about 3 us a request less, 0.1 ms a step at batch 32)
        rows = states if states.dtype == self._dtype else states.to(self._dtype)  # [n, F]
        f = self._feats.get(rid)
        if f is not None:
            end = f.end   # (read once)
            if start < end:  # sent again (a retried step): keep what we have
                rows, start = rows[end - start:], end
            if start > end:   # steps the engine ran without capturing states: zeros (_ready)
                f.parts.append(self._zeros(start - end))
                f.n += start - end
            if n := rows.shape[0]:
                f.parts.append(rows)
                f.n += n
            return
        self._feats[rid] = _Feats(start, [rows], rows.shape[0])

    def _zeros(self, n: int) -> torch.Tensor:
        """[n, F] zero features for positions whose target states were not captured: a view of one
        shared row (read only: nothing writes features in place)."""
        return self._zero_row.expand(n, -1)

    def on_verified(self, reqs: list[Request], drafts: DraftBatch, result: AcceptanceResult) -> None:
        pass  # committed head positions stay valid; tree columns are scratch

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int], stop_confidence: float | None = None) -> DraftBatch:
        """Drafts of ``ks[b]`` nodes per request; ``stop_confidence`` ("auto" tree sizes:
        SpecController.stop_confidence): greedy chains from the fused chain loop draft no further
        level once every chain's path confidence is below it, and each keeps what was drafted."""
        active = [b for b, k in enumerate(ks) if k > 0 and self._ready(reqs[b])]
        fused = self._fused_tree(reqs, active, ks) if active else None
        if fused is not None:
            return fused
        nodes: dict[int, list[_Node]] = {b: [] for b in active}
        if active and not self._fused_chains(reqs, active, ks, nodes, stop_confidence):
            roots = self._catch_up([reqs[b] for b in active])  # [A, V] logits, [A, H] states
            assert roots is not None
            self._grow(reqs, active, ks, nodes, *roots)
        toks, parents, nums, qs = [], [], [], []
        for b in range(len(reqs)):
            sel = self._select(nodes.get(b, []), ks[b])
            toks += [n.token for n in sel[0]]
            parents += sel[1]
            nums.append(len(sel[0]))
            qs += [n.q for n in sel[0]]
        draft_probs = None
        if any(q is not None for q in qs):  # unseeded sampled chains: q; everyone else a point mass
            q0 = next(q for q in qs if q is not None)   # (point masses made where the q rows are)
            one_hot = torch.nn.functional.one_hot
            draft_probs = torch.stack([q if q is not None else one_hot(torch.tensor(t, device=q0.device),
                                                                       q0.shape[-1]).to(q0)
                                       for q, t in zip(qs, toks)])  # [T, V]
        # (a sampled chain's nodes have no confidence: None, for the auto tree size's controller)
        scores = [None if any(n.sampled for n in nodes.get(b, ()))
                  else sorted((math.exp(n.score) for n in nodes.get(b, [])), reverse=True) for b in range(len(reqs))]
        return DraftBatch(torch.tensor(toks, dtype=torch.long), nums, draft_probs,
                          torch.tensor(parents, dtype=torch.long), candidate_scores=scores)

    def _ready(self, req: Request) -> bool:
        """Make the target features of the pending positions computed..N-2 readable -> whether the
        request drafts (not when it was never started). Positions whose states the engine did not
        capture (a prefill while speculation is off at the batch size, leased plain steps before
        another leased one: engine ``_capture``; a lost step) read zero features: the head's KV
        there comes from the tokens alone. Lossless (the drafts only change how much a step
        accepts); measured on the built-in pair (chain of 7, T = 0, 40 held-out prompts), a gap of
        96 zero-featured positions cost 6 % of the accepted tokens over the next 16 positions and
        none after them (docs/eagle-measurements.md, stop 105)."""
        rid = req.request_id
        c = self.computed.get(rid)
        if c is None:
            return False
        f, end = self.feats.get(rid), req.num_tokens - 1
        if f is None:
            if c >= end:   # (nothing pending: no position to draft from)
                return False
            self._feats[rid] = f = _Feats(c, [], 0)
        if f.start > c:
            f.parts.insert(0, self._zeros(f.start - c))
            f.n, f.start = f.n + f.start - c, c
        if f.end < end:
            f.parts.append(self._zeros(end - f.end))
            f.n = end - f.start
        return True

    def compile(self) -> None:
        """enforce_eager=False: greedy chains and greedy dynamic trees (every request greedy) are
        drafted by one compiled graph per step (model/compiled.py CompiledChain / CompiledTree: the
        catch-up forward over up to depth + 1 new positions, then the levels), sampled chains by
        CompiledSampledChain (seeded and unseeded requests draft chains there whatever the tree
        settings); static trees, batches with greedy trees beside sampled requests and long
        catch-ups (a new prompt) run eagerly. A chain graph is compiled
        when chains can be asked for (a tree of width 1, or "auto" tree sizes up to the depth), a
        tree graph for the configured tree (depth x the width ``num_draft_tokens`` uses, as the
        eager expansion grows it; "auto": depth x eagle_topk, every size cut from it)."""
        self._fuse(compile=True)

    def _fuse(self, compile: bool) -> None:
        """The fused drafting loops of ``compile`` (compile=False: the same loops run eagerly,
        enforce_eager's default: one Python call per draft instead of the level-by-level
        expansion's bookkeeping; every batch size its own bucket, nothing padded, up to
        model/compiled.py eager_buckets' cap)."""
        from leapfrog.model.compiled import eager_buckets, make_buckets
        feats = self._zero_row.shape[1]
        rows, s = self.runner.kv.num_rows, self.depth + 1
        # (eagerly: while the runner's per-batch-size inputs stay small at large max_num_seqs, and
        # the sampled chain's [batch, steps, V] draws (float64), q and its spread over the vocabulary
        # (float32) too; larger batches grow level by level)
        n = self.runner.kv.max_model_len
        buckets = make_buckets(rows, [s]) if compile else eager_buckets(rows, s, n)
        sampled = buckets if compile else eager_buckets(rows, s, n, 16 * self.depth * self.head.args.vocab_size)
        width = self.cfg.grown_tree_shape[1]
        tree = self.static_children is None and width > 1 and self.depth > 1 and self.head.args.sliding_window is None
        kw = {"feature_width": feats, "next_width": self.head.args.hidden_size, "compile": compile}
        if not tree or self.cfg.auto_tree:
            self.runner.compile_chain(buckets, self.depth, vocab=self.head.own_vocab, **kw)
        if self.static_children is None:   # sampled chains (temperature-only requests; in trees too)
            self.runner.compile_sampled_chain(sampled, self.depth, self._want(), self.head.cfg.greedy_logit_scale,
                                              vocab=self._sample_vocab, **kw)
        if tree:
            self.runner.compile_tree(buckets, self.depth, width, self.budget, **kw)

    def _pending(self, rs: list[Request], keep: int) -> list[SeqChunk]:
        """The fused graphs' first forward: each request's pending head positions (after catching
        up all but the last ``keep`` eagerly: a new prompt), with their target features."""
        self._catch_up(rs, keep=keep)
        chunks = []
        for r in rs:
            c, end = self.computed[r.request_id], r.num_tokens - 1   # positions c..end-1
            f = self.feats[r.request_id]
            chunks.append(SeqChunk(r.row, c, r.all_ids[c + 1:end + 1], 1, features=f.rows()[c - f.start:end - f.start]))
        return chunks

    def _consumed(self, rs: list[Request]) -> None:
        """A fused graph ran the pending positions: they are the head's committed KV now."""
        for r in rs:
            self.computed[r.request_id] = r.num_tokens - 1
            self.feats[r.request_id].drop_before(r.num_tokens - 2)

    @torch.inference_mode()
    def prefill(self, reqs: list[Request]) -> None:
        """The head's cache over each new prompt's positions but the last (which every drafting
        path runs itself, for its logits), in the target's prefill step (engine: _drafters_prefill)."""
        ready = [r for r in reqs if self._ready(r)]
        if ready:
            self._catch_up(ready, keep=1)

    def round_state(self, reqs: list[Request], k: int) -> tuple[torch.Tensor, ...] | None:
        """Multi-step speculation's first input (model/compiled.py CompiledEagleRound), after
        catching the head up to all but its last k + 1 pending positions: per request those
        positions' next tokens [n, k + 1] and target features [n, k + 1, F] (padded), the last
        real one's index [n] and the first position [n]; None when a request is not ready."""
        if not all(self._ready(r) for r in reqs):
            return None
        chunks = self._pending(reqs, k + 1)
        S = k + 1
        return (torch.tensor([ch.token_ids + [0] * (S - len(ch.token_ids)) for ch in chunks]),
                self.runner._pad_features(chunks, S),
                torch.tensor([len(ch.token_ids) - 1 for ch in chunks]), torch.tensor([ch.start for ch in chunks]))

    def after_rounds(self, req: Request, state: tuple[torch.Tensor, ...]) -> None:
        """After multi-step speculation: the head's cache holds every position before the last
        round's pending ones, whose target features it keeps."""
        _, feats, last, start = state
        s, n = int(start), int(last) + 1
        self.computed[req.request_id] = s
        self.feats[req.request_id] = _Feats(s, [feats[:n]], n)

    def _fused_tree(self, reqs: list[Request], active: list[int], ks: list[int]) -> DraftBatch | None:
        """Greedy dynamic trees for every active request from the compiled tree graph (see
        compile): the configured tree is grown whatever k, and each request keeps
        its best ``min(k, budget)`` nodes (the graph's best nodes by rank: closed under ancestors,
        a node's rank exceeds its parent's). Steps where every request asks for a chain take the
        chain graph when there is one; a request near its end (fewer levels than the depth left
        to generate: tree_depth_cap) sends the step to the eager expansion, which reranks the
        shallower tree. -> None (nothing done) when the step does not qualify."""
        tree = self.runner.tree
        if tree is None or not all(reqs[b].params.greedy and tree_depth_cap(reqs[b]) >= self.depth for b in active) \
                or (self.runner.chain is not None and all(self._width(ks[b]) == 1 for b in active)):
            return None
        rs = [reqs[b] for b in active]
        out = self.runner.draft_tree(self._pending(rs, tree.max_tokens))
        if out is None:
            return None  # (the pending positions stay pending: the eager path catches them up)
        self._consumed(rs)
        toks, pars, ranks = (x.tolist() for x in (out.tokens, out.parents, out.ranks))
        scores = out.scores.exp().tolist()
        flat_t, flat_p, nums, cand = [], [], [0] * len(reqs), [[] for _ in reqs]
        for i, b in enumerate(active):
            n = min(ks[b], self.budget)
            keep = [j for j in range(len(toks[i])) if ranks[i][j] < n]
            local = {j: x for x, j in enumerate(keep)}
            flat_t += [toks[i][j] for j in keep]
            flat_p += [-1 if pars[i][j] < 0 else local[pars[i][j]] for j in keep]
            nums[b], cand[b] = len(keep), scores[i]
        return DraftBatch(torch.tensor(flat_t, dtype=torch.long), nums, None,
                          torch.tensor(flat_p, dtype=torch.long), candidate_scores=cand)

    def _fused_chains(self, reqs: list[Request], active: list[int], ks: list[int],
                      nodes: dict[int, list[_Node]], stop: float | None = None) -> bool:
        """Chains for every active request from a compiled chain graph (see compile): the greedy
        graph when every request is greedy, else the sampled one (temperature-only requests; an
        unseeded one drafts a chain whatever its tree size: ``_children``);
        -> False (nothing done) when the step does not qualify."""
        if self.static_children is not None:
            return False
        rs = [reqs[b] for b in active]
        if not all(r.params.greedy for r in rs):
            return self._fused_sampled_chains(reqs, active, ks, nodes)
        chain = self.runner.chain
        if not all(self._width(ks[b]) == 1 for b in active):
            return False
        if chain is None:
            return False
        levels = max(self._levels(reqs[b], ks[b]) for b in active)
        out = self.runner.draft_chain(self._pending(rs, chain.max_tokens), levels,
                                      self.cfg.min_draft_confidence if stop is None else stop)
        if out is None:
            return False
        self._consumed(rs)
        toks, lps = out.tokens.tolist(), out.logprobs.tolist()
        for i, b in enumerate(active):
            score = 0.0
            for d in range(chain_length(lps[i], self._levels(reqs[b], ks[b]), self.cfg.min_draft_confidence)):
                score += lps[i][d]
                nodes[b].append(_Node(toks[i][d], d - 1, score, d + 1, 0, None))
        return True

    def _fused_sampled_chains(self, reqs: list[Request], active: list[int], ks: list[int],
                              nodes: dict[int, list[_Node]]) -> bool:
        """Chains from the sampled chain graph (model/compiled.py CompiledSampledChain): each level
        drawn as ``_candidates`` draws it, from the same uniforms (a seeded request's position
        noise, V per level; an unseeded one's next draws of its generator, one per level: drawn
        here, for the levels the eager expansion would draw); greedy requests take the argmax.
        Sampled requests take it at any tree size (the tree's depth in levels): an unseeded
        request drafts a chain anyway, and a seeded one's tree grown level by level cost more
        than its extra accepted token (module docstring)."""
        chain = self.runner.sampled_chain
        rs = [reqs[b] for b in active]
        if chain is None or not all((r.params.greedy or r.temperature_only)
                                    and self._grown_width(r, ks[b]) == 1
                                    for b, r in zip(active, rs)):
            return False
        chunks = self._pending(rs, chain.max_tokens)
        if not self.runner.fits_sampled_chain(chunks):
            return False   # (before any randomness is drawn; the pending positions stay pending)
        levels = [self._levels(r, ks[b]) for b, r in zip(active, rs)]
        temperature = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rs],
                                   device=self.runner.device)
        drawn = torch.tensor([not r.params.greedy for r in rs], device=self.runner.device)
        out = self.runner.draft_sampled_chain(chunks, temperature, drawn, *self._chain_draws(rs, levels, chain),
                                              steps=max(levels))
        if out is None:
            raise RuntimeError("sampled chain: no graph for a step its bucket check admitted")
        self._consumed(rs)
        toks, lps, shares = out.tokens.tolist(), out.logprobs.tolist(), out.shares.tolist()
        for i, (b, r, n) in enumerate(zip(active, rs, levels)):
            if r.params.greedy:   # (sampled requests draft their full chains)
                n = chain_length(lps[i], n, self.cfg.min_draft_confidence)
            score = 0.0
            for d in range(n):
                q, unseeded = None, r.unseeded_sampled
                if r.params.greedy:
                    score += lps[i][d]
                elif unseeded:
                    q = out.q[i, d]   # (confidence 1: see _candidates)
                else:
                    score += shares[i][d]
                nodes[b].append(_Node(toks[i][d], d - 1, score, d + 1, 0, None, q=q, sampled=unseeded))
        return True

    def _chain_draws(self, rs: list[Request], levels: list[int],
                     chain: CompiledSampledChain) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampled chain graph's randomness for requests ``rs``, for the ``levels`` each draws
        (the levels the eager expansion would draw): the race's exponentials e [n, steps, V]
        float64 (a seeded request's kept position noise, sampler.exponentials: what
        ``_candidates``' race divides by; where the chain runs in C++, their noise keys [n,
        steps, 2] int64, sampler.noise_keys), the unseeded rows stream [n] bool and their uniforms
        w [n, steps] float64 (the next draws of the request's generator, one per level: the
        draws ``_candidates`` makes). When no row races, e is the graph's unread buffer: the
        draw of V uniforms per level is what inverse CDF saves."""
        dev, steps, vocab = self.runner.device, chain.steps, chain.model.args.vocab_size
        stream = [r.unseeded_sampled for r in rs]
        if any(not r.params.greedy and r.seed_key is not None for r in rs):
            rngs = [r.rng(d) if d < n and not s else None for r, n, s in zip(rs, levels, stream) for d in range(steps)]
            if chain.races_by_key:   # (the C++ chain computes E where it reads it: keys [n, steps, 2])
                e = sampler.noise_keys(rngs, dev).view(len(rs), steps, 2)
            else:
                e = sampler.exponentials(rngs, vocab, dev).view(len(rs), steps, vocab)
        else:
            e = chain.unread(len(rs), dev)
        w = sampler.stream_rows([r.generator if s else None for r, s in zip(rs, stream)], levels, steps, dev)
        return e, torch.tensor(stream, device=dev), w

    def _catch_up(self, reqs: list[Request], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run the head over every pending position (long prompts in chunks); -> the last
        position's logits [A, V] and output state [A, H] per request. ``keep`` > 0: leave the
        last ``keep`` positions pending (for the fused chain graph) -> None."""
        last_logits: list[torch.Tensor | None] = [None] * len(reqs)
        last_state: list[torch.Tensor | None] = [None] * len(reqs)
        while True:
            chunks, who = [], []
            for i, r in enumerate(reqs):
                c, end = self.computed[r.request_id], r.num_tokens - 1 - keep   # positions c..end-1
                if c >= end:
                    continue
                n = min(end - c, self.chunk)
                f = self.feats[r.request_id]
                feats = f.rows()[c - f.start:c - f.start + n]
                chunks.append(SeqChunk(r.row, c, r.all_ids[c + 1:c + 1 + n], 1 if c + n == end and not keep else 0,
                                       features=feats))
                who.append(i)
                self.computed[r.request_id] = c + n
            if not chunks:
                break
            # every position's keys and values; the output state of each request's last one only
            out = self.runner.step(chunks, hidden="logits_rows")
            li = 0
            for i, ch in zip(who, chunks):
                if ch.num_logits:
                    last_logits[i], last_state[i] = out.logits[li], out.hidden[li]
                    li += 1
        for r in reqs:  # features before the last caught-up position are never read again (reset)
            self.feats[r.request_id].drop_before(self.computed[r.request_id] - 1)
        if keep:
            return None
        if any(x is None for x in last_logits):
            raise RuntimeError("EAGLE head: a request had no position to catch up on")
        return torch.stack(last_logits), torch.stack(last_state)  # type: ignore[arg-type]

    def _grow(self, reqs: list[Request], active: list[int], ks: list[int], nodes: dict[int, list[_Node]],
              logits: torch.Tensor, states: torch.Tensor) -> None:
        """Add depth-1 candidates, then expand level by level (module docstring, step 2)."""
        frontier: dict[int, list[int]] = {}
        cands = self._candidates(logits, [(reqs[b], nodes[b], -1) for b in active])
        for i, b in enumerate(active):
            frontier[b] = self._children(nodes[b], -1, 0.0, 1, cands[i], states[i],
                                         self._grown_width(reqs[b], ks[b]))
        next_col = {b: self.computed[reqs[b].request_id] for b in active}
        context = dict(next_col)
        for depth in range(2, self.depth + 1):
            todo = [b for b in active if frontier[b] and depth <= self._levels(reqs[b], ks[b])
                    and not self._chain_ended(reqs[b], nodes[b], frontier[b])]
            if not todo:
                break
            chunks = []
            for b in todo:
                ns = nodes[b]
                if len(ns) == depth - 1:  # a chain so far: its columns follow the prefix, plain causal
                    j = frontier[b][0]
                    chunks.append(SeqChunk(reqs[b].row, next_col[b], [ns[j].token], 1, features=ns[j].feat[None]))
                    ns[j].col = next_col[b]
                    next_col[b] += 1
                    continue
                extra, first = [], []
                for j in frontier[b]:
                    extra.append([a.col for a in _ancestry(ns, ns[j].parent)])
                    first.append(context[b] + ns[j].depth - 1)
                feats = torch.stack([ns[j].feat for j in frontier[b]])
                chunks.append(SeqChunk(reqs[b].row, next_col[b], [ns[j].token for j in frontier[b]],
                                       len(frontier[b]), features=feats, context=context[b], extra_cols=extra,
                                       first_pos=first))
                for k, j in enumerate(frontier[b]):
                    ns[j].col = next_col[b] + k
                next_col[b] += len(frontier[b])
            out = self.runner.step(chunks, hidden="hidden")
            cands = self._candidates(out.logits, [(reqs[b], nodes[b], j) for b in todo for j in frontier[b]])
            o = 0
            for b in todo:
                cand = []
                for j in frontier[b]:
                    cand += self._children(nodes[b], j, nodes[b][j].score, depth, cands[o], out.hidden[o],
                                           self._grown_width(reqs[b], ks[b]))
                    o += 1
                frontier[b] = self._next_frontier(nodes[b], cand, self._grown_width(reqs[b], ks[b]))

    def _chain_ended(self, req: Request, ns: list[_Node], frontier: list[int]) -> bool:
        """Whether a greedy request's chain ends before this level: its last draft's path
        confidence is below min_draft_confidence (as ``chain_length`` cuts the fused chains)."""
        return (req.params.greedy and len(frontier) == 1 and len(ns) == ns[frontier[0]].depth
                and chain_ended(ns[frontier[0]].score, self.cfg.min_draft_confidence))

    def _candidates(self, logits: torch.Tensor, rows: list[tuple[Request, list[_Node], int]]) -> list[_Cand]:
        """Children candidates of each row's node (rows: (request, its nodes, the node; -1 = the
        root)), logits [R, V]: the most likely tokens for greedy requests, one token drawn from
        the processed q for sampled ones (module docstring)."""
        vals, ids = self._top(logits)
        out = [_Cand(v, i) for v, i in zip(vals, ids)]
        sampled = [i for i, (r, _, _) in enumerate(rows) if not r.params.greedy]
        if not sampled:
            return out
        specs, rngs = [], []
        for i in sampled:
            req, ns, j = rows[i]
            path = [n.token for n in _ancestry(ns, j)]
            specs.append(req.row_spec(path))
            rngs.append(req.rng(len(path)))
        q = self._draft_probs(logits[sampled], [rows[i][0] for i in sampled], specs)   # [R', V] q as trained
        # unseeded rows draw one token x ~ q by inverse CDF (one uniform of their stream, as
        # sampler.sample draws them); seeded rows race with their position noise
        seeded = [k for k, i in enumerate(sampled) if rows[i][0].seed_key is not None]
        stream = [k for k, i in enumerate(sampled) if rows[i][0].seed_key is None]
        drawn = sampler.sample(q[stream], [rngs[k] for k in stream]).tolist() if stream else []
        for k, x in zip(stream, drawn):
            # verified by rejection sampling (which needs q). Confidence 1 (log 0): q(x) says
            # little about its acceptance (about sum min(p, q), near 1 when q matches p); the
            # auto tree size calibrates it by measurement
            out[sampled[k]] = _Cand([0.0], [x], q[k], sampled=True)
        if not seeded:
            return out
        # seeded: verified by matching the target's draw under the same position noise, so the
        # race's first finishers under q are the likeliest matches: a tree like a greedy one's
        # (any children are lossless; they only change how many match), each child's confidence
        # its share of the finishers' race values q / E (the winner's path ranks first; a close
        # runner-up is a likely match where p and q differ)
        race = sampler.race_top(q[seeded], [rngs[k] for k in seeded], self._want())
        share = torch.log(race.values / race.values.sum(-1, keepdim=True)).tolist()   # [R'', want]
        for s, top in enumerate(race.indices.tolist()):
            n = sum(x >= 0 for x in top)
            out[sampled[seeded[s]]] = _Cand(share[s][:n], top[:n])
        return out

    def _draft_probs(self, logits: torch.Tensor, reqs: list[Request], specs: list) -> torch.Tensor:
        """q [R, V] of sampled rows (logits [R, V], one request and row spec per row): the
        request's processed distribution of the head's logits as trained (divided by its greedy
        calibration). When every row is temperature-only and the head has its own vocabulary,
        softmax over those Vd logits spread over V (zeros elsewhere: the same distribution),
        computed as the sampled chain graph computes it (model/compiled.py
        CompiledSampledChain), so the expansion and the graph draw the same tokens."""
        scale, vocab = self.head.cfg.greedy_logit_scale, self._sample_vocab
        if vocab is not None and all(r.temperature_only for r in reqs):
            from leapfrog.model.compiled import race_probs
            vocab = vocab.to(logits.device)   # (the runner's logits are on the host; the head's ids on its device)
            t = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
            qd = race_probs(logits.index_select(-1, vocab).float(), t, scale)                # [R, Vd]
            return qd.new_zeros(len(reqs), logits.shape[-1]).index_copy_(-1, vocab, qd)
        return sampler.probs(logits / scale, sampler.build_rows(specs, logits.shape[-1]), proposal=True)

    def _top(self, logits: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """The most likely children of every row at once: log q and token ids, best first
        (enough for the widest rank the tree asks for); logits [R, V]."""
        top = torch.log_softmax(logits.float(), -1).topk(min(self._want(), logits.shape[-1]))
        return top.values.tolist(), top.indices.tolist()

    def _want(self) -> int:
        """Candidates per node: enough for the widest rank the tree asks for."""
        return self.topk if self.static_children is None else self.max_rank + 1

    def _levels(self, req: Request, k: int) -> int:
        """Tree levels drafted for a request asking for k nodes: the depth-1 candidates always,
        deeper levels up to k and to what the request may still generate (tree_depth_cap)."""
        return max(1, min(self.cfg.tree_shape(k)[0], tree_depth_cap(req)))

    def _width(self, k: int) -> int:
        """Children per frontier node (and frontier size) for a tree of k nodes
        (SpeculativeConfig.tree_shape: a chain for k <= depth, so "auto" sizes below that grow,
        and pay for, one node per level)."""
        return self.cfg.tree_shape(k)[1]

    def _grown_width(self, req: Request, k: int) -> int:
        """``_width`` for ``req``'s dynamic tree: 1 for a sampled request (an unseeded one draws
        one child anyway; a seeded one drafts the race's winner per level, as the fused sampled
        chain loop drafts it: module docstring), so both paths draft the same chain."""
        return 1 if not req.params.greedy else self._width(k)

    def _children(self, ns: list[_Node], parent: int, score: float, depth: int, cand: _Cand,
                  state: torch.Tensor, width: int) -> list[int]:
        """Append the candidate children of ``parent`` (``state`` [H] is the head's output state
        after the parent: the feature the children run with) -> their node indices."""
        if cand.sampled:
            ranks = [0]  # a sampled chain
        elif self.static_children is not None:
            ranks = self.static_children.get(_ranks(ns, parent), [])
        else:
            ranks = list(range(width))
        out = []
        for r in ranks:
            if r < len(cand.ids):
                ns.append(_Node(cand.ids[r], parent, score + cand.vals[r], depth, r, state, q=cand.q,
                                sampled=cand.sampled))
                out.append(len(ns) - 1)
        return out

    def _next_frontier(self, ns: list[_Node], cand: list[int], width: int) -> list[int]:
        if any(ns[j].sampled for j in cand):
            return cand  # a sampled chain goes on whatever the static tree says
        if self.static_children is not None:
            return [j for j in cand if self.static_children.get(_ranks(ns, j))]
        return sorted(cand, key=lambda j: -ns[j].score)[:width]

    def _select(self, ns: list[_Node], k: int) -> tuple[list[_Node], list[int]]:
        """The best ``min(k, budget)`` nodes by path confidence, closed under ancestors, parents
        first and siblings best first; -> (nodes, parents as local indices)."""
        if not ns:
            return [], []
        n = min(k, self.budget)
        keep: set[int] = set()
        for j in sorted(range(len(ns)), key=lambda j: -ns[j].score):
            if len(keep) >= n:
                break
            chain, a = [], j
            while a >= 0 and a not in keep:
                chain.append(a)
                a = ns[a].parent
            if len(keep) + len(chain) <= n:
                keep.update(chain)
        order = sorted(keep, key=lambda j: (ns[j].depth, -ns[j].score))
        local = {j: i for i, j in enumerate(order)}
        return [ns[j] for j in order], [local[ns[j].parent] if ns[j].parent >= 0 else -1 for j in order]


def _ancestry(ns: list[_Node], j: int) -> list[_Node]:
    """The nodes from the root's child down to node j (j = -1: none)."""
    path = []
    while j >= 0:
        path.append(ns[j])
        j = ns[j].parent
    return path[::-1]


def _ranks(ns: list[_Node], j: int) -> tuple[int, ...]:
    """Node j's path as child ranks (static trees' keys; () for the root)."""
    return tuple(n.rank for n in _ancestry(ns, j))


def _static_children(paths: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """{path of ranks: its children's ranks}, the root being ()."""
    out: dict[tuple[int, ...], list[int]] = {}
    for p in paths:
        out.setdefault(p[:-1], []).append(p[-1])
    return {k: sorted(v) for k, v in out.items()}


register_proposer("eagle")(EagleProposer)
register_proposer("eagle3")(EagleProposer)
