"""The RoPE tables (model/rope.py rope_table): the cos and sin of Hugging Face's float32 angles,
correctly rounded to float32 (computed in float64), so that no vector-math path's last-ulp choice
enters them: float32 ``emb.cos()`` went through MKL's vector math, whose results differed by an ulp
between processes (stop 80), and with them keys and near-tie greedy output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leapfrog.model.args import RopeConfig
from leapfrog.model.rope import inv_frequencies, rope_table


@pytest.mark.parametrize("cfg", [RopeConfig(), RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0,
                                                          original_max_position_embeddings=1024)])
def test_tables_are_the_correctly_rounded_cos_and_sin_of_the_float32_angles(cfg):
    cos, sin = rope_table(cfg, 64, 2048, 2048)
    inv = inv_frequencies(cfg, 64, 2048)
    f = torch.outer(torch.arange(2048, dtype=torch.float32), inv)
    angles = torch.cat((f, f), dim=-1).numpy().astype(np.float64)   # [P, D], HF's float32 angles
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (2048, 64)
    assert torch.equal(cos, torch.from_numpy(np.cos(angles).astype(np.float32)))
    assert torch.equal(sin, torch.from_numpy(np.sin(angles).astype(np.float32)))
    # (and within one float32 ulp of Hugging Face's float32 table)
    emb = torch.from_numpy(angles.astype(np.float32))
    torch.testing.assert_close(cos, emb.cos(), atol=1.2e-7, rtol=0)


def test_tables_do_not_depend_on_the_thread_count():
    cfg = RopeConfig()
    saved = torch.get_num_threads()
    try:
        tables = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            tables.append(rope_table(cfg, 128, 4096, 4096))
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for t in tables[1:] for a, b in zip(t, tables[0]))
