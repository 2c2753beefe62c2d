"""Eager prefill runs the last decoder layer's output projection and MLP for the tokens whose
logits are read only (LlamaModel.forward ``keep_rows``, model/runner.py): the same logits, and the
same cache, as the whole forward."""

from __future__ import annotations

import pytest
import torch

from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.native_linear import native_linear_supported
from leapfrog.model.runner import ModelRunner, SeqChunk
from tests.conftest import CONFIGS


def _runner(path, dtype=torch.float32, invariant: bool = False) -> ModelRunner:
    model = load_model(read_checkpoint(path), dtype, torch.device("cpu"), 256, pack=True)
    return ModelRunner(model, num_rows=3, max_model_len=256, batch_invariant=invariant)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# two prompts in one step (padded), then a prompt in two chunks (the first reads no logits),
# then decodes and a verify chunk that read the cache the pruned layers wrote
STEPS = [[SeqChunk(0, 0, _tokens(40, 0), 1), SeqChunk(1, 0, _tokens(13, 1), 1)],
         [SeqChunk(2, 0, _tokens(30, 2), 0)],
         [SeqChunk(2, 30, _tokens(9, 3), 1), SeqChunk(0, 40, [7], 1)],
         [SeqChunk(1, 13, _tokens(5, 4), 5), SeqChunk(2, 39, [11], 1), SeqChunk(0, 41, [9], 1)]]


def _run(r: ModelRunner, keep: bool) -> list[torch.Tensor]:
    r.model.keeps_rows = keep
    return [r.run(chunks) for chunks in STEPS]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pruned_prefill_gives_the_whole_forwards_logits(model_dirs, name):
    """Float32 (oneDNN or the bf16-weight kernel): equal to float rounding, the same argmax,
    and the decodes after it read the same cache."""
    got, want = _run(_runner(model_dirs[name]), True), _run(_runner(model_dirs[name]), False)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


@pytest.mark.skipif(not native_linear_supported(torch.bfloat16, "cpu"), reason="no bf16 linear kernel on this CPU")
@pytest.mark.parametrize("invariant", [False, True])
def test_pruned_prefill_is_bitwise_with_row_invariant_linears(llama_dir, invariant):
    """bf16 weights through the row-invariant kernel (and batch-invariant mode): bitwise."""
    got = _run(_runner(llama_dir, torch.bfloat16, invariant), True)
    want = _run(_runner(llama_dir, torch.bfloat16, invariant), False)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_last_layer_mlp_sees_only_the_logits_rows(llama_dir):
    r = _runner(llama_dir)
    seen: list[int] = []
    hook = r.model.layers[-1].w13.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[:-1].numel()))
    first = r.model.layers[0].w13.register_forward_hook(lambda m, i, o: seen.append(-i[0].shape[:-1].numel()))
    try:
        r.run(STEPS[0])                         # 2 prompts, padded to 2 x 40: 2 rows read
        r.run(STEPS[1])                         # no logits: the last layer's MLP does not run
        r.model.keeps_rows = False
        r.run([SeqChunk(1, 13, _tokens(4, 5), 1)])
    finally:
        hook.remove()
        first.remove()
    assert seen == [-80, 2, -30, -4, 4]


def test_keep_rows_refuses_aux_layers(llama_dir):
    m = _runner(llama_dir).model
    with pytest.raises(ValueError, match="aux_layers"):
        m(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), aux_layers=(0,), keep_rows=torch.tensor([1]))
