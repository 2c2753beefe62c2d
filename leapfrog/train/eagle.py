"""EAGLE head training (``leapfrog train-draft TARGET --method eagle|eagle3``).

A frozen target, run without gradients, gives every batch its features and its next-token
logits; a head (model/eagle.py) learns to draft from them. Notation as the papers: p = the
target's distribution, q = the head's; f_t = the target's feature at position t.

Alignment (model/eagle.py's): a window of S tokens x_0..x_{S-1} gives R = S - 1 head rows; row
t pairs token x_{t+1} with feature f_t at position t, and its output h_t is scored against the
target at position t+1 (p_{t+1} predicts x_{t+2}; EAGLE-1 also regresses h_t onto f_{t+1}).

Losses:
  * EAGLE-1 (Li et al. 2024): ``feature_weight`` x SmoothL1(h_t, f_{t+1}) + ``token_weight`` x
    CE(p_{t+1}, softmax(LM_head(h_t))) (1.0 and 0.1, as the paper), with U(-a, a) noise on the
    input features (``feature_noise``, the paper's a = 0.1). The CE is reported as KL(p || q):
    the same gradient, 0 when q = p.
  * EAGLE-3 (Li et al. 2025): no feature loss; KL(p || q) over the draft vocabulary (p
    renormalised on it; rows whose target argmax is outside it are not scored, as the authors
    do), summed over ``ttt_steps`` unrolled draft steps with weights ``step_decay ** j`` (0.8).

Training-time test (EAGLE-3's): step j runs every row again, fed the head's own output of step
j-1 one row up instead of the target's feature, exactly what the inference tree expansion feeds
a depth-(j+1) node (spec_decode/proposers/eagle.py). Row t of step j (token x_{t+1}, position t)
sees step 0's keys at rows <= t-j (the committed prefix) and its chain of earlier-step keys: step
i's key at row t-j+i, i = 1..j (its ancestors in the tree, itself last). Worked example, R = 4,
step j = 2, columns = step 0's rows 0..3 | step 1's rows 0..3 | step 2's rows 0..3:

    row 0:  . . . . | . . . . | x . . .      rows t < j have no step-j draft: computed, not scored
    row 1:  . . . . | x . . . | . x . .
    row 2:  x . . . | . x . . | . . x .
    row 3:  x x . . | . . x . | . . . x

The unroll runs the head's own forward with a stand-in for the KV cache (``_UnrolledKV``) that
keeps each step's keys and values with their gradients; attention is model/eagle.py's SDPA call
with this mask, so no model math is repeated here (tests check step 0 against ``head(..., kv=None)``
and later steps against a KV-cached ModelRunner tree expansion).

EAGLE-3's draft vocabulary: the ``draft_vocab_size`` most frequent tokens of the training data
(EAGLE-3's and SpecForge's choice), written as d2t/t2d. It starts in the target's output space
(``init_from_target``: the target's LM head rows and final norm, fc picking the top layer).

Greedy calibration (EAGLE-3, ``greedy_calibration``): KL training makes q as flat as p, but at
temperature 0 a draft is accepted when it is argmax p, which the head's top-1 hits far more often
than q(top-1) says; the dynamic tree ranks nodes by path confidence (sums of log q), so such a
head spends its node budget near the root. After training, one scale s of the draft logits is
fitted on training batches (s = argmin CE(s * logits, argmax p), all unrolled steps) and folded
into lm_head. Drafts stay point masses, so this changes which tokens are proposed, never the output.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leapfrog.attention.metadata import AttnMeta
from leapfrog.errors import ConfigError
from leapfrog.model.eagle import EagleHead, EagleKind, head_fingerprint, init_eagle_head, save_eagle_head
from leapfrog.model.llama import LlamaModel
from leapfrog.spec_decode.config import MAX_SPECULATIVE_TOKENS
from leapfrog.train.corpus import (Document, fingerprint, heldout_or_training, pack_stream, read_documents,
                                   split_by_file)
from leapfrog.train.distill import (check_target, generation_params, generation_temperatures, heldout_prompts,
                                    heldout_windows, line_windows, resolve_autocast)
from leapfrog.train.loop import (
    CHECKPOINT_NAME,
    TrainConfig,
    TrainingDiverged,
    TrainState,
    batch_at,
    check_finite,
    load_checkpoint,
    lr_at,
    make_optimizer,
    plot_losses,
    save_checkpoint,
    settings_diff,
)

META_NAME = "eagle_meta.json"   # beside loop.py's train_state.pt: settings + per-step metrics history
DATA_NAME = "eagle_data.pt"     # the token streams (generated data is expensive to make again)
#: (num_speculative_tokens, eagle_topk, num_draft_tokens) measured after training: EAGLE-2's
#: dynamic tree, and a chain (topk 1)
DEFAULT_TREES: tuple[tuple[int, int, int | None], ...] = ((5, 4, 16), (5, 1, None))


def default_draft_vocab_size(vocab_size: int) -> int:
    """EAGLE-3's draft vocabulary by default: the whole of a small vocabulary (<= 1024), else half
    of it, at most 32000 (the authors' size for Llama 3's 128k tokens): 4096 for the 8192-token demo."""
    return vocab_size if vocab_size <= 1024 else min(32000, vocab_size // 2)


@dataclass(frozen=True)
class EagleRecipe:
    """What is trained and how it is scored; defaults are the papers' (see the module docstring)."""

    ttt_steps: int | None = None          # draft steps unrolled per batch; None: 1 (eagle), 4 (eagle3)
    step_decay: float = 0.8               # step j's loss weight: step_decay ** j
    draft_vocab_size: int | None = None   # eagle3; None: default_draft_vocab_size(V)
    feature_weight: float = 1.0           # eagle: SmoothL1(h_t, f_{t+1})
    token_weight: float = 0.1             # eagle: CE(p, q); eagle3's token loss is the whole loss
    feature_noise: float = 0.1            # eagle: U(-a, a) on the input features (0: none)
    intermediate_size: int | None = None  # the head's MLP width (default: the target's)
    num_key_value_heads: int | None = None  # the head's KV heads (default: the target's)
    target_layer_ids: tuple[int, ...] | None = None  # eagle3 aux layers (default: low/middle/high)
    init_from_target: bool = True         # eagle3: warm start from the target (_new_head)
    greedy_calibration: bool = True       # eagle3: fold a logit scale fitted for temperature 0 into lm_head

    def steps_for(self, kind: EagleKind) -> int:
        return self.ttt_steps if self.ttt_steps is not None else (1 if kind == "eagle" else 4)


@dataclass(frozen=True)
class EagleData:
    """Where the training tokens come from (as distill.py's data modes)."""

    mode: str = "corpus"           # "corpus": windows of the text; "generate": the target's own continuations
    heldout_fraction: float = 0.05  # files held out (split by file, corpus.split_by_file)
    split_seed: int = 0
    gen_tokens: int = 128          # generate: tokens per continuation
    gen_temperature: float | tuple[float, ...] = 1.0  # generate: 0 = greedy; several: a mix sharing the
                                   #   prompts evenly (distill.generation_params): one head for greedy and sampled
    gen_prompt_tokens: int = 32    # generate: prompt length
    gen_prompts_per_doc: int = 1   # generate: prompts cut from each document (evenly spaced)
    gen_max_num_seqs: int = 64     # generate: the engine's batch


@dataclass(frozen=True)
class EagleEval:
    """The held-out acceptance test run after training (temperature 0, through the engine)."""

    prompts: int = 16
    max_tokens: int = 64
    trees: tuple[tuple[int, int, int | None], ...] = DEFAULT_TREES
    dtype: str = "float32"


@dataclass
class LossParts:
    """One batch's loss and what it is made of, per unrolled step j."""

    total: Tensor                  # [] the optimised scalar
    token_kl: list[float]          # KL(p || q) per step (nats/token)
    feature: list[float]           # EAGLE-1: SmoothL1 per step ([] for EAGLE-3)
    accuracy: list[float]          # argmax q == argmax p per step


@dataclass
class EagleResult:
    path: Path
    kind: EagleKind
    head_parameters: int
    target_parameters: int
    draft_vocab_size: int
    draft_vocab_coverage: float    # share of the training tokens inside the draft vocabulary
    train_tokens: int
    state: TrainState
    heldout_before: dict           # heldout metrics: {"loss", "token_kl": [per step], "accuracy": [per step]}
    heldout_after: dict
    wall_time_s: float             # the training steps (data and evaluation excluded), resumed runs summed
    data_time_s: float = 0.0       # making the data (generation), when it was first made
    calibration: dict | None = None  # greedy calibration: {"scale", "ce_before", "ce_after"} (nats/token)
    acceptance: list[dict] = field(default_factory=list)  # one per evaluated tree
    history: list[dict] = field(default_factory=list)     # per-step metrics at eval points

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("state", "history")}
        d["path"] = str(self.path)
        d["steps"] = self.state.step
        d["final_train_loss"] = self.state.losses[-1][1] if self.state.losses else None
        return d


# ---------------------------------------------------------------------------- data and the batch the head sees

@dataclass
class TokenData:
    """Training tokens: a stream [T] and, in generate mode, the bounds [N + 1] of its N samples
    (sample i = stream[bounds[i]:bounds[i + 1]]: a prompt, the target's continuation, EOS).

    Samples are batched whole, each from position 0 and with nothing before it, as the engine runs
    a prompt: packing them into windows would let the head copy from a previous sample (two
    prompts of one file continue alike) and see positions it never meets at inference. Without
    bounds (corpus mode) batches are random windows of the stream (loop.py's batch_at)."""

    stream: Tensor
    bounds: Tensor | None = None

    def batch(self, step: int, cfg: TrainConfig) -> tuple[Tensor, Tensor]:
        """-> token ids [B, S] (samples padded with 0 after their end) and lengths [B], a pure
        function of (cfg.seed, step) so that a resumed run sees the same batches."""
        if self.bounds is None:
            windows = batch_at(self.stream, step, cfg)
            return windows, torch.full((len(windows),), windows.shape[1])
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        return self.rows(torch.randint(0, len(self.bounds) - 1, (cfg.batch_size,), generator=g), cfg.seq_len)

    def rows(self, idx: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
        """Samples ``idx`` [B] (at most ``max_len`` tokens each) -> [B, S] padded, lengths [B]."""
        assert self.bounds is not None
        starts, ends = self.bounds[idx], torch.minimum(self.bounds[idx + 1], self.bounds[idx] + max_len)
        lengths = ends - starts
        out = torch.zeros(len(idx), int(lengths.max()), dtype=torch.long)
        for b, (a, e) in enumerate(zip(starts.tolist(), ends.tolist())):
            out[b, :e - a] = self.stream[a:e]
        return out, lengths

    def heldout(self, n: int, seq_len: int) -> list[tuple[Tensor, Tensor]]:
        """Up to ``n`` evenly spaced held-out windows or samples, in batches of 4: [(ids [b, S], lengths [b])]."""
        if self.bounds is None:
            w = heldout_windows(self.stream, n, min(seq_len, self.stream.numel() - 1))
            return [(x, torch.full((len(x),), x.shape[1])) for x in w.split(4)]
        N = len(self.bounds) - 1
        idx = torch.linspace(0, N - 1, min(n, N)).round().long().unique()
        return [self.rows(i, seq_len) for i in idx.split(4)]


@dataclass
class TargetBatch:
    """One batch of windows as the head sees it (module docstring: row t = token x_{t+1}, feature f_t)."""

    token_ids: Tensor             # [B, R] x_{t+1}
    positions: Tensor             # [B, R] t
    features: Tensor              # [B, R, F] f_t (EAGLE-3: three layers concatenated, F = 3 Ht)
    next_features: Tensor | None  # [B, R, Ht] f_{t+1} (EAGLE-1's regression target)
    p: Tensor                     # [B, R, Vd] float32 the target's next-token distribution at t+1, on the
                                  #   draft vocabulary (renormalised there)
    p_top: Tensor                 # [B, R] argmax p (draft ids)
    p_log_p: Tensor               # [B, R] sum p log p (-entropy): KL(p || q) = p_log_p - sum p log q
    scored: Tensor                # [B, R] bool: rows scored (EAGLE-3: argmax p inside the draft vocabulary)


@torch.no_grad()
def target_batch(target: LlamaModel, head: EagleHead, windows: Tensor, lengths: Tensor | None = None) -> TargetBatch:
    """windows [B, S] token ids (``lengths`` [B]: real tokens, then padding) -> the head's inputs and
    targets (R = S - 1 rows; a sample of L tokens scores rows 0..L-2)."""
    B, S = windows.shape
    pos = torch.arange(S, device=windows.device).expand(B, S)
    out = target(windows, pos, aux_layers=head.target_layer_ids)
    feats = head.target_features(out)                                             # [B, S, F]
    p = target.compute_logits(out.hidden[:, 1:].reshape(B * (S - 1), -1)).view(B, S - 1, -1)  # [B, R, V]
    scored = torch.ones(B, S - 1, dtype=torch.bool, device=windows.device)
    if lengths is not None:
        scored = pos[:, :-1] < (lengths.to(windows.device)[:, None] - 1)
    if head.kind == "eagle3" and not head.identity_vocab:
        scored &= head.t2d[p.argmax(-1)]
        p = p[..., head.draft_ids]                                                # [B, R, Vd]
    nxt = out.hidden[:, 1:] if head.kind == "eagle" else None
    log_p = F.log_softmax(p.float(), dim=-1)     # computed once: every unrolled step is scored against it
    probs = log_p.exp()
    return TargetBatch(windows[:, 1:], pos[:, :-1], feats[:, :-1], nxt, probs, log_p.argmax(-1),
                       (probs * log_p).sum(-1), scored)


# ---------------------------------------------------------------------------- training-time test

def ttt_mask(R: int, step: int, device: torch.device | str = "cpu") -> Tensor:
    """[R, (step + 1) R] bool: which keys row t of unrolled step ``step`` sees (module docstring's
    example): step 0's rows r <= t - step, then for i = 1..step step i's row t - step + i."""
    t = torch.arange(R, device=device)[:, None]
    r = torch.arange(R, device=device)[None, :]
    return torch.cat([r <= t - step] + [r == t - step + i for i in range(1, step + 1)], dim=1)


class _UnrolledKV:
    """Stands in for KVCache (attention/backend.py's ``write_and_read``) while unrolling: keeps every
    step's keys and values, gradients and all, and hands attention all of them, step by step."""

    def __init__(self) -> None:
        self.k: dict[int, list[Tensor]] = {}
        self.v: dict[int, list[Tensor]] = {}

    def write_and_read(self, layer: int, meta: AttnMeta, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, R, Hkv, Dh] of this step -> all steps' [B, Hkv, (steps so far) R, Dh]."""
        self.k.setdefault(layer, []).append(k.transpose(1, 2))
        self.v.setdefault(layer, []).append(v.transpose(1, 2))
        return torch.cat(self.k[layer], dim=2), torch.cat(self.v[layer], dim=2)


def _meta(mask: Tensor) -> AttnMeta:
    empty = torch.empty(0, dtype=torch.long, device=mask.device)
    return AttnMeta(rows=empty, write_rows=empty, write_cols=empty, kv_len=mask.shape[-1], mask=mask[None, None])


def unroll(head: EagleHead, tb: TargetBatch, steps: int, noise: Tensor | None = None) -> list[Tensor]:
    """The head's outputs h [B, R, H] of ``steps`` unrolled draft steps (training-time test).
    Step 0 reads the target's features (plus ``noise`` [B, R, F], EAGLE-1's); step j > 0 reads
    the head's own step j-1 output one row up (row 0 gets zeros: it has no step-j draft)."""
    R = tb.token_ids.shape[1]
    kv = _UnrolledKV()
    feats = tb.features if noise is None else tb.features + noise
    outs: list[Tensor] = []
    for j in range(steps):
        if j:
            prev = outs[-1]
            feats = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)  # row t <- h^{j-1}_{t-1}
        mask = ttt_mask(R, j, tb.token_ids.device)
        outs.append(head(tb.token_ids, feats, tb.positions, kv, _meta(mask)).hidden)  # type: ignore[arg-type]
    return outs


def eagle_loss(head: EagleHead, tb: TargetBatch, recipe: EagleRecipe, noise: Tensor | None = None) -> LossParts:
    """The loss of one batch (module docstring), unrolled ``recipe.steps_for(head.kind)`` steps."""
    hs = unroll(head, tb, recipe.steps_for(head.kind), noise)
    total = torch.zeros((), device=tb.p.device)
    kls, feats, accs = [], [], []
    for j, h in enumerate(hs):
        rows = tb.scored.clone()
        rows[:, :j] = False                                   # rows t < j: no step-j draft
        hr = h[rows]                                          # [N, H]
        log_q = F.log_softmax(head.compute_draft_logits(hr).float(), dim=-1)   # [N, Vd]
        kl = (tb.p_log_p[rows] - (tb.p[rows] * log_q).sum(-1)).mean()          # KL(p || q)
        step_loss = kl
        if head.kind == "eagle":
            assert tb.next_features is not None
            fl = F.smooth_l1_loss(hr.float(), tb.next_features[rows].float())
            step_loss = recipe.feature_weight * fl + recipe.token_weight * kl
            feats.append(float(fl.detach()))
        total = total + recipe.step_decay ** j * step_loss
        kls.append(float(kl.detach()))
        accs.append(float((log_q.argmax(-1) == tb.p_top[rows]).float().mean()))
    return LossParts(total, kls, feats, accs)


def _noise(tb: TargetBatch, amplitude: float, seed: int, step: int) -> Tensor | None:
    """EAGLE-1's U(-a, a) feature noise, a pure function of (seed, step) so a resumed run matches."""
    if amplitude <= 0:
        return None
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 7)
    u = torch.rand(tb.features.shape, generator=g)
    return ((2 * u - 1) * amplitude).to(tb.features.device, tb.features.dtype)


@torch.no_grad()
def heldout_metrics(head: EagleHead, target: LlamaModel, batches: list[tuple[Tensor, Tensor]], recipe: EagleRecipe,
                    autocast: bool = False) -> dict:
    """The loss and its parts (no noise), averaged over held-out ``batches`` [(ids [b, S], lengths [b])]."""
    head.eval()
    parts: list[LossParts] = []
    device = head.device
    for rows, lengths in batches:
        with _bf16(device, autocast):
            parts.append(eagle_loss(head, target_batch(target, head, rows.to(device), lengths), recipe))
    n = len(parts)
    mean = lambda xs: [sum(x) / n for x in zip(*xs)]  # noqa: E731
    return {"loss": sum(float(p.total) for p in parts) / n, "token_kl": mean([p.token_kl for p in parts]),
            "feature": mean([p.feature for p in parts]), "accuracy": mean([p.accuracy for p in parts])}


# ---------------------------------------------------------------------------- the loop

@contextlib.contextmanager
def _bf16(device: torch.device, enabled: bool):
    """bf16 autocast (float32 master weights). It hands rms_norm bf16 activations with float32
    weights, which takes the unfused path as intended: that warning is not shown."""
    with warnings.catch_warnings(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled):
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        yield


def _progress(total: int, initial: int, desc: str):
    from leapfrog.progress import progress_bar
    return progress_bar(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                disable=not sys.stderr.isatty())


def _log(msg: str) -> None:
    print(f"[leapfrog train-draft] {msg}", file=sys.stderr, flush=True)


def _fmt(xs: Sequence[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


def _step(head: EagleHead, target: LlamaModel, opt: torch.optim.Optimizer, windows: Tensor, lengths: Tensor,
          recipe: EagleRecipe, cfg: TrainConfig, step: int) -> LossParts:
    """One optimiser step on ``windows`` [B, S] (``lengths`` [B]); -> the loss parts (total detached)."""
    with _bf16(windows.device, cfg.autocast_bf16):
        tb = target_batch(target, head, windows, lengths)
        noise = _noise(tb, recipe.feature_noise if head.kind == "eagle" else 0.0, cfg.seed, step)
        parts = eagle_loss(head, tb, recipe, noise)
    if not torch.isfinite(parts.total):
        raise TrainingDiverged(f"train-draft: loss is {parts.total.item()} at step {step}; lower --lr")
    parts.total.backward()
    if cfg.grad_clip > 0:
        nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    parts.total = parts.total.detach()
    return parts


def train_head(head: EagleHead, target: LlamaModel, data: TokenData, recipe: EagleRecipe, cfg: TrainConfig,
               checkpoint_dir: Path | None = None, eval_fn: Callable[[EagleHead], dict] | None = None,
               stop_at: int | None = None, log: Callable[[str], None] = _log) -> tuple[TrainState, list[dict], float]:
    """Train ``head`` on batches of ``data`` (loop.py's schedule, optimizer and checkpoint). Resumes
    from ``checkpoint_dir`` when it holds a checkpoint. -> (state, metric history at eval points, wall
    seconds of the training steps, earlier runs of the checkpoint included)."""
    device = torch.device(cfg.device)
    head.to(device).train()
    opt = make_optimizer(head, cfg)
    state = (load_checkpoint(checkpoint_dir, head, opt) if checkpoint_dir is not None else None) or TrainState()
    meta = checkpoint_dir / META_NAME if checkpoint_dir is not None else None
    saved = json.loads(meta.read_text()) if meta is not None and meta.is_file() else {}
    history: list[dict] = saved.get("history", [])
    wall0 = saved.get("wall_time_s", 0.0)   # seconds spent by earlier runs of this checkpoint
    end = min(cfg.steps, stop_at if stop_at is not None else cfg.steps)
    every = max(1, cfg.steps // 20)
    bar = _progress(end, state.step, f"train-draft {head.kind}")
    t0 = time.perf_counter()
    while state.step < end:
        for group in opt.param_groups:
            group["lr"] = lr_at(state.step, cfg)
        windows, lengths = data.batch(state.step, cfg)               # [B, S], [B]
        parts = _step(head, target, opt, windows.to(device), lengths, recipe, cfg, state.step)
        state.step += 1
        state.tokens_seen += int(lengths.sum())
        value = float(parts.total)
        state.losses.append((state.step, value))
        bar.update(1)
        bar.set_postfix(loss=f"{value:.3f}", acc=_fmt(parts.accuracy))
        if bar.disable and (state.step % every == 0 or state.step == end):
            log(f"step {state.step}/{cfg.steps} loss {value:.3f} token KL {_fmt(parts.token_kl)} "
                f"accuracy {_fmt(parts.accuracy)} ({time.perf_counter() - t0:.0f}s)")
        if eval_fn is not None and (state.step % cfg.eval_every == 0 or state.step == cfg.steps):
            m = eval_fn(head)
            head.train()
            state.evals.append((state.step, m["loss"]))
            history.append({"step": state.step, **m})
            log(f"step {state.step}: held-out loss {m['loss']:.3f}, accuracy per draft step {_fmt(m['accuracy'])}")
        if checkpoint_dir is not None and (state.step % cfg.checkpoint_every == 0 or state.step == end):
            save_checkpoint(checkpoint_dir, head, opt, state, cfg)
            _write_meta(checkpoint_dir, history=history, wall_time_s=wall0 + time.perf_counter() - t0)
    bar.close()
    head.eval()
    return state, history, wall0 + time.perf_counter() - t0


def _write_meta(ckdir: Path, **update) -> None:
    f = ckdir / META_NAME
    d = json.loads(f.read_text()) if f.is_file() else {}
    d.update(update)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(d, indent=1, default=str))
    os.replace(tmp, f)


@torch.no_grad()
def greedy_logit_scale(head: EagleHead, target: LlamaModel, data: TokenData, recipe: EagleRecipe,
                       cfg: TrainConfig, batches: int = 2) -> tuple[float, float, float]:
    """The scale s of the draft logits that calibrates q for greedy verification (module docstring):
    argmin over s in 2^[-1, 3] (steps of 2^(1/8)) of CE(s * logits, argmax p), over ``batches``
    training batches drawn after the training ones, every unrolled step. -> (s, CE at 1, CE at s)."""
    grid = 2.0 ** (torch.arange(-8, 25) / 8)                     # [33] 0.5 .. 8, 1.0 at index 8
    ce = torch.zeros(len(grid))
    n = 0
    head.eval()
    for i in range(batches):
        windows, lengths = data.batch(cfg.steps + i, cfg)
        with _bf16(head.device, cfg.autocast_bf16):
            tb = target_batch(target, head, windows.to(head.device), lengths)
            hs = unroll(head, tb, recipe.steps_for(head.kind))
        for j, h in enumerate(hs):
            rows = tb.scored.clone()
            rows[:, :j] = False
            logits, top = head.compute_draft_logits(h[rows]).float(), tb.p_top[rows]   # [N, Vd], [N]
            for g, s in enumerate(grid.tolist()):
                ce[g] += F.cross_entropy(logits * s, top, reduction="sum").cpu()
            n += len(top)
    ce /= max(n, 1)
    best = int(ce.argmin())
    return float(grid[best]), float(ce[8]), float(ce[best])


# ---------------------------------------------------------------------------- data

def frequent_tokens(stream: Tensor, vocab_size: int, n: int) -> Tensor:
    """The ``n`` most frequent ids of ``stream`` [T] (ties and unseen ids by id), ascending -> [n]."""
    counts = torch.bincount(stream, minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices
    return order[:n].sort().values


def _doc_prompts(doc: Document, tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """Up to ``n`` prompts of ``prompt_tokens`` tokens from evenly spaced places in ``doc`` (line
    starts for text, as distill.py's generate mode)."""
    if doc.token_ids is not None:
        ids = doc.token_ids
        return [list(ids[len(ids) * j // n:][:prompt_tokens]) for j in range(n) if ids[len(ids) * j // n:]]
    out = []
    for w in line_windows(doc, n):
        ids = tokenizer(w, add_special_tokens=False)["input_ids"][:prompt_tokens]
        if ids:
            out.append(ids)
    return out


def generate_samples(target_path: str, tokenizer, docs: list[Document], data: EagleData, seed: int,
                     eos_token_id: int | None) -> TokenData:
    """The target's own continuations of prompts cut from ``docs``: one sample per prompt (prompt +
    continuation + EOS)."""
    from leapfrog import LLM, SamplingParams
    from leapfrog.model.loader import read_checkpoint
    prompts = [p for d in docs for p in _doc_prompts(d, tokenizer, data.gen_prompts_per_doc, data.gen_prompt_tokens)]
    context = read_checkpoint(target_path).args.max_position_embeddings
    llm = LLM(model=target_path, dtype="float32", seed=seed, skip_tokenizer_init=tokenizer is None,
              max_model_len=min(data.gen_prompt_tokens + data.gen_tokens + 8, context),
              max_num_seqs=data.gen_max_num_seqs)
    sp = generation_params(data.gen_temperature, len(prompts), data.gen_tokens, seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=sys.stderr.isatty())
    sep = [] if eos_token_id is None else [eos_token_id]
    ids: list[int] = []
    bounds = [0]
    for p, o in zip(prompts, outs):
        out = list(o.outputs[0].token_ids)
        ids += p + out + (sep if out[-1:] != sep else [])
        bounds.append(len(ids))
    return TokenData(torch.tensor(ids, dtype=torch.long), torch.tensor(bounds, dtype=torch.long))


def _token_data(ckpt, tokenizer, train_docs: list[Document], held: list[Document], data: EagleData,
                seed: int, cache: Path | None) -> tuple[TokenData, TokenData, float]:
    """(training, held-out) tokens and the seconds it took to make them, from ``cache`` when it was
    made with the same settings."""
    eos = tokenizer.eos_token_id if tokenizer is not None else (ckpt.eos_token_ids or (None,))[0]
    key = hashlib.sha256(json.dumps([str(ckpt.path), asdict(data), seed, fingerprint(train_docs),
                                     fingerprint(held)]).encode()).hexdigest()
    if cache is not None and cache.is_file():
        try:
            d = torch.load(cache, weights_only=True)
        except Exception:  # noqa: BLE001 - a truncated cache is rebuilt
            d = {}
        if isinstance(d, dict) and d.get("key") == key:
            return TokenData(*d["train"]), TokenData(*d["heldout"]), float(d.get("seconds", 0.0))
    t0 = time.perf_counter()
    if data.mode == "generate":
        train = generate_samples(str(ckpt.path), tokenizer, train_docs, data, seed, eos)
        heldout = generate_samples(str(ckpt.path), tokenizer, held, data, seed, eos)
    else:
        train = TokenData(pack_stream(tokenizer, train_docs, eos))
        heldout = TokenData(pack_stream(tokenizer, held, eos))
    seconds = time.perf_counter() - t0
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "train": (train.stream, train.bounds), "heldout": (heldout.stream, heldout.bounds),
                    "seconds": seconds}, cache)
    return train, heldout, seconds


# ---------------------------------------------------------------------------- evaluation

def eagle_acceptance(target: str, head: str, kind: EagleKind, prompts: list, trees=DEFAULT_TREES,
                     max_tokens: int = 64, dtype: str = "float32", skip_tokenizer_init: bool = False) -> list[dict]:
    """Greedy (temperature 0) speculation with the head over ``prompts`` (text or {"prompt_token_ids"}),
    one run per tree (num_speculative_tokens, eagle_topk, num_draft_tokens): vLLM's acceptance rate
    and mean acceptance length (accepted + bonus tokens per step), the share of steps that accepted
    a token at each depth, and the output token ids."""
    from leapfrog import LLM, SamplingParams
    out = []
    for depth, topk, budget in trees:
        spec = {"method": kind, "model": head, "num_speculative_tokens": depth, "eagle_topk": topk}
        if budget is not None:
            spec["num_draft_tokens"] = budget
        llm = LLM(model=target, dtype=dtype, max_num_seqs=1, speculative_config=spec,
                  skip_tokenizer_init=skip_tokenizer_init)
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        m = llm.get_metrics()
        out.append({"speculative_config": spec, "acceptance_rate": m["acceptance_rate"],
                    "mean_acceptance_length": m["mean_acceptance_length"], "num_drafts": m["num_drafts"],
                    "accepted_per_depth": [x / max(1, m["num_drafts"]) for x in m["num_accepted_tokens_per_pos"]],
                    "prompts": len(prompts), "max_tokens": max_tokens, "dtype": dtype,
                    "token_ids": [list(o.outputs[0].token_ids) for o in res]})
    return out


def eval_prompts(tokenizer, held: list[Document], n: int, prompt_tokens: int = 32) -> list:
    """Held-out prompts: distill.py's (text, ``prompt_tokens`` tokens at line starts) with a tokenizer,
    else token-id prompts from evenly spaced places of the held-out documents."""
    if tokenizer is not None:
        return heldout_prompts(tokenizer, held, n, prompt_tokens)
    per_doc = max(1, math.ceil(n / len(held)))
    ids = [p for d in held for p in _doc_prompts(d, None, per_doc, prompt_tokens)]
    return [{"prompt_token_ids": p} for p in ids[:n]]


# ---------------------------------------------------------------------------- the command

def _settings(kind: str, recipe: EagleRecipe, data: EagleData, cfg: TrainConfig, Vd: int) -> dict:
    """What a resumed checkpoint must have been trained with (greedy_calibration comes after training)."""
    trained = {k: v for k, v in asdict(recipe).items() if k != "greedy_calibration"}
    return {"kind": kind, "recipe": trained, "data": asdict(data), "draft_vocab_size": Vd,
            "train_config": {k: v for k, v in asdict(cfg).items() if k not in ("checkpoint_every", "eval_every")}}


def _new_head(kind: EagleKind, target: LlamaModel, recipe: EagleRecipe, stream: Tensor, seed: int,
              device: torch.device) -> EagleHead:
    """A fresh head bound to ``target``: the target's shapes (MLP width and KV heads as the recipe
    says) and, for EAGLE-3, the most frequent tokens of ``stream`` [T] as its draft vocabulary."""
    V = target.args.vocab_size
    if kind == "eagle" and recipe.draft_vocab_size not in (None, V):
        raise ConfigError("EAGLE-1 heads draft over the target's whole vocabulary (no draft_vocab_size)")
    Vd = (recipe.draft_vocab_size or default_draft_vocab_size(V)) if kind == "eagle3" else V
    if not 1 <= Vd <= V:
        raise ConfigError(f"draft_vocab_size={Vd}: must be in 1..{V} (the target's vocab_size)")
    vocab = frequent_tokens(stream, V, Vd).tolist() if kind == "eagle3" else None
    a = target.args
    args = replace(a, intermediate_size=recipe.intermediate_size or a.intermediate_size,
                   num_key_value_heads=recipe.num_key_value_heads or a.num_key_value_heads)
    head = init_eagle_head(kind, args, Vd if kind == "eagle3" else None, recipe.target_layer_ids, seed=seed,
                           draft_token_ids=vocab, device=device)
    head.bind_target(target)
    if kind == "eagle3" and recipe.init_from_target:
        _warm_start(head, target)
    return head


def _check_init_head(path: str | os.PathLike, kind: EagleKind, target_args, recipe: EagleRecipe) -> None:
    """Refuse a head to tune that is of the other kind or does not fit the target, and recipe
    shape fields (the head has its shape), before any data is made."""
    from leapfrog.model.eagle import read_head_config
    fixed = {"draft_vocab_size": recipe.draft_vocab_size, "intermediate_size": recipe.intermediate_size,
             "num_key_value_heads": recipe.num_key_value_heads, "target_layer_ids": recipe.target_layer_ids}
    if given := [k for k, v in fixed.items() if v is not None]:
        raise ConfigError(f"{', '.join(given)}: a fine-tuned head keeps the shape of init_head {path}; leave them unset")
    have = read_head_config(path, target_args).kind
    if have != kind:
        raise ConfigError(f"init_head {path} is an {have} head; this run trains {kind}")


def _head_to_tune(path: str | os.PathLike, target: LlamaModel, device: torch.device) -> EagleHead:
    """A saved head to fine-tune (``_check_init_head`` passed), in float32 and trainable, its logits
    as KL training left them (a greedy calibration folded into lm_head is divided out; training
    fits a new one)."""
    from leapfrog.model.eagle import load_eagle_head
    head = load_eagle_head(path, target, dtype=torch.float32, device=device)
    head.requires_grad_(True)
    if head.embed is not None:   # a head shipping its own embedding keeps it, frozen like the target's
        head.embed.requires_grad_(False)
    scale = head.cfg.greedy_logit_scale
    if scale != 1.0:
        assert head.lm_head is not None
        with torch.no_grad():
            head.lm_head.weight.div_(scale)
        head.cfg = dataclasses.replace(head.cfg, greedy_logit_scale=1.0)
    return head


@torch.no_grad()
def _warm_start(head: EagleHead, target: LlamaModel) -> None:
    """EAGLE-3 head in the target's output space from step 0: lm_head = the target's LM head rows
    of the draft vocabulary, norm = the target's final norm, and (same widths) fc picking the
    highest aux layer, so that h starts as the target's own top residual state and training
    learns one step further (p_{t+1} instead of p_t) rather than an output space from scratch."""
    assert head.lm_head is not None and head.norm is not None
    w = target.embed.weight if target.lm_head is None else target.lm_head.weight        # [V, Ht]
    if head.args.hidden_size != target.args.hidden_size:
        return
    head.lm_head.weight.copy_(w[head.draft_ids.to(w.device)].to(head.lm_head.weight.dtype))
    head.norm.copy_(target.norm.to(head.norm.dtype))
    H = head.args.hidden_size
    head.fc.weight.zero_()
    head.fc.weight[:, -H:] = torch.eye(H, dtype=head.fc.weight.dtype, device=head.fc.weight.device)


def _start_meta(ckdir: Path, settings: dict) -> None:
    """A resumed checkpoint must have been made with the same settings; a fresh run starts its history."""
    meta = ckdir / META_NAME
    fresh = not (ckdir / CHECKPOINT_NAME).is_file()
    if not fresh and meta.is_file():
        saved = json.loads(meta.read_text()).get("settings")
        diff = settings_diff(saved, settings) if saved is not None else []
        if diff:
            raise ConfigError(f"{ckdir}: the checkpoint was made with other settings (they differ in {diff}: "
                              f"{ {k: saved.get(k) for k in diff} }); resume it with those, or start again in "
                              "another checkpoint directory")
    ckdir.mkdir(parents=True, exist_ok=True)
    _write_meta(ckdir, settings=settings, **({"history": [], "wall_time_s": 0.0} if fresh else {}))


def train_eagle(target: str | os.PathLike, corpus: str | os.PathLike | list[Document], out: str | os.PathLike,
                kind: EagleKind = "eagle3", *, recipe: EagleRecipe | None = None,
                train_config: TrainConfig | None = None, data: EagleData | None = None,
                evaluation: EagleEval | None = None, save_dtype: str = "float32", bf16: str = "auto",
                checkpoint_dir: str | os.PathLike | None = None, resume: bool = False,
                stop_at: int | None = None, init_head: str | os.PathLike | None = None,
                log: Callable[[str], None] = _log) -> EagleResult:
    """Train an EAGLE-1 (``kind="eagle"``) or EAGLE-3 head for ``target`` (an HF checkpoint directory
    or hub id) and save it at ``out`` (config.json + model.safetensors, the release layout), which
    ``speculative_config={"method": kind, "model": out, ...}`` loads.

    ``corpus``: a path (read_documents: text, JSONL with "text"/"prompt"/"messages"/"token_ids") or
    documents; token-id documents need no tokenizer. A checkpoint is kept in ``checkpoint_dir``
    (default OUT.ckpt); an existing one is continued only with ``resume`` (else an error).
    ``init_head``: fine-tune this head (a directory or hub id of the ``kind`` asked for, loaded as
    inference loads it, its greedy calibration undone) instead of starting a new one; its shapes and
    draft vocabulary are kept, so the recipe's shape fields must be left unset."""
    from leapfrog.config import resolve_device
    from leapfrog.model.loader import load_model

    if kind not in ("eagle", "eagle3"):
        raise ConfigError(f"kind must be 'eagle' or 'eagle3', got {kind!r}")
    recipe, data, evaluation = recipe or EagleRecipe(), data or EagleData(), evaluation or EagleEval()
    cfg = copy.copy(train_config or TrainConfig())
    if data.mode not in ("corpus", "generate"):
        raise ConfigError(f"data mode must be 'corpus' or 'generate', got {data.mode!r}")
    if save_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"save_dtype must be float32 or bfloat16, got {save_dtype!r}")
    if recipe.steps_for(kind) < 1:
        raise ConfigError(f"ttt_steps must be >= 1, got {recipe.ttt_steps}")
    if recipe.steps_for(kind) > MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"ttt_steps={recipe.ttt_steps}: at most {MAX_SPECULATIVE_TOKENS}, the deepest a head "
                          "drafts (num_speculative_tokens)")
    if recipe.steps_for(kind) >= cfg.seq_len:   # (a loss of nan, blamed on the learning rate)
        raise ConfigError(f"ttt_steps={recipe.steps_for(kind)} must be below seq_len={cfg.seq_len} (unrolled step "
                          "j learns from positions j and later of each window)")
    out = Path(out)
    device = resolve_device(cfg.device)
    cfg.device = str(device)
    cfg.autocast_bf16 = resolve_autocast(bf16, device)
    ckdir = Path(checkpoint_dir) if checkpoint_dir is not None else out.with_name(out.name + ".ckpt")
    if (ckdir / CHECKPOINT_NAME).is_file() and not resume:
        raise ConfigError(f"{ckdir} holds a training checkpoint: pass resume=True (--resume) to continue it, or "
                          "remove it (or pass another checkpoint directory) to start again")
    # Fail in the first second, not after training: the target, the head to tune, then the corpus.
    ckpt, tokenizer = check_target(target, require_tokenizer=False)
    if init_head is not None:
        _check_init_head(init_head, kind, ckpt.args, recipe)
    if data.mode == "generate":
        generation_temperatures(data.gen_temperature)
    docs = read_documents(corpus) if not isinstance(corpus, list) else corpus
    train_docs, held = split_by_file(docs, data.heldout_fraction, data.split_seed)
    held = heldout_or_training(train_docs, held)
    if tokenizer is None and any(d.token_ids is None for d in docs):
        raise ConfigError(f"{ckpt.path} has no tokenizer, so the corpus must be token ids: JSONL lines "
                          "{\"token_ids\": [...]} (or put the target's tokenizer files beside it)")
    V = ckpt.args.vocab_size
    t_start = time.perf_counter()
    train_data, held_data, data_time = _token_data(ckpt, tokenizer, train_docs, held, data, cfg.seed,
                                                   ckdir / DATA_NAME)
    stream = train_data.stream
    if int(stream.max()) >= V or int(held_data.stream.max()) >= V:
        raise ConfigError(f"the corpus has token ids >= the target's vocab_size {V}")
    if data.mode == "corpus" and stream.numel() <= cfg.seq_len:
        raise ConfigError(f"the corpus gives {stream.numel()} training tokens; need more than "
                          f"seq_len={cfg.seq_len} (pass more text or a smaller --seq-len)")
    log(f"data ({data.mode}): {stream.numel():,} training tokens, {held_data.stream.numel():,} held-out "
        f"({time.perf_counter() - t_start:.0f}s)")

    tdtype = torch.bfloat16 if cfg.autocast_bf16 else torch.float32
    target_model = load_model(ckpt, tdtype, device, max(cfg.seq_len, 2))
    if init_head is None:
        head = _new_head(kind, target_model, recipe, stream, cfg.seed, device)
    else:
        head = _head_to_tune(init_head, target_model, device)
    Vd = head.cfg.draft_vocab_size
    coverage = float(head.t2d[stream].float().mean()) if kind == "eagle3" else 1.0
    settings = {**_settings(kind, recipe, data, cfg, Vd), "corpus": fingerprint(train_docs + held),
                **({} if init_head is None else {"init_head": head_fingerprint(init_head)})}
    _start_meta(ckdir, settings)

    val = held_data.heldout(16 if data.mode == "generate" else 8, cfg.seq_len)
    evaluate = lambda h: heldout_metrics(h, target_model, val, recipe, cfg.autocast_bf16)  # noqa: E731
    before = evaluate(head)
    state, history, wall = train_head(head, target_model, train_data, recipe, cfg, ckdir, evaluate, stop_at, log)
    after = history[-1] if history and history[-1]["step"] == state.step else {"step": state.step, **evaluate(head)}
    after = {k: v for k, v in after.items() if k != "step"}

    calibration = None
    if kind == "eagle3" and recipe.greedy_calibration:
        scale, ce1, ce = greedy_logit_scale(head, target_model, train_data, recipe, cfg)
        with torch.no_grad():
            head.lm_head.weight.mul_(scale)  # type: ignore[union-attr]
        head.cfg = dataclasses.replace(head.cfg, greedy_logit_scale=head.cfg.greedy_logit_scale * scale)
        calibration = {"scale": scale, "ce_before": ce1, "ce_after": ce}
        log(f"greedy calibration: draft logits x {scale:.3g} (CE to argmax p {ce1:.3f} -> {ce:.3f})")
    check_finite(head, "train-draft")
    out.mkdir(parents=True, exist_ok=True)
    save_eagle_head(head if save_dtype == "float32" else copy.deepcopy(head).to(torch.bfloat16), out)
    what = (f"{recipe.feature_weight} SmoothL1(h, f) + {recipe.token_weight} KL(p || q)" if kind == "eagle"
            else f"sum_j {recipe.step_decay}^j KL(p || q_j), {recipe.steps_for(kind)} steps")
    plot_losses(state, out / "training_loss.png", f"train-draft --method {kind}: {what}", eval_label="held-out")
    result = EagleResult(path=out, kind=kind, head_parameters=head.num_parameters(),
                         target_parameters=target_model.num_parameters(), draft_vocab_size=Vd,
                         draft_vocab_coverage=coverage, train_tokens=state.tokens_seen, state=state,
                         heldout_before=before, heldout_after=after, wall_time_s=wall, data_time_s=data_time,
                         calibration=calibration, history=history)
    if evaluation.prompts > 0 and state.step == cfg.steps:
        prompts = eval_prompts(tokenizer, held, evaluation.prompts)
        result.acceptance = eagle_acceptance(str(ckpt.path), str(out), kind, prompts, evaluation.trees,
                                             evaluation.max_tokens, evaluation.dtype, tokenizer is None)
        for a in result.acceptance:
            a.pop("token_ids")
    (out / "train_eagle.json").write_text(json.dumps(
        {**result.summary(), "settings": settings, "target": str(target), "heldout_files": [d.name for d in held],
         "loss_history": state.losses, "eval_history": history}, indent=1, default=str))
    return result
