"""EAGLE head training: the training-time test's attention against the inference path, losses that
fall for both kinds, resume equal to a straight run, a saved head that the engine runs losslessly,
tokenizer-less targets from a token-id corpus, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from leapfrog import LLM, SamplingParams
from leapfrog.demo import save_random_llama
from leapfrog.entrypoints.cli import main
from leapfrog.errors import ConfigError
from leapfrog.model.eagle import head_fingerprint, init_eagle_head, load_eagle_head
from leapfrog.model.loader import load_model, read_checkpoint
from leapfrog.model.runner import ModelRunner, SeqChunk
from leapfrog.train.eagle import (
    EagleData,
    EagleEval,
    EagleRecipe,
    _new_head,
    frequent_tokens,
    generate_samples,
    target_batch,
    train_eagle,
    ttt_mask,
    unroll,
)
from leapfrog.train.corpus import read_documents
from leapfrog.train.distill import generation_params
from leapfrog.train.loop import TrainConfig
from tests.train.conftest import assert_resumed_like

EVAL = EagleEval(prompts=3, max_tokens=16, trees=((3, 2, 5), (3, 1, None)))


def cfg(steps, **kw):
    return TrainConfig(**{**dict(steps=steps, batch_size=4, seq_len=48, lr=1e-2, warmup_steps=2,
                                 checkpoint_every=5, eval_every=10), **kw})


@pytest.fixture(scope="module")
def target4(tmp_path_factory, tokenizer):
    """A 4-layer random Llama (EAGLE-3 reads three distinct layers) whose attention and MLP outputs
    are zeroed and whose LM head is scaled up: a peaked bigram table, which a head learns in a few
    steps from the target's own greedy text."""
    import transformers as tf
    path = save_random_llama(tmp_path_factory.mktemp("t4"), tokenizer, seed=1, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             initializer_range=0.2, tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target3(tmp_path_factory, tokenizer):
    """A plain 3-layer random Llama (untied head): features that depend on the context."""
    return save_random_llama(tmp_path_factory.mktemp("t3"), tokenizer, seed=5, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             initializer_range=0.2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(target3):
    """The target and a random head of each kind in float64: the unrolled and the KV-cached paths
    reduce in different orders, and float32 differences compound over draft steps."""
    target = load_model(read_checkpoint(target3), torch.float64, torch.device("cpu"), 256)
    heads = {}
    for kind in ("eagle", "eagle3"):
        vocab = torch.randperm(target.args.vocab_size, generator=torch.Generator().manual_seed(0))[:200].sort().values
        head = init_eagle_head(kind, target.args, seed=3, init_std=0.2, dtype=torch.float64,
                               **({"draft_token_ids": vocab.tolist()} if kind == "eagle3" else {}))
        head.bind_target(target)
        heads[kind] = head.eval()
    return target, heads


def test_ttt_mask_worked_example():
    m = ttt_mask(4, 2).int().tolist()
    assert m == [[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
                 [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
                 [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
                 [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]]
    assert torch.equal(ttt_mask(5, 0), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_ttt_step0_is_the_plain_forward(models, tokenizer, kind):
    target, heads = models
    head = heads[kind]
    windows = torch.randint(0, len(tokenizer), (2, 20), generator=torch.Generator().manual_seed(1))
    tb = target_batch(target, head, windows)
    with torch.no_grad():
        h0 = unroll(head, tb, 1)[0]
        ref = head(tb.token_ids, tb.features, tb.positions).hidden  # kv=None: plain causal attention
    torch.testing.assert_close(h0, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_ttt_steps_are_what_the_inference_tree_expansion_computes(models, tokenizer, kind):
    """Step j's row t = the depth-(j+1) node of the tree grown (KV cache + ModelRunner, as the EAGLE
    proposer does) after catching up on head positions 0..t-j, along the data's own tokens."""
    target, heads = models
    head = heads[kind]
    R = 15
    windows = torch.randint(0, len(tokenizer), (1, R + 1), generator=torch.Generator().manual_seed(2))
    tb = target_batch(target, head, windows)
    with torch.no_grad():
        hs = unroll(head, tb, 4)
        combined = head.combine_target_features(tb.features[0])  # [R, H], as on_target_states
    x = tb.token_ids[0].tolist()   # x[r] = token of row r
    for j in (1, 2, 3):
        for t in (j, j + 2, R - 1):
            runner = ModelRunner(head, 1, 64)
            c = t - j + 1                                        # committed head positions 0..c-1
            out = runner.step([SeqChunk(0, 0, x[:c], 1, features=combined[:c])], hidden="hidden")
            h = out.hidden[-1]
            for i in range(1, j + 1):                            # the chain of depth-i nodes, one forward each
                node = SeqChunk(0, c + i - 1, [x[c + i - 1]], 1, features=h[None], context=c,
                                extra_cols=[list(range(c, c + i - 1))], first_pos=[c + i - 1])
                h = runner.step([node], hidden="hidden").hidden[0]
            torch.testing.assert_close(hs[j][0, t], h, rtol=1e-9, atol=1e-9, msg=f"step {j} row {t}")
    # and a step's output depends on the head's own earlier outputs, not on the target features there
    assert not torch.allclose(hs[1][0, 5], hs[0][0, 5], atol=1e-3)


def test_warm_start_puts_the_head_in_the_targets_output_space(target3, tokenizer):
    """With the head's own layer silenced, a warm-started EAGLE-3 head gives the target's logits at the
    same position (on the draft vocabulary): h = fc(f) = the target's top residual state."""
    target = load_model(read_checkpoint(target3), torch.float32, torch.device("cpu"), 256)
    stream = torch.randint(0, len(tokenizer), (500,), generator=torch.Generator().manual_seed(4))
    head = _new_head("eagle3", target, EagleRecipe(draft_vocab_size=100), stream, 0, torch.device("cpu"))
    assert head.target_layer_ids[-1] == target.args.num_hidden_layers - 1
    with torch.no_grad():
        head.layers[0].wo.weight.zero_()
        head.layers[0].w2.weight.zero_()
    windows = stream[:30][None]
    tb = target_batch(target, head, windows)
    with torch.no_grad():
        q = head.compute_draft_logits(unroll(head, tb, 1)[0][0])                       # [R, Vd] at rows 0..R-1
        p = target.compute_logits(target(windows, torch.arange(30)[None]).hidden[0, :-1])[:, head.draft_ids]
    torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-4)


def test_frequent_tokens():
    stream = torch.tensor([5, 5, 5, 2, 2, 9, 1, 1, 1, 1])
    assert frequent_tokens(stream, 12, 3).tolist() == [1, 2, 5]
    assert frequent_tokens(stream, 12, 6).tolist() == [0, 1, 2, 3, 5, 9]  # unseen ids fill up by id


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target4, corpus_dir):
    out = {}
    for kind in ("eagle", "eagle3"):
        d = tmp_path_factory.mktemp(kind)
        out[kind] = train_eagle(target4, corpus_dir, d / "head", kind,
                                train_config=cfg(60, batch_size=8, eval_every=30),
                                recipe=EagleRecipe(draft_vocab_size=256 if kind == "eagle3" else None,
                                                   ttt_steps=None if kind == "eagle" else 3),
                                data=EagleData(mode="generate", gen_temperature=0.0, gen_tokens=48,
                                               gen_prompts_per_doc=2, heldout_fraction=0.2), evaluation=EVAL)
    return out


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_losses_fall_and_the_head_drafts_in_the_engine(trained, target4, kind):
    res = trained[kind]
    b, a = res.heldout_before, res.heldout_after
    losses = [v for _, v in res.state.losses]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert a["loss"] < 0.7 * b["loss"]
    assert a["accuracy"][0] > 0.4 and len(a["accuracy"]) == (1 if kind == "eagle" else 3)
    if kind == "eagle":
        assert a["feature"][0] < b["feature"][0] and res.calibration is None
    else:   # the logit scale fitted for greedy verification is folded into lm_head
        c = res.calibration
        assert c["ce_after"] <= c["ce_before"] and c["scale"] != 1.0
    assert [s for s, _ in res.state.evals] == [30, 60]
    # the saved head loads and drafts: greedy output with it equals output without
    t = load_model(read_checkpoint(target4), torch.float32, torch.device("cpu"), 256)
    head = load_eagle_head(res.path, t)
    assert head.kind == kind and head.cfg.draft_vocab_size == (256 if kind == "eagle3" else t.args.vocab_size)
    prompts = ["def foo(x):\n    return", "import os\n", "class A:\n"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=str(target4), dtype="float32").generate(prompts, sp, use_tqdm=False)
    spec = {"method": kind, "model": str(res.path), "num_speculative_tokens": 3, "eagle_topk": 2}
    llm = LLM(model=str(target4), dtype="float32", speculative_config=spec)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert llm.get_metrics()["mean_acceptance_length"] > 2.0
    assert [a["speculative_config"]["eagle_topk"] for a in res.acceptance] == [2, 1]
    assert all(a["mean_acceptance_length"] > 2.0 for a in res.acceptance)
    for f in ("config.json", "model.safetensors", "training_loss.png", "train_eagle.json"):
        assert (res.path / f).is_file(), f


def test_fine_tuning_a_saved_head_starts_where_its_training_ended(trained, target4, corpus_dir, tmp_path):
    """init_head: the saved head (greedy calibration folded into lm_head) is loaded with the
    calibration divided out, so on the same held-out data its loss before fine-tuning is the
    original run's loss after training; it keeps its draft vocabulary and still drafts losslessly."""
    src = trained["eagle3"]
    data = EagleData(mode="generate", gen_temperature=0.0, gen_tokens=48, gen_prompts_per_doc=2, heldout_fraction=0.2)
    res = train_eagle(target4, corpus_dir, tmp_path / "tuned", "eagle3", train_config=cfg(4, batch_size=8, lr=1e-3),
                      recipe=EagleRecipe(ttt_steps=3), data=data, evaluation=EagleEval(prompts=0),
                      init_head=src.path)
    assert res.heldout_before["loss"] == pytest.approx(src.heldout_after["loss"], rel=2e-3)
    assert res.heldout_before["loss"] < 0.5 * src.heldout_before["loss"]
    assert res.heldout_after["loss"] < 1.2 * res.heldout_before["loss"]
    assert res.calibration["scale"] == pytest.approx(src.calibration["scale"], rel=0.2)
    t = load_model(read_checkpoint(target4), torch.float32, torch.device("cpu"), 256)
    a, b = load_eagle_head(src.path, t), load_eagle_head(res.path, t)
    assert torch.equal(a.draft_ids, b.draft_ids)
    prompts = ["def foo(x):\n    return", "import os\n"]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = LLM(model=str(target4), dtype="float32").generate(prompts, sp, use_tqdm=False)
    llm = LLM(model=str(target4), dtype="float32",
              speculative_config={"method": "eagle3", "model": str(res.path), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in ref]
    assert llm.get_metrics()["mean_acceptance_length"] > 2.0
    # the head decides its shape; a head of the other kind is refused
    with pytest.raises(ConfigError, match="keeps the shape"):
        train_eagle(target4, corpus_dir, tmp_path / "x", "eagle3", train_config=cfg(1), data=data,
                    recipe=EagleRecipe(draft_vocab_size=128), evaluation=EagleEval(prompts=0), init_head=src.path)
    with pytest.raises(ConfigError, match="eagle3 head"):
        train_eagle(target4, corpus_dir, tmp_path / "y", "eagle", train_config=cfg(1), data=data,
                    evaluation=EagleEval(prompts=0), init_head=src.path)


def test_a_resumed_fine_tune_needs_the_same_head(trained, target4, corpus_dir, tmp_path):
    """The checkpoint records the head's content: a copy elsewhere resumes, another head is refused.
    A head with its own embedding keeps it frozen."""
    import shutil

    from safetensors.torch import save_file
    src = trained["eagle3"].path
    copy_dir, other = tmp_path / "copy", tmp_path / "other"
    shutil.copytree(src, copy_dir)
    shutil.copytree(src, other)
    w = load_file(other / "model.safetensors")
    a = read_checkpoint(target4).args
    w["embed_tokens.weight"] = torch.randn(a.vocab_size, a.hidden_size) * 0.1   # a head with its own embedding
    save_file(w, other / "model.safetensors")
    kw = dict(kind="eagle3", recipe=EagleRecipe(ttt_steps=2), data=EagleData(heldout_fraction=0.2),
              evaluation=EagleEval(prompts=0))
    part = train_eagle(target4, corpus_dir, tmp_path / "h", train_config=cfg(4), stop_at=2, init_head=src, **kw)
    assert part.state.step == 2
    with pytest.raises(ConfigError, match="other settings"):
        train_eagle(target4, corpus_dir, tmp_path / "h", train_config=cfg(4), resume=True, init_head=other, **kw)
    resumed = train_eagle(target4, corpus_dir, tmp_path / "h", train_config=cfg(4), resume=True,
                          init_head=copy_dir, **kw)
    assert resumed.state.step == 4
    t = load_model(read_checkpoint(target4), torch.float32, torch.device("cpu"), 256)
    from leapfrog.train.eagle import _head_to_tune
    head = _head_to_tune(other, t, torch.device("cpu"))
    assert head.embed is not None and not head.embed.weight.requires_grad
    assert all(p.requires_grad for n, p in head.named_parameters() if not n.startswith("embed"))


def test_generation_params_mix_temperatures():
    """Temperatures share the prompts evenly, not by place (prompt j of every file would always get
    the same one), and every prompt has its own seed."""
    sp = generation_params((0.0, 0.7, 1.0), 30, 32, seed=3)
    ts = [p.temperature for p in sp]
    assert sorted(ts) == [0.0] * 10 + [0.7] * 10 + [1.0] * 10
    assert ts != [(0.0, 0.7, 1.0)[i % 3] for i in range(30)]
    assert ts == [p.temperature for p in generation_params((0.0, 0.7, 1.0), 30, 32, seed=3)]
    assert ts != [p.temperature for p in generation_params((0.0, 0.7, 1.0), 30, 32, seed=4)]
    assert all(p.max_tokens == 32 for p in sp) and len({p.seed for p in sp}) == 30
    assert [p.temperature for p in generation_params(1.0, 2, 8, 0)] == [1.0, 1.0]
    for bad in ((), (0.5, -1.0), (float("nan"),)):
        with pytest.raises(ConfigError, match="gen_temperature"):
            generation_params(bad, 3, 8, 0)


def test_generated_samples_with_a_temperature_mix(target4, tokenizer, corpus_dir):
    """Each prompt is continued at its temperature (generation_params): the greedy ones are the
    greedy generation's samples, the sampled ones are not."""
    docs = read_documents(corpus_dir)[:3]
    kw = dict(gen_tokens=24, gen_prompt_tokens=12, gen_prompts_per_doc=2)
    greedy = generate_samples(str(target4), tokenizer, docs, EagleData(mode="generate", gen_temperature=0.0, **kw),
                              0, tokenizer.eos_token_id)
    mixed = generate_samples(str(target4), tokenizer, docs,
                             EagleData(mode="generate", gen_temperature=(0.0, 1.5), **kw), 0, tokenizer.eos_token_id)
    samples = [[d.stream[d.bounds[i]:d.bounds[i + 1]].tolist() for i in range(len(d.bounds) - 1)]
               for d in (greedy, mixed)]
    assert len(samples[0]) == len(samples[1]) == 6
    ts = [p.temperature for p in generation_params((0.0, 1.5), 6, 24, 0)]
    greedy_ones, sampled = [i for i in range(6) if ts[i] == 0], [i for i in range(6) if ts[i] > 0]
    assert len(greedy_ones) == len(sampled) == 3
    assert [samples[1][i] for i in greedy_ones] == [samples[0][i] for i in greedy_ones]
    assert all(samples[1][i] != samples[0][i] for i in sampled)


def test_resume_equals_a_straight_run(tmp_path, target4, corpus_dir):
    kw = dict(kind="eagle3", recipe=EagleRecipe(draft_vocab_size=200, ttt_steps=2),
              data=EagleData(heldout_fraction=0.2), evaluation=EagleEval(prompts=0))
    straight = train_eagle(target4, corpus_dir, tmp_path / "a", train_config=cfg(8), **kw)
    part = train_eagle(target4, corpus_dir, tmp_path / "b", train_config=cfg(8), stop_at=5, **kw)
    assert part.state.step == 5
    with pytest.raises(ConfigError, match="resume"):
        train_eagle(target4, corpus_dir, tmp_path / "b", train_config=cfg(8), **kw)
    with pytest.raises(ConfigError, match="other settings"):
        train_eagle(target4, corpus_dir, tmp_path / "b", train_config=cfg(8, lr=1e-3), resume=True, **kw)
    resumed = train_eagle(target4, corpus_dir, tmp_path / "b", train_config=cfg(8), resume=True, **kw)
    assert_resumed_like(straight, resumed, 8)


def test_token_id_corpus_trains_a_head_for_a_target_without_tokenizer(tmp_path, tokenizer, corpus_dir):
    target = save_random_llama(tmp_path / "t", None, seed=2, vocab_size=300, hidden_size=48, intermediate_size=96,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               initializer_range=0.2, tie_word_embeddings=False, eos_token_id=2)
    gen = torch.Generator().manual_seed(0)
    lines = [json.dumps({"token_ids": torch.randint(3, 300, (120,), generator=gen).tolist()}) for _ in range(6)]
    (tmp_path / "ids.jsonl").write_text("\n".join(lines) + "\n")
    res = train_eagle(target, tmp_path / "ids.jsonl", tmp_path / "head", "eagle3", train_config=cfg(4, seq_len=32),
                      recipe=EagleRecipe(draft_vocab_size=100, ttt_steps=2),
                      data=EagleData(mode="generate", gen_tokens=16, gen_prompt_tokens=8, heldout_fraction=0.3),
                      evaluation=EagleEval(prompts=2, max_tokens=8, trees=((2, 2, None),)), save_dtype="bfloat16")
    assert res.state.step == 4 and res.acceptance[0]["num_drafts"] > 0
    assert load_file(res.path / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="token ids"):
        train_eagle(target, corpus_dir, tmp_path / "head2", "eagle3", train_config=cfg(2))


def test_cli_train_draft_eagle3(tmp_path, target4, corpus_dir, capsys):
    out = tmp_path / "cli_head"
    rc = main(["train-draft", str(target4), "--method", "eagle3", "--corpus", str(corpus_dir), "--out", str(out),
               "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--ttt-steps", "2", "--draft-vocab-size", "128",
               "--eval-prompts", "1", "--eval-max-tokens", "8", "--save-dtype", "bfloat16",
               "--json", str(tmp_path / "s.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "mean acceptance length" in text and "greedy calibration" in text
    hint = text[text.index("--speculative-config '") + len("--speculative-config '"):].split("'")[0]
    assert json.loads(hint) == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 5, "eagle_topk": 4}
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 2
    # a second run needs --resume; with it, a finished run only saves and evaluates again
    assert main(["train-draft", str(target4), "--method", "eagle3", "--corpus", str(corpus_dir), "--out", str(out),
                 "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-prompts", "0"]) == 2
    assert main(["train-draft", str(target4), "--method", "eagle", "--corpus", str(corpus_dir), "--out", str(out),
                 "--draft-vocab-size", "100"]) == 2


def test_cli_fine_tunes_a_head_on_a_temperature_mix(trained, tmp_path, target4, corpus_dir, capsys):
    src = str(trained["eagle3"].path)
    out = tmp_path / "tuned"
    base = ["train-draft", str(target4), "--method", "eagle3", "--corpus", str(corpus_dir), "--steps", "2",
            "--batch-size", "2", "--seq-len", "32", "--eval-prompts", "0", "--init-draft", src]
    assert main(base + ["--out", str(out), "--data-mode", "generate", "--gen-tokens", "16",
                        "--gen-temperature", "0", "1.0", "--json", str(tmp_path / "s.json")]) == 0
    settings = json.loads((out / "train_eagle.json").read_text())["settings"]
    assert settings["init_head"] == head_fingerprint(src) and settings["data"]["gen_temperature"] == [0.0, 1.0]
    assert (out / "model.safetensors").is_file()
    capsys.readouterr()
    # refused before any data is made: shape flags with a head to tune, a head of the other kind
    assert main(base + ["--out", str(tmp_path / "x"), "--draft-vocab-size", "64"]) == 2
    assert "keeps its own shape" in capsys.readouterr().err
    assert main([*base[:3], "eagle", *base[4:], "--out", str(tmp_path / "y")]) == 2
    assert "eagle3 head" in capsys.readouterr().err
    assert not (tmp_path / "x.ckpt").exists() and not (tmp_path / "y.ckpt").exists()
    # draft_model: a draft to fine-tune keeps its shape too (the flags were silently dropped before)
    assert main(["train-draft", str(target4), "--corpus", str(corpus_dir), "--out", str(tmp_path / "z"),
                 "--init-draft", str(target4), "--hidden-size", "32"]) == 2
    assert "keeps its own shape" in capsys.readouterr().err and not (tmp_path / "z").exists()


def test_cli_draft_model_hint_names_k(tmp_path, target4, corpus_dir, capsys):
    out = tmp_path / "draft"
    assert main(["train-draft", str(target4), "--corpus", str(corpus_dir), "--out", str(out), "--steps", "1",
                 "--batch-size", "2", "--seq-len", "32", "--hidden-size", "32", "--intermediate-size", "64",
                 "--num-layers", "1", "--num-heads", "2", "--eval-prompts", "0", "--eval-k", "3"]) == 0
    text = capsys.readouterr().out
    hint = text[text.index("--speculative-config '") + len("--speculative-config '"):].split("'")[0]
    assert json.loads(hint) == {"method": "draft_model", "model": str(out), "num_speculative_tokens": 3}
