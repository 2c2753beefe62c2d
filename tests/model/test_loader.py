"""Loading: sharded checkpoints, dtypes, and a clear error for every malformed case."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from leapfrog import LLM, SamplingParams
from leapfrog.errors import CheckpointError, ConfigError
from leapfrog.demo import save_random_llama
from leapfrog.model.loader import load_model, load_tokenizer, read_checkpoint
from tests.conftest import BASE


def copy(src, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_same_weights(tmp_path, tokenizer, llama_dir):
    sharded = save_random_llama(tmp_path / "sh", tokenizer, seed=1, max_shard_size="20KB",
                                **{**BASE, "rope_scaling": None, "tie_word_embeddings": True})
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    single = save_random_llama(tmp_path / "one", tokenizer, seed=1,
                               **{**BASE, "rope_scaling": None, "tie_word_embeddings": True})
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = LLM(model=str(sharded), dtype="float32").generate({"prompt_token_ids": [5, 6, 7]}, sp)
    b = LLM(model=str(single), dtype="float32").generate({"prompt_token_ids": [5, 6, 7]}, sp)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_bf16_and_auto_dtype(llama_dir):
    ck = read_checkpoint(llama_dir)
    m = load_model(ck, torch.bfloat16, torch.device("cpu"), 64)
    assert m.dtype == torch.bfloat16
    llm = LLM(model=llama_dir, dtype="bfloat16")   # (a path object, as a string)
    assert llm.config.model == str(llama_dir)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def _rewrite_weights(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_named(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    _rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        LLM(model=str(d))


def test_wrong_shape_names_file_and_tensor(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    _rewrite_weights(d, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*o_proj\.weight.*\(3, 3\)"):
        LLM(model=str(d))


@pytest.mark.parametrize("change, pattern", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "unsupported rope type 'yarn'"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_bad_config_clear_error(tmp_path, llama_dir, change, pattern):
    d = copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=pattern):
        LLM(model=str(d))


def test_missing_required_field(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing required field 'hidden_size'"):
        LLM(model=str(d))


def test_pickle_refused_unless_opted_in(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(tensors, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        LLM(model=str(d))
    llm = LLM(model=str(d), allow_pickle=True, dtype="float32")
    ref = LLM(model=str(llama_dir), dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    p = {"prompt_token_ids": [3, 4, 5]}
    assert llm.generate(p, sp)[0].outputs[0].token_ids == ref.generate(p, sp)[0].outputs[0].token_ids


def test_not_a_model_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(model=str(tmp_path))
    with pytest.raises(CheckpointError, match="not a hub id|no such directory"):
        LLM(model=str(tmp_path / "nope" / "deeper"))


def test_hub_ids_for_models_and_tokenizers(tmp_path, llama_dir, monkeypatch):
    """Hub ids (owner/name, or a legacy name like "gpt2") go through one download path: a
    tokenizer fetches no weights, and a failed download is one line naming the id (a tokenizer id
    used to go through transformers' five retries: 51 s offline)."""
    import huggingface_hub
    asked = []

    def fake_snapshot_download(repo_id, allow_patterns):
        asked.append((repo_id, allow_patterns))
        if repo_id == "org/tok":
            return str(llama_dir)
        raise OSError("Cannot reach the hub.\nCheck your connection.")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    tok = load_tokenizer("org/tok")
    assert tok.encode("def f") and asked == [("org/tok", [p for p in asked[0][1] if p != "*.safetensors"])]
    assert "*.safetensors" not in asked[0][1] and "tokenizer*" in asked[0][1]
    for ident, what in (("gpt2", "model"), ("some-org/some-model", "model")):
        with pytest.raises(CheckpointError, match=f"{what} '{ident}': not a local directory and the hub download "
                                                  "failed: OSError: Cannot reach the hub. Check your connection."):
            LLM(model=ident)
    with pytest.raises(CheckpointError, match="tokenizer 'org/none': .*hub download failed"):
        LLM(model=str(llama_dir), tokenizer="org/none")
    for bad in ("a/b/c", "-x", "x y"):
        with pytest.raises(CheckpointError, match="not a hub id"):
            LLM(model=bad)
    with pytest.raises(ConfigError, match="model='': must be a checkpoint directory"):   # (it loaded ".")
        LLM(model="")
    for bad in (5, b"dir", ["a"]):   # (5 was tried as the hub id "5")
        with pytest.raises(ConfigError, match=re.escape(f"model={bad!r}: must be a checkpoint directory")):
            LLM(model=bad)
    assert [a[0] for a in asked] == ["org/tok", "gpt2", "some-org/some-model", "org/none"]


def test_missing_shard_named(tmp_path, tokenizer):
    d = save_random_llama(tmp_path / "sh", tokenizer, seed=1, max_shard_size="20KB", **BASE)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        LLM(model=str(d))


def test_generation_config_eos(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 17]}))
    assert 17 in read_checkpoint(d).eos_token_ids


def test_dummy_load_format_needs_only_config_json(tmp_path, llama_dir):
    """load_format="dummy": a model shape from config.json alone, random weights (seeded), the
    HF initialisation's statistics; other formats are refused by name."""
    only = tmp_path / "shape"
    only.mkdir()
    shutil.copy(llama_dir / "config.json", only / "config.json")
    with pytest.raises(CheckpointError):   # no weights: the real loader refuses
        load_model(read_checkpoint(only), torch.float32, torch.device("cpu"), 64)
    ck = read_checkpoint(only)
    a = load_model(ck, torch.float32, torch.device("cpu"), 64, load_format="dummy", seed=3)
    b = load_model(ck, torch.float32, torch.device("cpu"), 64, load_format="dummy", seed=3)
    c = load_model(ck, torch.float32, torch.device("cpu"), 64, load_format="dummy", seed=4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)           # same seed, same weights
    assert not torch.equal(pa["embed.weight"], pc["embed.weight"])
    std = ck.config.get("initializer_range", 0.02)
    for n, p in pa.items():
        if "norm" in n:
            assert torch.all(p == 1), n
        else:
            assert abs(p.float().std().item() - std) < 0.2 * std, n
    # layers differ from each other (each parameter its own draw)
    assert not torch.equal(pa["layers.0.wo.weight"], pa["layers.1.wo.weight"])
    llm = LLM(model=str(only), load_format="dummy", skip_tokenizer_init=True, dtype="float32")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    with pytest.raises(ConfigError, match="load_format='pt'"):
        LLM(model=str(only), load_format="pt", skip_tokenizer_init=True)
