"""Eager forwards call the compiled graphs' C++ attention op (model/runner.py _native_attention)
for decode, verify and tree chunks on CPU: the same logits as ATen's SDPA path to float rounding,
long prefill chunks keep SDPA, and LEAPFROG_NATIVE_ATTENTION=0 or batch-invariant mode turn it off."""

from __future__ import annotations

import pytest
import torch

from leapfrog.attention.native import load_native_attention
from leapfrog.model.compiled import can_compile
from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.runner import NATIVE_EAGER_TOKENS, ModelRunner, SeqChunk
from tests.conftest import CONFIGS

pytestmark = pytest.mark.skipif(can_compile(torch.device("cpu")) is not None, reason="no C++ compiler")


def _runner(path, monkeypatch, native: bool, invariant: bool = False) -> ModelRunner:
    monkeypatch.setenv("LEAPFROG_NATIVE_ATTENTION", "1" if native else "0")
    model = load_model(read_checkpoint(path), torch.float32, torch.device("cpu"), 256, pack=True)
    return ModelRunner(model, num_rows=3, max_model_len=256, batch_invariant=invariant)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_decode_and_verify_chunks_take_the_native_op(llama_dir, monkeypatch):
    assert load_native_attention()
    r = _runner(llama_dir, monkeypatch, native=True)
    for s, native in ((1, True), (5, True), (NATIVE_EAGER_TOKENS, True), (NATIVE_EAGER_TOKENS + 1, False)):
        _, _, meta = r._inputs([SeqChunk(0, 0, _tokens(s, s), 1)], s, s, graph=False)
        assert meta.native is native and (meta.graph_kv_len is not None) is native, s
    for off in (_runner(llama_dir, monkeypatch, native=False), _runner(llama_dir, monkeypatch, True, invariant=True)):
        _, _, meta = off._inputs([SeqChunk(0, 0, [5], 1)], 1, 1, graph=False)
        assert not meta.native and meta.graph_kv_len is None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_eager_steps_match_sdpa(model_dirs, monkeypatch, name):
    """Prefill (SDPA either way), then a 5-token verify chunk beside a one-token decode in
    another row, then decodes: the native op's logits equal SDPA's to float rounding."""
    runners = [_runner(model_dirs[name], monkeypatch, native=n) for n in (True, False)]
    prompt, other = _tokens(40, 0), _tokens(12, 1)
    steps = [[SeqChunk(0, 0, prompt, 1), SeqChunk(1, 0, other, 1)],
             [SeqChunk(0, 40, _tokens(5, 2), 5), SeqChunk(1, 12, [7], 1)],
             [SeqChunk(0, 45, [9], 1), SeqChunk(1, 13, _tokens(3, 3), 3)]]
    for chunks in steps:
        got, want = (r.run(chunks) for r in runners)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
