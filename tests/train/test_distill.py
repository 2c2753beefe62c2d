from __future__ import annotations

import json

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.demo import save_random_llama
from leapfrog.entrypoints.cli import main
from leapfrog.errors import ConfigError
from leapfrog.train.distill import DraftShape, heldout_prompts, train_draft
from leapfrog.train.evaluate import draft_acceptance
from leapfrog.train.loop import TrainConfig
from tests.train.conftest import assert_resumed_like

SHAPE = DraftShape(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2)


def cfg(steps, **kw):
    return TrainConfig(**{**dict(steps=steps, batch_size=8, seq_len=64, lr=1e-2, warmup_steps=2,
                                 checkpoint_every=5, eval_every=10), **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bigram_target, corpus_dir):
    out = tmp_path_factory.mktemp("d") / "draft"
    res = train_draft(bigram_target, corpus_dir, out, shape=SHAPE, train_config=cfg(60),
                      heldout_fraction=0.2, eval_prompts=6, eval_max_tokens=24)
    return res


def test_train_draft_lowers_kl_and_beats_an_untrained_draft(trained, bigram_target, tokenizer, corpus_dir,
                                                             tmp_path):
    res = trained
    assert res.heldout_kl_after < 0.5 * res.heldout_kl_before
    assert [s for s, _ in res.state.evals][-1] == 60
    # a normal HF directory that draft_model loads
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
              "training_loss.png", "train_draft.json"):
        assert (res.path / f).is_file(), f
    assert json.loads((res.path / "config.json").read_text())["vocab_size"] == len(tokenizer)
    # acceptance against the target beats the same shape untrained, on the same held-out prompts
    untrained = save_random_llama(tmp_path / "untrained", tokenizer, seed=0, **vars(SHAPE) | {
        "tie_word_embeddings": True, "max_position_embeddings": 512})
    from leapfrog.train.corpus import read_documents, split_by_file
    held = split_by_file(read_documents(corpus_dir), 0.2, 0)[1]
    prompts = heldout_prompts(tokenizer, held, 6)
    base = draft_acceptance(str(bigram_target), str(untrained), prompts, max_tokens=24)
    assert res.acceptance["acceptance_rate"] > base["acceptance_rate"] + 0.08
    assert res.acceptance["mean_acceptance_length"] > base["mean_acceptance_length"]


def test_trained_draft_is_lossless_in_the_engine(trained, bigram_target):
    prompts = ["def foo(x):\n    return", "import os\n"]
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    ref = LLM(model=str(bigram_target), dtype="float32").generate(prompts, sp, use_tqdm=False)
    llm = LLM(model=str(bigram_target), dtype="float32",
              speculative_config={"method": "draft_model", "model": str(trained.path), "num_speculative_tokens": 4})
    out = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_resume_continues_where_it_stopped(tmp_path, llama_dir, corpus_dir):
    kw = dict(shape=SHAPE, heldout_fraction=0.2, eval_prompts=0)
    straight = train_draft(llama_dir, corpus_dir, tmp_path / "a", train_config=cfg(10), **kw)
    part = train_draft(llama_dir, corpus_dir, tmp_path / "b", train_config=cfg(10), stop_at=5, **kw)
    assert part.state.step == 5
    resumed = train_draft(llama_dir, corpus_dir, tmp_path / "b", train_config=cfg(10), **kw)
    assert resumed.state.step == 10
    assert_resumed_like(straight, resumed, 10)


def test_generate_mode_distils_on_the_targets_own_text(tmp_path, llama_dir, corpus_dir):
    res = train_draft(llama_dir, corpus_dir, tmp_path / "g", shape=SHAPE, train_config=cfg(20, seq_len=32),
                      data_mode="generate", gen_tokens=24, heldout_fraction=0.2, eval_prompts=0,
                      save_dtype="bfloat16")
    assert res.heldout_kl_after < res.heldout_kl_before
    assert json.loads((res.path / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"


def test_bad_inputs_are_clear_errors(tmp_path, llama_dir, corpus_dir, draft_dir):
    with pytest.raises(ConfigError, match="no such file"):
        train_draft(llama_dir, tmp_path / "nope", tmp_path / "o", train_config=cfg(2))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        DraftShape(hidden_size=50, num_attention_heads=4)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            train_draft(llama_dir, corpus_dir, tmp_path / "o", train_config=cfg(2, device="cuda"))
    with pytest.raises(ConfigError, match="seq_len"):
        (tmp_path / "tiny.txt").write_text("a b")
        train_draft(llama_dir, tmp_path / "tiny.txt", tmp_path / "o", train_config=cfg(2), eval_prompts=0)


def test_cli_train_draft(tmp_path, llama_dir, corpus_dir, capsys):
    out = tmp_path / "cli_draft"
    rc = main(["train-draft", str(llama_dir), "--corpus", str(corpus_dir), "--out", str(out), "--steps", "4",
               "--batch-size", "4", "--seq-len", "32", "--hidden-size", "32", "--intermediate-size", "64",
               "--num-layers", "1", "--num-heads", "2", "--eval-prompts", "2", "--json", str(tmp_path / "s.json"),
               "--bf16", "on"])   # bf16 autocast (emulated on CPUs without native bf16: slow but correct)
    assert rc == 0
    text = capsys.readouterr().out
    assert "acceptance at K=4" in text and "held-out KL" in text
    hint = text[text.index("--speculative-config '") + len("--speculative-config '"):].split("'")[0]
    assert json.loads(hint) == {"method": "draft_model", "model": str(out), "num_speculative_tokens": 4}
    assert (out / "model.safetensors").is_file()
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 4
    assert json.loads((out / "train_draft.json").read_text())["train_config"]["autocast_bf16"] is True
    assert main(["train-draft", str(llama_dir), "--corpus", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert main(["train-draft", str(llama_dir), "--corpus", str(corpus_dir), "--out", str(out),
                 "--hidden-size", "30", "--num-heads", "4"]) == 2
