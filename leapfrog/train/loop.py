"""One training loop for the target's pre-training and the draft's distillation.

Batches are windows of a token stream at offsets drawn from a generator seeded by
(seed, step), so a run resumed from a checkpoint sees exactly the batches an uninterrupted
run would have. A checkpoint holds the model, the optimizer, the step and the loss history.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from leapfrog.errors import CheckpointError, ConfigError, LeapfrogError

CHECKPOINT_NAME = "train_state.pt"


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1       # cosine decay to lr * min_lr_ratio at the last step
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    eval_every: int = 50
    autocast_bf16: bool = False     # bf16 autocast (CPU or CUDA); fp32 master weights
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ConfigError("lr must be > 0 and warmup_steps >= 0")
        # (batches and noise are drawn from seed x 1_000_003 + step: a torch seed below 2**64)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**32 <= self.seed < 2**32:
            raise ConfigError(f"seed={self.seed!r}: must be an integer in [-2**32, 2**32)")


@dataclass
class TrainState:
    step: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)   # (step, training loss)
    evals: list[tuple[int, float]] = field(default_factory=list)    # (step, held-out metric)
    tokens_seen: int = 0


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def batch_at(stream: Tensor, step: int, cfg: TrainConfig) -> Tensor:
    """[batch_size, seq_len] windows of ``stream`` ([T]) for this step (a pure function of it)."""
    if stream.numel() < cfg.seq_len + 1:
        raise ConfigError(f"the corpus has {stream.numel()} tokens; need more than seq_len={cfg.seq_len}")
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - cfg.seq_len + 1, (cfg.batch_size,), generator=g)
    return torch.stack([stream[s:s + cfg.seq_len] for s in starts.tolist()])


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, state: TrainState,
                    cfg: TrainConfig) -> None:
    """Save the training state (atomically). Non-finite weights are never saved (TrainingDiverged):
    a resume would go on from them, and a run that stops on them says nothing was saved; the
    last finite checkpoint, if any, stays."""
    bad = _non_finite(model)
    if bad is not None:
        kept = (f"the checkpoint in {path} from before is kept (remove it to start again with other settings)"
                if (path / CHECKPOINT_NAME).is_file() else "no training checkpoint was saved")
        raise TrainingDiverged(f"training stopped: weight {bad} is not finite at step {state.step}; {kept} (lower --lr)")
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (CHECKPOINT_NAME + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": asdict(state),
                "config": asdict(cfg)}, tmp)
    os.replace(tmp, path / CHECKPOINT_NAME)


class TrainingDiverged(LeapfrogError, FloatingPointError):
    """The loss (or the weights) stopped being finite: nothing is saved as a draft."""


def _non_finite(model: nn.Module) -> str | None:
    """The first parameter holding a NaN or an infinity, by name (None: all finite)."""
    return next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None)


def check_finite(model: nn.Module, desc: str) -> None:
    """Refuse to save weights a diverged run left non-finite (the engine would load them)."""
    if (bad := _non_finite(model)) is not None:
        raise TrainingDiverged(f"{desc}: weight {bad} is not finite after training; nothing saved (lower --lr)")


def settings_diff(saved: dict, settings: dict) -> list[str]:
    """The keys whose values differ between the settings a checkpoint recorded and this run's,
    compared as JSON reads them back (tuples and lists alike); [] when a resume may go on."""
    now = json.loads(json.dumps(settings))
    return sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> TrainState | None:
    f = path / CHECKPOINT_NAME
    if not f.is_file():
        return None
    try:
        ck = torch.load(f, map_location="cpu", weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        s = ck["state"]
        return TrainState(step=s["step"], losses=[tuple(x) for x in s["losses"]],
                          evals=[tuple(x) for x in s["evals"]], tokens_seen=s["tokens_seen"])
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file, another model's shapes
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{f}: cannot resume from this training checkpoint ({type(e).__name__}: "
                              f"{first[:300]}); remove it (or pass another --checkpoint-dir) to start "
                              "again") from None


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train(model: nn.Module, stream: Tensor, loss_fn: Callable[[nn.Module, Tensor], Tensor],
          cfg: TrainConfig, checkpoint_dir: str | os.PathLike | None = None,
          eval_fn: Callable[[nn.Module], float] | None = None, desc: str = "train",
          stop_at: int | None = None) -> TrainState:
    """Train ``model`` on windows of ``stream`` ([T] token ids) minimizing ``loss_fn(model, batch)``.

    Resumes from ``checkpoint_dir`` when it holds a checkpoint; saves one every
    ``checkpoint_every`` steps and at the end. ``stop_at`` ends early (a step < cfg.steps)
    without changing the schedule, which is how a long run is split across sessions.
    """
    from leapfrog.progress import progress_bar

    device = torch.device(cfg.device)
    model.to(device).train()
    opt = make_optimizer(model, cfg)
    ckdir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    state = (load_checkpoint(ckdir, model, opt) if ckdir is not None else None) or TrainState()
    end = min(cfg.steps, stop_at if stop_at is not None else cfg.steps)
    bar = progress_bar(total=end, initial=state.step, desc=desc, unit="step", dynamic_ncols=True)
    while state.step < end:
        for group in opt.param_groups:
            group["lr"] = lr_at(state.step, cfg)
        batch = batch_at(stream, state.step, cfg).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            loss = loss_fn(model, batch)
        if not torch.isfinite(loss):
            raise TrainingDiverged(f"{desc}: loss is {loss.item()} at step {state.step}; lower --lr")
        loss.backward()
        if cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += batch.numel()
        state.losses.append((state.step, float(loss.item())))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if eval_fn is not None and (state.step % cfg.eval_every == 0 or state.step == cfg.steps):
            model.eval()
            with torch.no_grad():
                state.evals.append((state.step, float(eval_fn(model))))
            model.train()
        if ckdir is not None and (state.step % cfg.checkpoint_every == 0 or state.step == end):
            save_checkpoint(ckdir, model, opt, state, cfg)
    bar.close()
    model.eval()
    return state


def plot_losses(state: TrainState, path: str | os.PathLike, title: str, eval_label: str = "held-out") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if state.losses:
        steps, losses = zip(*state.losses)
        ax.plot(steps, losses, lw=0.8, alpha=0.6, label="train")
    if state.evals:
        s, v = zip(*state.evals)
        ax.plot(s, v, "o-", label=eval_label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
