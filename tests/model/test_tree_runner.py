"""Tree forwards (model/runner.py): every node of a draft tree gets the logits its root-to-node
path gets as a plain chain, in one forward with other sequences; and after moving the accepted
path's columns together (KVCache.move_cols) the cache continues exactly like the chain's."""

from __future__ import annotations

import pytest
import torch

from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.runner import ModelRunner, SeqChunk
from leapfrog.spec_decode.draft import path_to
from tests.conftest import CONFIGS

F32 = torch.float32
#        r   a   b   c   d   e   f
PARENTS = [-1, 0, 0, 1, 1, 3, 2]   # r root; a, b children of r; c, d of a; e of c; f of b


def _runner(path, invariant=False, **kw) -> ModelRunner:
    model = load_model(read_checkpoint(path), kw.pop("dtype", F32), torch.device("cpu"), 256, pack=True)
    return ModelRunner(model, num_rows=4, max_model_len=256, batch_invariant=invariant)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("invariant", [False, True])
def test_tree_nodes_match_their_paths_as_chains(model_dirs, name, invariant):
    r = _runner(model_dirs[name], invariant)
    prompt, other = _tokens(30, 0), _tokens(11, 1)
    tree = _tokens(len(PARENTS), 2)
    r.run([SeqChunk(0, 0, prompt, 0), SeqChunk(1, 0, other, 0)])
    c = len(prompt)
    got = r.run([SeqChunk(1, len(other), _tokens(3, 5), 3),
                 SeqChunk(0, c, tree, len(tree), parents=PARENTS)])[3:]  # [7, V]
    for i in range(len(PARENTS)):
        path = [tree[j] for j in path_to(PARENTS, i)]
        want = r.run([SeqChunk(2, 0, prompt + path, 1)])[0]  # row 2: the chain, prompt recomputed
        assert torch.allclose(got[i], want, atol=1e-4, rtol=1e-4), (i, (got[i] - want).abs().max())


def test_sliding_window_applies_by_position(tmp_path, tokenizer):
    from leapfrog.demo import save_random_llama
    from tests.conftest import BASE
    d = save_random_llama(tmp_path, tokenizer, arch="mistral", seed=4, **{**BASE, "sliding_window": 8})
    r = _runner(d)
    prompt, tree = _tokens(20, 3), _tokens(len(PARENTS), 4)
    r.run([SeqChunk(0, 0, prompt, 0)])
    got = r.run([SeqChunk(0, len(prompt), tree, len(tree), parents=PARENTS)])
    for i in range(len(PARENTS)):
        path = [tree[j] for j in path_to(PARENTS, i)]
        want = r.run([SeqChunk(1, 0, prompt + path, 1)])[0]
        assert torch.allclose(got[i], want, atol=1e-4, rtol=1e-4), i


def test_accepted_path_moved_together_continues_like_the_chain(llama_dir):
    r = _runner(llama_dir)
    prompt, tree, nxt = _tokens(25, 6), _tokens(len(PARENTS), 7), _tokens(2, 8)
    r.run([SeqChunk(0, 0, prompt, 0)])
    c = len(prompt)
    r.run([SeqChunk(0, c, tree, 0, parents=PARENTS)])
    path = path_to(PARENTS, 5)                       # r -> a -> c -> e: tree columns 0, 1, 3, 5
    r.kv.move_cols(0, [c + j for j in path], [c + i for i in range(len(path))])
    n = c + len(path)                                # committed length
    got = r.run([SeqChunk(0, n, nxt, 2)])
    want = r.run([SeqChunk(1, 0, prompt + [tree[j] for j in path] + nxt, 2)])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # and the hidden states the runner hands to EAGLE heads are per real token, in order
    out = r.step([SeqChunk(2, 0, prompt[:5], 1), SeqChunk(3, 0, prompt[:3], 1)], hidden="hidden")
    assert out.hidden.shape == (8, r.model.args.hidden_size)
    aux = r.step([SeqChunk(2, 0, prompt[:5], 1)], hidden=(0, 1)).hidden
    assert aux.shape == (5, 2 * r.model.args.hidden_size)


def test_tree_grown_level_by_level_matches_one_forward(llama_dir):
    """An EAGLE head grows its tree over several forwards (context + extra_cols + first_pos):
    each node's logits equal those of the same tree computed in one forward."""
    r = _runner(llama_dir)
    prompt, tree = _tokens(25, 9), _tokens(len(PARENTS), 10)
    r.run([SeqChunk(0, 0, prompt, 0), SeqChunk(1, 0, prompt, 0)])
    c = len(prompt)
    whole = r.run([SeqChunk(0, c, tree, len(tree), parents=PARENTS)])
    levels = [[0], [1, 2], [3, 4, 6], [5]]               # nodes by depth
    col_of: dict[int, int] = {}
    nxt = c
    got = {}
    for lv in levels:
        extra = []
        for i in lv:
            anc, j = [], PARENTS[i]
            while j >= 0:
                anc.append(col_of[j])
                j = PARENTS[j]
            extra.append(anc)
        depth_pos = [c + len(e) for e in extra]
        out = r.run([SeqChunk(1, nxt, [tree[i] for i in lv], len(lv), context=c, extra_cols=extra,
                              first_pos=depth_pos)])
        for k, i in enumerate(lv):
            col_of[i] = nxt + k
            got[i] = out[k]
        nxt += len(lv)
    for i in range(len(PARENTS)):
        assert torch.allclose(got[i], whole[i], atol=1e-4, rtol=1e-4), i
