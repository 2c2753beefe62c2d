"""EAGLE-1 and EAGLE-3 heads: checkpoints written in the release layouts (raw safetensors + a hand-written
config.json, as a downloaded head), checked against references built from transformers' Llama modules and
the vLLM/EAGLE formulas, on a tiny random 8-layer target."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama import modeling_llama as hf

from leapfrog.attention.metadata import build_attn_meta
from leapfrog.demo import save_random_llama
from leapfrog.errors import CheckpointError, ConfigError
from leapfrog.kv.cache import KVCache
from leapfrog.model.eagle import (
    aux_layers_from_vllm,
    aux_layers_to_vllm,
    default_eagle3_layers,
    init_eagle_head,
    load_eagle_head,
    save_eagle_head,
)
from leapfrog.model.loader import load_model, read_checkpoint

V, HT, L = 128, 32, 8          # target vocabulary, hidden size, layers
VLLM_IDS = [2, 4, 6]           # an EAGLE-3 head's eagle_aux_hidden_state_layer_ids (hidden_states[id])
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("target"), None, seed=3, vocab_size=V, hidden_size=HT,
                             intermediate_size=64, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(read_checkpoint(target_dir), torch.float32, CPU, 256)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------- release-layout writers

def _rand(gen, *shape, scale=0.15):
    return torch.randn(*shape, generator=gen) * scale


def _norm(gen, n):
    return 1 + _rand(gen, n, scale=0.2)  # not ones: a swapped norm must show


def _layer(gen, p, H, inp, inter, nq, nkv, dh, input_norm=True, hidden_norm=False):
    a = p + "self_attn."
    t = {a + "q_proj.weight": _rand(gen, nq * dh, inp), a + "k_proj.weight": _rand(gen, nkv * dh, inp),
         a + "v_proj.weight": _rand(gen, nkv * dh, inp), a + "o_proj.weight": _rand(gen, H, nq * dh),
         p + "mlp.gate_proj.weight": _rand(gen, inter, H), p + "mlp.up_proj.weight": _rand(gen, inter, H),
         p + "mlp.down_proj.weight": _rand(gen, H, inter), p + "post_attention_layernorm.weight": _norm(gen, H)}
    if input_norm:
        t[p + "input_layernorm.weight"] = _norm(gen, H)
    if hidden_norm:
        t[p + "hidden_norm.weight"] = _norm(gen, H)
    return t


def _config(arch, H, **extra):
    return {"architectures": [arch], "model_type": "llama", "hidden_size": H, "intermediate_size": 2 * H,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "hidden_act": "silu",
            "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": V,
            "tie_word_embeddings": False, "torch_dtype": "float16", **extra}


def write_eagle1(path, seed=0, layers=1, embed=True, H=HT, drop=(), pickle=False, **cfg):
    """An EAGLE-1 head as the authors release it (cnets1 state dict, LlamaConfig; qkv_bias as cnets1 reads it)."""
    gen = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _rand(gen, H, 2 * H), "fc.bias": _rand(gen, H)}
    for i in range(layers):
        t.update(_layer(gen, f"layers.{i}.", H, H, 2 * H, 4, 2, H // 4, input_norm=i > 0))
        if cfg.get("qkv_bias"):
            sizes = {"q": H, "k": H // 2, "v": H // 2}
            t.update({f"layers.{i}.self_attn.{x}_proj.bias": _rand(gen, n) for x, n in sizes.items()})
    if embed:
        t["embed_tokens.weight"] = _rand(gen, V, H, scale=1.0)
    for k in drop:
        del t[k]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config("LlamaForCausalLM", H, num_hidden_layers=layers, **cfg)))
    if pickle:
        torch.save(t, path / "pytorch_model.bin")
    else:
        save_file(t, str(path / "model.safetensors"))
    return path, t


def write_eagle3(path, seed=0, H=HT, Vd=64, embed=False, drop=(), d2t_len=None, **cfg):
    """An EAGLE-3 head in the layout vLLM/SGLang load (midlayer.*, fc [H, 3Ht], d2t/t2d)."""
    gen = torch.Generator().manual_seed(seed)
    t = _layer(gen, "midlayer.", H, 2 * H, 2 * H, 4, 2, H // 4, hidden_norm=True)
    ids = torch.randperm(V, generator=gen)[:Vd].sort().values
    t.update({"fc.weight": _rand(gen, H, 3 * HT), "norm.weight": _norm(gen, H), "lm_head.weight": _rand(gen, Vd, H),
              "d2t": (ids - torch.arange(Vd))[:d2t_len or Vd],
              "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)})
    if embed:
        t["embed_tokens.weight"] = _rand(gen, V, H, scale=1.0)
    for k in drop:
        del t[k]
    extra = {"draft_vocab_size": Vd, "eagle_aux_hidden_state_layer_ids": VLLM_IDS, **cfg}
    if H != HT:
        extra["target_hidden_size"] = HT
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config("LlamaForCausalLMEagle3", H, **extra)))
    save_file(t, str(path / "model.safetensors"))
    return path, t, ids


# ---------------------------------------------------------------------------- references (transformers modules)

def _hf_cfg(H, attention_bias=False):
    c = LlamaConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=4, num_key_value_heads=2,
                    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=64, vocab_size=V,
                    attention_bias=attention_bias)
    c._attn_implementation = "eager"
    return c


def _causal(S):
    return torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]  # [1, 1, S, S] additive


def _load(module, t, prefix):
    module.load_state_dict({k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}, strict=True)


def ref_eagle1(t, tokens, feats, target_lm_head):
    """cnets1: h = layer(fc(cat[embed, f])) with layer 0's input_layernorm skipped; logits = target head(h)."""
    qkv_bias = "layers.0.self_attn.q_proj.bias" in t
    c = _hf_cfg(HT, attention_bias=qkv_bias)
    layer = hf.LlamaDecoderLayer(c, layer_idx=0)
    layer.input_layernorm = nn.Identity()
    zero_o_bias = {"layers.0.self_attn.o_proj.bias": torch.zeros(HT)} if qkv_bias else {}  # cnets1: o_proj has none
    _load(layer, {k: v for k, v in {**t, **zero_o_bias}.items() if "input_layernorm" not in k}, "layers.0.")
    pos = torch.arange(tokens.shape[1])[None]
    x = torch.cat((t["embed_tokens.weight"][tokens], feats), -1) @ t["fc.weight"].T + t["fc.bias"]
    h = layer(x, attention_mask=_causal(tokens.shape[1]), position_ids=pos,
              position_embeddings=hf.LlamaRotaryEmbedding(c)(x, pos))
    return h, h @ target_lm_head.T


def ref_eagle3(t, tokens, feats, embed, H=HT, norm_before_residual=False):
    """vLLM llama_eagle3 / EAGLE cnets.py, written out: fc only on 3Ht-wide features, residual = h
    (vLLM's norm_before_residual: hidden_norm(h))."""
    c = _hf_cfg(H)
    attn = hf.LlamaAttention(c, layer_idx=0)
    for x in "qkv":  # q/k/v read cat[embed, hidden]: 2H
        setattr(attn, f"{x}_proj", nn.Linear(2 * H, getattr(attn, f"{x}_proj").out_features, bias=False))
    _load(attn, t, "midlayer.self_attn.")
    mlp = hf.LlamaMLP(c)
    _load(mlp, t, "midlayer.mlp.")
    norms = {}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
        norms[n] = hf.LlamaRMSNorm(H, eps=1e-5)
        norms[n].weight.data = t[("" if n == "norm" else "midlayer.") + n + ".weight"]
    S = tokens.shape[1]
    pos = torch.arange(S)[None]
    h = feats @ t["fc.weight"].T if feats.shape[-1] != H else feats
    e = embed[tokens]
    a, _ = attn(torch.cat((norms["input_layernorm"](e), norms["hidden_norm"](h)), -1),
                position_embeddings=hf.LlamaRotaryEmbedding(c)(h, pos), attention_mask=_causal(S))
    x = (norms["hidden_norm"](h) if norm_before_residual else h) + a
    out = x + mlp(norms["post_attention_layernorm"](x))
    return out, norms["norm"](out) @ t["lm_head.weight"].T  # draft-vocabulary logits


def _ids(S=12, B=2, seed=0):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _close(a, b, tol=1e-4):
    rel = float((a - b).abs().max() / b.abs().max())
    assert rel < tol, rel


# ---------------------------------------------------------------------------- forward against the references

@pytest.mark.parametrize("qkv_bias", [False, True])
@torch.no_grad()
def test_eagle1_matches_reference(tmp_path, target, hf_target, qkv_bias):
    path, t = write_eagle1(tmp_path / "e1", qkv_bias=qkv_bias)
    head = load_eagle_head(path, target)
    assert head.kind == "eagle" and head.target_layer_ids == () and head.embed is not None
    ids = _ids()
    pos = torch.arange(12).expand(2, 12)
    out = target(ids, pos)
    feats = head.target_features(out)
    # EAGLE-1's feature is the target's final-norm hidden state (HF's last_hidden_state).
    _close(feats, hf_target.model(ids).last_hidden_state, 1e-5)
    h_ref, logits_ref = ref_eagle1(t, ids, feats, hf_target.lm_head.weight)
    got = head(ids, feats, pos)
    _close(got.hidden, h_ref)
    logits = head.compute_logits(got.hidden.reshape(-1, HT))
    assert logits.dtype == torch.float32 and logits.shape == (24, V)
    _close(logits, logits_ref.reshape(-1, V))


@pytest.mark.parametrize("H, embed, nbr", [(HT, False, False), (48, True, False), (HT, False, True)],
                         ids=["shared-embed", "own-embed-wider", "norm-before-residual"])
@torch.no_grad()
def test_eagle3_matches_reference(tmp_path, target, hf_target, H, embed, nbr):
    path, t, draft_ids = write_eagle3(tmp_path / "e3", H=H, embed=embed, norm_before_residual=nbr)
    head = load_eagle_head(path, target)
    assert head.kind == "eagle3" and head.target_layer_ids == (1, 3, 5)
    ids = _ids()
    pos = torch.arange(12).expand(2, 12)
    feats = head.target_features(target(ids, pos, aux_layers=head.target_layer_ids))  # [B, S, 3Ht]
    # The aux convention: vLLM id i is HF hidden_states[i] (before layer i), leapfrog aux layer i - 1.
    hs = hf_target(ids, output_hidden_states=True).hidden_states
    hf_feats = torch.cat([hs[i] for i in VLLM_IDS], -1)
    _close(feats, hf_feats, 1e-5)
    embed_w = t["embed_tokens.weight"] if embed else target.embed.weight
    h_ref, draft_logits_ref = ref_eagle3(t, ids, hf_feats, embed_w, H, nbr)
    out = head(ids, feats, pos)
    _close(out.hidden, h_ref)
    _close(head.compute_draft_logits(out.hidden.reshape(-1, H)), draft_logits_ref.reshape(-1, 64))
    # Later steps feed the head's own hidden back (width H: no fc).
    nxt = _ids(seed=1)
    h2_ref, _ = ref_eagle3(t, nxt, h_ref, embed_w, H, nbr)
    _close(head(nxt, out.hidden, pos).hidden, h2_ref)
    # Target-vocabulary logits: draft logits at their target ids, -inf elsewhere.
    full = head.compute_logits(out.hidden.reshape(-1, H))
    assert full.shape == (24, V) and full.dtype == torch.float32
    assert torch.equal(full[:, draft_ids], head.compute_draft_logits(out.hidden.reshape(-1, H)))
    outside = torch.ones(V, dtype=torch.bool).index_fill(0, draft_ids, False)
    assert torch.isneginf(full[:, outside]).all()


def test_aux_layer_conversion_worked_example():
    assert default_eagle3_layers(32) == (1, 15, 28) == aux_layers_from_vllm((2, 16, 29))
    assert aux_layers_to_vllm((1, 15, 28)) == (2, 16, 29)


@torch.no_grad()
def test_eagle3_default_layers_and_sglang_field(tmp_path, target):
    d, _, _ = write_eagle3(tmp_path / "default", eagle_aux_hidden_state_layer_ids=None)
    assert load_eagle_head(d, target).target_layer_ids == default_eagle3_layers(L) == (1, 3, 4)
    # SpecForge/SGLang's nested field names layer outputs: leapfrog's convention as is.
    s, _, _ = write_eagle3(tmp_path / "sglang", eagle_aux_hidden_state_layer_ids=None,
                           eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]})
    assert load_eagle_head(s, target).target_layer_ids == (1, 3, 5)


@torch.no_grad()
def test_d2t_t2d_mapping(tmp_path, target):
    path, t, draft_ids = write_eagle3(tmp_path / "e3", Vd=40)
    head = load_eagle_head(path, target)
    assert torch.equal(head.draft_to_target(torch.arange(40)), draft_ids)
    assert torch.equal(head.draft_to_target(torch.arange(40)), torch.arange(40) + t["d2t"])
    assert torch.equal(head.t2d, t["t2d"]) and int(head.t2d.sum()) == 40
    h = torch.randn(5, HT)
    assert torch.equal(head.compute_logits(h).argmax(-1), head.draft_to_target(head.compute_draft_logits(h).argmax(-1)))


# ---------------------------------------------------------------------------- KV cache, batches, trees

def _kv(head, rows=2, max_len=64):
    a = head.args
    return KVCache(a.num_hidden_layers, rows, max_len, a.num_key_value_heads, a.head_dim, head.dtype)


def _head_on_features(tmp_path, target, kind: str, S: int):
    """A random head of ``kind`` (EAGLE-1 with two layers, or EAGLE-3), S tokens with the target's
    features for it, and its whole causal forward over them -> head, ids, feats, positions, hidden."""
    if kind == "eagle":
        path, _ = write_eagle1(tmp_path / "h", layers=2)
    else:
        path, _, _ = write_eagle3(tmp_path / "h")
    head = load_eagle_head(path, target)
    ids = _ids(S, B=1)
    pos = torch.arange(S)[None]
    feats = head.target_features(target(ids, pos, aux_layers=head.target_layer_ids))
    return head, ids, feats, pos, head(ids, feats, pos).hidden  # [1, S, H]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.no_grad()
def test_kv_cached_forward_equals_full_causal(tmp_path, target, kind):
    S = 10
    head, ids, feats, pos, full = _head_on_features(tmp_path, target, kind, S)
    kv = _kv(head)
    # A 4-token chunk, then one token at a time (row 1 of the cache).
    steps = [(0, 4)] + [(s, s + 1) for s in range(4, S)]
    outs = []
    for a, b in steps:
        meta = build_attn_meta([1], [list(range(a, b))], kv.scratch_row, CPU)
        outs.append(head(ids[:, a:b], feats[:, a:b], pos[:, a:b], kv, meta).hidden)
    _close(torch.cat(outs, 1), full, 1e-5)
    # A ragged padded batch: row 0 runs 3 new tokens after its 4 cached ones, row 1 one token at column 9.
    meta = build_attn_meta([1, 0], [[4, 5, 6], [9]], kv.scratch_row, CPU)
    kv2 = _kv(head)
    head(ids[:, :4], feats[:, :4], pos[:, :4], kv2, build_attn_meta([1], [[0, 1, 2, 3]], kv2.scratch_row, CPU))
    head(ids[:, :9], feats[:, :9], pos[:, :9], kv2, build_attn_meta([0], [list(range(9))], kv2.scratch_row, CPU))
    tok = torch.stack([ids[0, 4:7], torch.cat([ids[0, 9:10], ids[0, :2]])])
    ft = torch.stack([feats[0, 4:7], torch.cat([feats[0, 9:10], feats[0, :2]])])
    ps = torch.tensor([[4, 5, 6], [9, 0, 0]])
    got = head(tok, ft, ps, kv2, meta).hidden
    _close(got[0], full[0, 4:7], 1e-5)
    _close(got[1, :1], full[0, 9:10], 1e-5)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.no_grad()
def test_keep_rows_caches_every_position_and_returns_the_kept_ones(tmp_path, target, kind):
    """A head catching up on a prompt (runner: hidden="logits_rows") caches every position's keys
    and values and runs its last layer past attention for the kept rows only: those rows' states
    as the whole forward gives them, none for an empty keep, and later steps read the same cache."""
    S = 10
    head, ids, feats, pos, full = _head_on_features(tmp_path, target, kind, S)
    kv = _kv(head)

    def chunk(a, b, keep=None):
        meta = build_attn_meta([0], [list(range(a, b))], kv.scratch_row, CPU)
        return head(ids[:, a:b], feats[:, a:b], pos[:, a:b], kv, meta,
                    keep_rows=None if keep is None else torch.tensor(keep)).hidden

    assert chunk(0, 4, keep=[]).shape == (1, 0, full.shape[-1])   # a chunk before the prompt's last
    got = chunk(4, 8, keep=[1, 3])
    assert got.shape == (1, 2, full.shape[-1])
    _close(got[0], full[0, [5, 7]], 1e-5)
    _close(torch.cat([chunk(8, 9), chunk(9, 10)], 1), full[:, 8:10], 1e-5)


@torch.no_grad()
def test_tree_mask_siblings_equal_their_chains(tmp_path, target):
    path, _, _ = write_eagle3(tmp_path / "h")
    head = load_eagle_head(path, target)
    ids = _ids(8, B=1)
    pos = torch.arange(8)[None]
    feats = head.target_features(target(ids, pos, aux_layers=head.target_layer_ids))
    kv = _kv(head)
    head(ids[:, :6], feats[:, :6], pos[:, :6], kv, build_attn_meta([0], [list(range(6))], kv.scratch_row, CPU))
    # Two sibling drafts at position 6 (columns 6 and 7); each sees the prefix and itself.
    tree = torch.zeros(1, 2, 8, dtype=torch.bool)
    tree[0, :, :6] = True
    tree[0, 0, 6] = tree[0, 1, 7] = True
    sib_tok = torch.stack([ids[0, 6], ids[0, 7]])[None]
    sib_feat = torch.stack([feats[0, 6], feats[0, 7]])[None]
    meta = build_attn_meta([0], [[6, 7]], kv.scratch_row, CPU, tree_mask=tree)
    got = head(sib_tok, sib_feat, torch.tensor([[6, 6]]), kv, meta).hidden
    for j in range(2):
        chain = torch.cat([ids[:, :6], sib_tok[:, j:j + 1]], 1)
        chain_f = torch.cat([feats[:, :6], sib_feat[:, j:j + 1]], 1)
        _close(got[0, j], head(chain, chain_f, pos[:, :7]).hidden[0, 6], 1e-5)


# ---------------------------------------------------------------------------- save / load / init

@pytest.mark.parametrize("kind", ["eagle", "eagle-qkv-bias", "eagle3"])
@torch.no_grad()
def test_round_trip_save_load(tmp_path, target, kind):
    if kind.startswith("eagle-"):
        path, t = write_eagle1(tmp_path / "in", qkv_bias=True)
    elif kind == "eagle":
        path, t = write_eagle1(tmp_path / "in", embed=False)
    else:
        path, t, _ = write_eagle3(tmp_path / "in")
    head = load_eagle_head(path, target)
    out = save_eagle_head(head, tmp_path / "out")
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == set(t)  # exactly the release layout's tensors
    assert all(torch.equal(written[k], t[k]) for k in t)
    again = load_eagle_head(out, target)
    ids, pos = _ids(6), torch.arange(6).expand(2, 6)
    feats = head.target_features(target(ids, pos, aux_layers=head.target_layer_ids))
    a, b = head(ids, feats, pos).hidden, again(ids, feats, pos).hidden
    assert torch.equal(a, b)
    assert torch.equal(head.compute_logits(a[0]), again.compute_logits(b[0]))
    cfg = json.loads((out / "config.json").read_text())
    assert "bias" not in cfg  # the authors' default fc bias; vLLM would read a "bias" as attention biases
    if kind == "eagle3":  # both conventions, consistently
        assert cfg["eagle_aux_hidden_state_layer_ids"] == VLLM_IDS
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.no_grad()
def test_init_save_load(tmp_path, target, kind):
    head = init_eagle_head(kind, target.args, draft_vocab_size=48 if kind == "eagle3" else None,
                           target_layer_ids=(0, 4, 7) if kind == "eagle3" else None, seed=5)
    head.bind_target(target)
    assert head.num_parameters() > 0 and head.kind == kind
    loaded = load_eagle_head(save_eagle_head(head, tmp_path / "h"), target)
    assert loaded.target_layer_ids == head.target_layer_ids
    ids, pos = _ids(5), torch.arange(5).expand(2, 5)
    feats = head.target_features(target(ids, pos, aux_layers=head.target_layer_ids))
    assert torch.equal(head(ids, feats, pos).hidden, loaded(ids, feats, pos).hidden)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        init_eagle_head("eagle3", target.args, target_layer_ids=(0, 8, 3))


def test_greedy_logit_scale_round_trip_and_errors(tmp_path, target):
    """The greedy calibration scale (leapfrog's config key) survives save/load; absent means 1;
    a non-positive one is refused."""
    import dataclasses
    head = init_eagle_head("eagle3", target.args, draft_vocab_size=48, seed=5)
    head.bind_target(target)
    assert load_eagle_head(save_eagle_head(head, tmp_path / "a"), target).cfg.greedy_logit_scale == 1.0
    assert "greedy_logit_scale" not in json.loads((tmp_path / "a" / "config.json").read_text())
    head.cfg = dataclasses.replace(head.cfg, greedy_logit_scale=2.5)
    out = save_eagle_head(head, tmp_path / "b")
    assert load_eagle_head(out, target).cfg.greedy_logit_scale == 2.5
    cfg = json.loads((out / "config.json").read_text())
    cfg["greedy_logit_scale"] = -1
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="greedy_logit_scale"):
        load_eagle_head(out, target)


@torch.no_grad()
def test_bf16_and_packed(tmp_path, target):
    path, _, _ = write_eagle3(tmp_path / "h")
    ref = load_eagle_head(path, target)
    head = load_eagle_head(path, target, dtype=torch.bfloat16)
    head.pack_for_inference()
    ids, pos = _ids(6), torch.arange(6).expand(2, 6)
    feats = ref.target_features(target(ids, pos, aux_layers=ref.target_layer_ids))
    h = head(ids, feats, pos).hidden
    assert h.dtype == torch.bfloat16
    logits = head.compute_logits(h.reshape(-1, HT))
    assert logits.dtype == torch.float32
    _close(h.float(), ref(ids, feats, pos).hidden, 5e-2)
    with pytest.raises(ConfigError, match="pack_for_inference"):
        save_eagle_head(head, tmp_path / "packed")


# ---------------------------------------------------------------------------- errors

def test_error_wrong_hidden_size(tmp_path, target):
    path, _ = write_eagle1(tmp_path / "h", H=48)
    with pytest.raises(CheckpointError, match=r"config\.json: hidden_size=48.*hidden_size is 32"):
        load_eagle_head(path, target)
    path, _, _ = write_eagle3(tmp_path / "h3", target_hidden_size=40)
    with pytest.raises(CheckpointError, match="target_hidden_size=40"):
        load_eagle_head(path, target)


def test_error_draft_vocab_vs_d2t(tmp_path, target):
    path, _, _ = write_eagle3(tmp_path / "h", d2t_len=60)
    with pytest.raises(CheckpointError, match=r"safetensors: tensor 'd2t' has shape \(60,\).*draft_vocab_size=64"):
        load_eagle_head(path, target)


def test_error_missing_tensor(tmp_path, target):
    path, _, _ = write_eagle3(tmp_path / "h", drop=["midlayer.hidden_norm.weight"])
    with pytest.raises(CheckpointError, match="'midlayer.hidden_norm.weight' is missing"):
        load_eagle_head(path, target)
    path, _, _ = write_eagle3(tmp_path / "wide", H=48)  # no embed_tokens, and the target's is 32 wide
    with pytest.raises(CheckpointError, match="'embed_tokens.weight' is missing"):
        load_eagle_head(path, target)


def test_error_wrong_tensor_shape_and_unexpected(tmp_path, target):
    path, t, _ = write_eagle3(tmp_path / "h")
    t["fc.weight"] = t["fc.weight"][:, :64].contiguous()
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'fc.weight' has shape \(32, 64\).*\(32, 96\)"):
        load_eagle_head(path, target)
    path, _ = write_eagle1(tmp_path / "two", layers=2)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match="does not have"):
        load_eagle_head(path, target)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_error_weights_stored_as_other_than_float(tmp_path, target, dtype):
    """An integer or fp8 head weight would be cast silently (fp8 passed the floating-point check)."""
    path, t, _ = write_eagle3(tmp_path / "h")
    t["fc.weight"] = t["fc.weight"].to(dtype)
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'fc.weight' is stored as \w+; weights must be float16, bfloat16"):
        load_eagle_head(path, target)


def test_error_pickle_needs_allow_pickle(tmp_path, target):
    path, _ = write_eagle1(tmp_path / "h", pickle=True)
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        load_eagle_head(path, target)
    safe, _ = write_eagle1(tmp_path / "s")
    ids, pos = _ids(4), torch.arange(4).expand(2, 4)
    feats = target(ids, pos).hidden
    with torch.no_grad():
        a = load_eagle_head(path, target, allow_pickle=True)(ids, feats, pos).hidden
        b = load_eagle_head(safe, target)(ids, feats, pos).hidden
    assert torch.equal(a, b)


def test_error_layer_id_out_of_range(tmp_path, target):
    path, _, _ = write_eagle3(tmp_path / "h", eagle_aux_hidden_state_layer_ids=[2, 4, 9])
    with pytest.raises(CheckpointError, match=r"eagle_aux_hidden_state_layer_ids=\[2, 4, 9\]: id 9 is out of range"):
        load_eagle_head(path, target)
    path, _, _ = write_eagle3(tmp_path / "emb", eagle_aux_hidden_state_layer_ids=[0, 4, 6])
    with pytest.raises(CheckpointError, match="token embedding"):
        load_eagle_head(path, target)
    path, _, _ = write_eagle3(tmp_path / "both", eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 6]})
    with pytest.raises(CheckpointError, match="different target layers"):
        load_eagle_head(path, target)


def test_error_fields_and_tensors_that_would_be_misread(tmp_path, target):
    """config.json fields and tensors the head's layout cannot honour are refused, not ignored:
    pre-quantized weights, an integer dtype, EAGLE-3 fields in an EAGLE-1 head, fewer than two
    feature layers (an empty list used to mean the default layers), an architecture of another
    model, integer weights, a pickled t2d that is not a tensor."""
    cases = [
        (write_eagle3, dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
        (write_eagle3, dict(torch_dtype="int8"), "torch_dtype 'int8'"),
        (write_eagle1, dict(draft_vocab_size=100), "EAGLE-3 fields in an EAGLE-1 head"),
        (write_eagle1, dict(eagle_aux_hidden_state_layer_ids=[1, 2, 3]), "EAGLE-3 fields in an EAGLE-1 head"),
        (write_eagle3, dict(eagle_aux_hidden_state_layer_ids=[]), "two or more target layers"),
        (write_eagle3, dict(eagle_aux_hidden_state_layer_ids=[2]), "two or more target layers"),
        (write_eagle3, dict(architectures=["MistralForCausalLM"]), "'MistralForCausalLM' is not an EAGLE head"),
    ]
    for i, (write, cfg, msg) in enumerate(cases):
        path = write(tmp_path / f"h{i}")[0]
        d = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**d, **cfg}))
        with pytest.raises(CheckpointError, match=re.escape(msg)):
            load_eagle_head(path, target)
    path, t, _ = write_eagle3(tmp_path / "int")
    save_file({**t, "fc.weight": t["fc.weight"].long()}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'fc.weight' is stored as I64"):
        load_eagle_head(path, target)
    path, t, _ = write_eagle3(tmp_path / "pkl")
    (path / "model.safetensors").unlink()
    torch.save({**t, "t2d": t["t2d"].tolist()}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="'t2d' is a list, not a tensor"):
        load_eagle_head(path, target, allow_pickle=True)


def test_error_not_an_eagle_head(tmp_path, target, target_dir):
    with pytest.raises(CheckpointError, match="not an EAGLE head"):
        load_eagle_head(target_dir, target)


def test_hub_id_downloads_pickle_only_when_allowed(tmp_path, target, monkeypatch):
    import huggingface_hub
    local, _ = write_eagle1(tmp_path / "snapshot")
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    load_eagle_head("someone/EAGLE-head", target)
    load_eagle_head("someone/EAGLE-head", target, allow_pickle=True)
    assert [r for r, _ in calls] == ["someone/EAGLE-head"] * 2
    assert "*.bin" not in calls[0][1] and "*.bin" in calls[1][1]


def test_unbound_head_says_so(target):
    head = init_eagle_head("eagle", target.args)
    ids, pos = _ids(3), torch.arange(3).expand(2, 3)
    with pytest.raises(ConfigError, match="bind_target"):
        head(ids, torch.zeros(2, 3, HT), pos)
