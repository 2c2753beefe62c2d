"""Rotary position embeddings, applied at arbitrary absolute positions.

The cos/sin table is computed once in float32 for ``max_positions`` positions, like
Hugging Face does, and rows are gathered by position, so speculation, rollback and
tree nodes (depth-based positions) need nothing special.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from leapfrog.model.args import RopeConfig
from leapfrog.model.native_ops import usable


def inv_frequencies(cfg: RopeConfig, head_dim: int, max_position_embeddings: int) -> Tensor:
    """[head_dim/2] inverse frequencies for every supported ``rope_type``."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = cfg.theta
    if cfg.rope_type == "dynamic":
        # Dynamic NTK with a fixed scaled base for the whole scaled context (vLLM's choice):
        # one frequency set for every position, so cached keys stay consistent.
        # max_len = max_position_embeddings * factor, so factor * max_len / mpe = factor**2.
        base = cfg.theta * (cfg.factor * cfg.factor - (cfg.factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** exponent)
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / cfg.factor
    elif cfg.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, cfg, max_position_embeddings)
    return inv_freq


def _llama3_scale(inv_freq: Tensor, cfg: RopeConfig, max_pos: int) -> Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths / factor, short kept, smooth between."""
    old_len = cfg.original_max_position_embeddings or max_pos
    low_wavelen = old_len / cfg.low_freq_factor
    high_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(cfg: RopeConfig, head_dim: int, max_position_embeddings: int,
               max_positions: int) -> tuple[Tensor, Tensor]:
    """cos, sin tables, each [max_positions, head_dim] float32 (halves duplicated, HF layout): the
    float32 angles as Hugging Face computes them, their cos and sin in float64 rounded to float32.

    Not ``emb.cos()`` in float32: PyTorch's float32 cos and sin (MKL's vector math on this build)
    gave tables one ulp apart in some entries in some processes (a model loaded while other threads
    worked: stop 80, one engine of two in about one process in five), and a bf16 rounding of the
    table that fell the other way changed keys and, on near-ties, greedy output between two engines
    of the same model. In float64 such differences are ~1e-16, far below float32's rounding, so
    the tables are the same bits in every process (and within one float32 ulp of Hugging Face's)."""
    inv_freq = inv_frequencies(cfg, head_dim, max_position_embeddings)
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).double()  # [P, D] (the float32 angles, exactly)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, native: bool = False) -> Tensor:
    """x: [B, S, H, D]; cos/sin: [B, S, 1, D] in x's dtype -> rotated x (rotate-half convention).
    ``native``: one C++ op where it can (a model packed for inference on CPU)."""
    B, S, _, D = x.shape
    if (usable(native, x, cos, sin) and x.stride(-1) == 1 and cos.shape == sin.shape == (B, S, 1, D)
            and cos.dtype == sin.dtype == x.dtype):   # (the op's contract; broadcast tables take ATen)
        return torch.ops.leapfrog_ops.rope(x, cos, sin)   # (the same bits in one op: model/native_ops.py)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
