"""KV rows: rollback (length arithmetic) then re-forward equals a fresh forward."""

from __future__ import annotations

import torch

from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.runner import ModelRunner, SeqChunk


def test_rollback_then_reforward_equals_fresh(llama_dir):
    model = load_model(read_checkpoint(llama_dir), torch.float32, torch.device("cpu"), 128)
    tokens = list(range(3, 40))
    fresh = ModelRunner(model, 2, 128)
    ref = fresh.run([SeqChunk(1, 0, tokens, len(tokens))])
    r = ModelRunner(model, 2, 128)
    r.run([SeqChunk(1, 0, tokens[:20], 0)])
    r.run([SeqChunk(1, 20, [99, 98, 97, 96, 95], 5)])     # drafts, all rejected
    r.run([SeqChunk(1, 20, tokens[20:22] + [7, 7], 4)])   # 2 accepted, 2 rejected
    got = r.run([SeqChunk(1, 22, tokens[22:], len(tokens) - 22)])  # rolled back to 22, re-forward
    torch.testing.assert_close(got, ref[22:], rtol=1e-5, atol=1e-5)
    for layer in range(model.args.num_hidden_layers):
        torch.testing.assert_close(r.kv.k[layer][1, :, :len(tokens)], fresh.kv.k[layer][1, :, :len(tokens)],
                                   rtol=1e-5, atol=1e-5)


def test_ragged_batch_equals_single_rows(llama_dir):
    """Sequences of different lengths in one forward, no realignment: equal to one at a time."""
    model = load_model(read_checkpoint(llama_dir), torch.float32, torch.device("cpu"), 128)
    seqs = [list(range(5, 5 + n)) for n in (3, 11, 7)]
    single = []
    for s in seqs:
        single.append(ModelRunner(model, 4, 128).run([SeqChunk(0, 0, s, len(s))]))
    batch = ModelRunner(model, 4, 128)
    out = batch.run([SeqChunk(row, 0, s, len(s)) for row, s in zip((3, 0, 2), seqs)])
    torch.testing.assert_close(out, torch.cat(single), rtol=1e-5, atol=1e-5)
    nxt = batch.run([SeqChunk(row, len(s), [9, 10][: 1 + i % 2], 1 + i % 2)
                     for i, (row, s) in enumerate(zip((3, 0, 2), seqs))])
    assert nxt.shape[0] == 1 + 2 + 1
