"""leapfrog bench on the tiny model: ngram K=2 and K=4 vs none, 2 categories, batch sizes 1 and 2."""

from __future__ import annotations

import csv
import json

import pytest

from leapfrog.bench.runner import (CSV_FIELDS, MIN_CI_REPEATS, contender_name, format_peers, format_recommendation,
                                   format_table, run_bench, t_interval)
from leapfrog.bench.workloads import WorkloadItem
from leapfrog.entrypoints.cli import main

NG2 = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
NG4 = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}

ITEMS = [
    WorkloadItem("code", "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(", None, "c0"),
    WorkloadItem("code", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a", None, "c1"),
    WorkloadItem("chat", None, [{"role": "user", "content": "import os\nimport sys\nimport os\n"}], "m0"),
    WorkloadItem("chat", None, [{"role": "user", "content": "x = [1, 2]\ny = [1, 2]\n"}], "m1"),
]


@pytest.fixture(scope="module")
def bench(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = run_bench(str(llama_dir), [NG2, NG4], ITEMS, temperatures=[0.0], max_tokens=8, batch_sizes=[1, 2],
                    repeats=2, warmup=1, out_dir=out, dtype="float32", threads=None, progress=False)
    return res, out


def test_outputs_and_fields(bench):
    res, out = bench
    assert list(res.contenders) == ["none", "ngram-k2", "ngram-k4"]
    for f in ["bench.json", "bench.csv", "speedup_by_category.png", "speedup_vs_k.png", "speedup_vs_batch.png",
              "acceptance_by_position.png"]:
        assert (out / f).stat().st_size > 0, f
    data = json.loads((out / "bench.json").read_text())
    assert set(data) >= {"rows", "run_counts", "recommendations", "contenders", "settings", "files"}
    rows = list(csv.DictReader(open(out / "bench.csv")))
    assert list(rows[0]) == CSV_FIELDS
    # 3 contenders x (2 categories + all) x 1 temperature x 2 batch sizes
    assert len(rows) == len(data["rows"]) == 3 * 3 * 2
    assert {r["category"] for r in rows} == {"code", "chat", "all"}
    assert {r["batch_size"] for r in rows} == {"1", "2"}
    for r in data["rows"]:
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
        assert r["latency_p50_s"] <= r["latency_p99_s"] and r["ttft_mean_s"] > 0
        # 2 repeats are too few for a t-interval (t = 12.7): none is given
        assert len(r["speedup_repeats"]) == 2 and r["speedup_ci_low"] is None and r["speedup_ci_high"] is None
        if r["contender"] == "none":
            assert r["speedup"] == 1.0 and r["acceptance_rate"] is None
    spec_all = res.row("ngram-k4", "all", 0.0, 1)
    assert spec_all["num_draft_tokens"] > 0, "the repetitive prompts should give the n-gram drafter matches"
    assert 0 <= spec_all["acceptance_rate"] <= 1 and spec_all["mean_acceptance_length"] >= 1
    assert 1 <= len(spec_all["acceptance_by_position"]) <= 4
    recs = {(r["batch_size"], r["category"]) for r in res.recommendations}
    assert recs == {(b, c) for b in (1, 2) for c in ("code", "chat", "all")}
    assert all(r["best"] in res.contenders for r in res.recommendations)


def test_interleaving_counts(bench):
    res, _ = bench
    # per batch size: repeats x batches (bs 1: 4, bs 2: 2) for every contender, the same count each
    assert res.run_counts == {"none": 12, "ngram-k2": 12, "ngram-k4": 12}


def test_greedy_equality(bench):
    res, _ = bench
    for r in res.rows:
        assert r["equal_rate"] == 1.0, r


def test_table_and_recommendation_text(bench):
    res, _ = bench
    table = format_table(res)
    assert "ngram-k4" in table and "speedup" in table
    assert "too few to give one" in table and f"--repeats {MIN_CI_REPEATS}" in table
    rec = format_recommendation(res)
    assert rec.startswith("Recommendation") and "none 12, ngram-k2 12, ngram-k4 12" in rec


def test_cli_bench(llama_dir, tmp_path, capsys):
    wl = tmp_path / "mine.jsonl"
    wl.write_text("".join(json.dumps({"prompt": it.prompt, "category": "code"}) + "\n" for it in ITEMS[:2]))
    rc = main(["bench", "--model", str(llama_dir), "--speculative-config", json.dumps(NG2), "--workload", str(wl),
               "--max-tokens", "4", "--repeats", "1", "--warmup", "0", "--dtype", "float32",
               "--out", str(tmp_path / "out"), "--no-plots"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Recommendation" in text and "ngram-k2" in text
    assert (tmp_path / "out" / "bench.csv").exists()
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["settings"]["enforce_eager"] is True
    rc = main(["bench", "--model", str(llama_dir), "--speculative-config", json.dumps(NG2), "--workload", str(wl),
               "--max-tokens", "4", "--repeats", "1", "--warmup", "0", "--dtype", "float32", "--batch-size", "1",
               "--continuous", "--share-target", "--out", str(tmp_path / "cont"), "--no-plots"])
    settings = json.loads((tmp_path / "cont" / "bench.json").read_text())["settings"]
    assert rc == 0 and settings["continuous"] is True and settings["share_target"] is True
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["settings"]["share_target"] is True   # (default)
    rc = main(["bench", "--model", str(llama_dir), "--speculative-config", json.dumps(NG2), "--workload", str(wl),
               "--max-tokens", "4", "--repeats", "1", "--warmup", "0", "--dtype", "float32", "--no-share-target",
               "--out", str(tmp_path / "copies"), "--no-plots"])
    settings = json.loads((tmp_path / "copies" / "bench.json").read_text())["settings"]
    assert rc == 0 and settings["share_target"] is False and settings["own_target"] == ["ngram-k2"]


def test_cli_bad_input(llama_dir, tmp_path, capsys):
    rc = main(["bench", "--model", str(llama_dir), "--speculative-config", json.dumps(NG2),
               "--workload", str(tmp_path / "missing.jsonl")])
    assert rc == 2
    assert "workload file not found" in capsys.readouterr().err
    rc = main(["bench", "--model", str(llama_dir), "--speculative-config", "{bad", "--workload", "x"])
    assert rc == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_odd_workloads_and_values_are_named(llama_dir):
    """Empty prompts are called empty (they were 'longer than max_model_len'); a NaN temperature is
    refused before any contender loads (the model path does not even exist)."""
    from leapfrog.errors import ConfigError
    said = []
    with pytest.raises(ConfigError, match="no workload item to run: 1 empty, 0 longer"):
        run_bench(str(llama_dir), [NG2], [WorkloadItem("code", "", None, "e0")], max_tokens=4, log=said.append)
    assert any("whose prompt is empty (e.g. e0)" in s for s in said)
    with pytest.raises(ConfigError, match="temperatures must be finite"):
        run_bench("/nonexistent", [NG2], ITEMS, temperatures=[float("nan")], max_tokens=4, log=said.append)


def test_transformers_backend_side_by_side(llama_dir, draft_dir, tmp_path):
    dm = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}
    res = run_bench(str(llama_dir), [NG2, dm], ITEMS[:2], temperatures=[0.0], max_tokens=8, batch_sizes=[1],
                    repeats=2, warmup=1, out_dir=tmp_path, dtype="float32", progress=False,
                    backends=["leapfrog", "transformers"])
    assert list(res.contenders) == ["none", "ngram-k2", "draft_model-k2", "hf-none", "hf-prompt_lookup-k2",
                                    "hf-assisted-k2"]
    assert len(set(res.run_counts.values())) == 1          # every contender ran the same number of times
    # transformers' greedy output is ours token for token (fp32, same checkpoint)
    for n in ("hf-none", "hf-prompt_lookup-k2", "hf-assisted-k2"):
        assert res.row(n, "all", 0.0, 1)["equal_rate"] == 1.0, n
        assert res.row(n, "all", 0.0, 1)["tokens_per_s"] > 0
    pairs = {(r["leapfrog"], r["transformers"]) for r in res.peer_ratios if r["category"] == "all"}
    assert pairs == {("none", "hf-none"), ("ngram-k2", "hf-prompt_lookup-k2"), ("ngram-k2", "hf-none"),
                     ("draft_model-k2", "hf-assisted-k2"), ("draft_model-k2", "hf-none")}
    assert all(r["ratio"] > 0 for r in res.peer_ratios)
    assert not any(r["best"].startswith("hf-") for r in res.recommendations)
    assert "leapfrog vs transformers" in format_peers(res)
    assert json.loads((tmp_path / "bench.json").read_text())["peer_ratios"]


def test_seeded_requests_give_every_contender_the_same_sampled_output(llama_dir):
    """request_seed: sampled requests are seeded per item, so speculation (verified by matching)
    must reproduce the plain sampled output exactly; unseeded sampled outputs are not compared."""
    kw = dict(temperatures=[0.9], max_tokens=8, batch_sizes=[2], repeats=1, warmup=0, out_dir=None, dtype="float32",
              progress=False)
    seeded = run_bench(str(llama_dir), [NG2], ITEMS, request_seed=7, **kw)
    assert seeded.settings["request_seed"] == 7
    assert all(r["equal_rate"] == 1.0 for r in seeded.rows), seeded.rows
    unseeded = run_bench(str(llama_dir), [NG2], ITEMS, **kw)
    assert all(r["equal_rate"] is None for r in unseeded.rows)
    # transformers peers run unseeded beside them (leapfrog's seeds mean nothing to them)
    both = run_bench(str(llama_dir), [NG2], ITEMS[:2], request_seed=7, backends=["leapfrog", "transformers"], **kw)
    assert {r["contender"]: r["equal_rate"] for r in both.rows if r["category"] == "all"} == {
        "none": 1.0, "ngram-k2": 1.0, "hf-none": None, "hf-prompt_lookup-k2": None}


def test_unknown_backend_is_an_error(llama_dir):
    from leapfrog.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown backend"):
        run_bench(str(llama_dir), [NG2], ITEMS[:1], backends=["vllm"], out_dir=None, progress=False)


def test_prediction_and_suffix_contenders(llama_dir, tmp_path):
    """Predicted-output contenders (the item's prediction; the target's own output with a renamed
    identifier) and suffix decoding side by side: outputs equal none's, prediction usage and
    similarity reported, an exact prediction accepted in full."""
    from leapfrog.bench.runner import split_contender
    items = [WorkloadItem("edit", p, None, f"e{i}", prediction=p) for i, p in enumerate(
        ["def add(a, b):\n    return a + b\n", "for i in range(3):\n    print(i)\n"])]
    specs = [{"prediction": "item"}, {"prediction": "own", "changed_lines": 0},
             {"prediction": "own", "changed_lines": 1}, {"method": "suffix", "num_speculative_tokens": 8}]
    res = run_bench(str(llama_dir), specs, items, max_tokens=16, repeats=1, warmup=0, out_dir=tmp_path,
                    dtype="float32", progress=False, plots=False)
    assert list(res.contenders) == ["none", "prediction-item", "prediction-own-c0", "prediction-own-c1",
                                    "suffix-k8"]
    for name in res.contenders:
        assert res.row(name)["equal_rate"] == 1.0
    exact = res.row("prediction-own-c0")
    assert exact["prediction_similarity"] == 1.0 and exact["rejected_prediction_tokens"] == 0
    assert exact["accepted_prediction_tokens"] > 0 and exact["acceptance_rate"] == 1.0
    assert 0 <= res.row("prediction-item")["prediction_similarity"] <= 1
    assert "predicted outputs" in format_table(res)
    assert split_contender({"prediction": "item", "method": "ngram", "num_speculative_tokens": 2}) == (
        {"method": "ngram", "num_speculative_tokens": 2}, "item", 0)
    with pytest.raises(Exception, match="changed_lines"):
        split_contender({"prediction": "item", "changed_lines": 2})
    with pytest.raises(Exception, match="without a prediction"):
        run_bench(str(llama_dir), [{"prediction": "item"}], ITEMS[:1], max_tokens=4, repeats=1, warmup=0,
                  out_dir=None, dtype="float32", progress=False)


def test_t_interval_needs_enough_repeats():
    assert t_interval([1.5, 1.6]) == (None, None)
    lo, hi = t_interval([1.5, 1.6, 1.55])
    assert 1.4 < lo < 1.55 < hi < 1.7      # brackets the geometric mean, stays near it
    lo2, hi2 = t_interval([1.5, 1.6, 1.55] * 4)
    assert lo < lo2 < hi2 < hi             # more repeats, narrower
    assert t_interval([1.5, None, float("nan"), 1.6]) == (None, None)   # bad values do not count


def test_no_enforce_eager_loads_every_contender_on_the_fast_path(llama_dir, tmp_path, monkeypatch):
    """`leapfrog bench --no-enforce-eager` hands enforce_eager=False to every contender's LLM (the
    LLM here records it and loads eagerly, to keep the test fast) and records it in bench.json."""
    import leapfrog
    seen, real = [], leapfrog.LLM

    class Recording(real):   # (a subclass: the runner also calls LLM.sharing_if_possible)
        def __init__(self, *args, enforce_eager=True, num_scheduler_steps=1, **kw):
            seen.append((enforce_eager, num_scheduler_steps))
            super().__init__(*args, **kw)
    monkeypatch.setattr(leapfrog, "LLM", Recording)
    wl = tmp_path / "mine.jsonl"
    wl.write_text(json.dumps({"prompt": ITEMS[0].prompt}) + "\n")
    args = ["bench", "--model", str(llama_dir), "--speculative-config", json.dumps(NG2), "--workload", str(wl),
            "--max-tokens", "2", "--repeats", "1", "--warmup", "0", "--dtype", "float32", "--no-enforce-eager",
            "--out", str(tmp_path / "out"), "--no-plots"]
    assert main(args) == 0 and seen == [(False, 1), (False, 1)]
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["settings"]["enforce_eager"] is False
    # with --num-scheduler-steps: none and the contenders that can run rounds (a draft model) get
    # it, the others (ngram) run one round per step
    seen.clear()
    draft = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 2}
    assert main(args + ["--speculative-config", json.dumps(draft), "--num-scheduler-steps", "4"]) == 0
    assert seen == [(False, 4), (False, 1), (False, 4)]
    settings = json.loads((tmp_path / "out" / "bench.json").read_text())["settings"]
    assert settings["num_scheduler_steps"] == 4 and settings["multi_step"] == ["none", "draft_model-k2"]


def test_contender_names_tell_two_drafters_apart():
    """Two heads with the same settings (tree_bench --compare-head) are named by their folder and its parent."""
    taken: set[str] = set()
    names = []
    for spec in (None, {"method": "eagle3", "model": "/a/eagle3", "num_speculative_tokens": 5, "eagle_topk": 1},
                 {"method": "eagle3", "model": "/b/tuned", "num_speculative_tokens": 5, "eagle_topk": 1},
                 {"method": "eagle3", "model": "/b/tuned", "num_speculative_tokens": 5, "eagle_topk": 1,
                  "min_draft_confidence": 0.3}):
        names.append(contender_name(spec, taken))
        taken.add(names[-1])
    assert names == ["none", "eagle3-k5-topk1", "eagle3-k5-topk1@b/tuned",
                     "eagle3-k5-topk1@b/tuned-min_draft_confidence=0.3"]
    # the same head quantized (tree_bench --head-quantization) is named by its draft_quantization
    spec = {"method": "eagle3", "model": "/a/eagle3", "num_speculative_tokens": 5, "eagle_topk": 1}
    assert contender_name({**spec, "draft_quantization": "w8a8"}, taken) == "eagle3-k5-topk1-w8a8"


def test_continuous_batching_runs_each_category_in_one_call_at_most_the_batch_size_at_a_time(llama_dir,
                                                                                             monkeypatch):
    """--continuous: each category's items go to each engine in one call, the scheduler running
    at most batch_size of them at a time (a finished request's place goes to the next waiting);
    the outputs are the static batches' (greedy), and the engine's own limit is back afterwards."""
    from leapfrog.engine.engine import LLMEngine
    from leapfrog.errors import ConfigError
    running: list[int] = []
    orig = LLMEngine.step

    def step(self, *a, **kw):
        out = orig(self, *a, **kw)
        running.append(len(self.scheduler.running) + len(out))
        return out

    monkeypatch.setattr(LLMEngine, "step", step)
    items = [WorkloadItem("code", f"x{i} = {i}\ny{i} = x{i} + 1\nx{i} = {i}\n", None, f"c{i}") for i in range(5)]
    res = run_bench(str(llama_dir), [NG2], items, temperatures=[0.0], max_tokens=6, batch_sizes=[2], repeats=1,
                    warmup=0, out_dir=None, dtype="float32", progress=False, continuous=True)
    assert res.run_counts == {"none": 1, "ngram-k2": 1} and res.settings["continuous"] is True
    assert max(running) == 2 and running.count(2) > 2
    static = run_bench(str(llama_dir), [NG2], items, temperatures=[0.0], max_tokens=6, batch_sizes=[2], repeats=1,
                       warmup=0, out_dir=None, dtype="float32", progress=False)
    assert static.run_counts == {"none": 3, "ngram-k2": 3}
    for r in res.rows:
        assert r["equal_rate"] == 1.0 and r["tokens_per_s"] > 0
    with pytest.raises(ConfigError, match="continuous batching"):
        run_bench(str(llama_dir), [NG2], items, backends=["leapfrog", "transformers"], out_dir=None,
                  progress=False, continuous=True)


def test_running_at_most_restores_the_engines_limit_even_on_error():
    from types import SimpleNamespace

    from leapfrog.bench.runner import _running_at_most
    llm = SimpleNamespace(engine=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8)))
    with pytest.raises(RuntimeError):
        with _running_at_most(llm, 2):
            assert llm.engine.scheduler.max_num_seqs == 2
            raise RuntimeError("a failed generate")
    assert llm.engine.scheduler.max_num_seqs == 8
    with _running_at_most(llm, 32):   # never above what the engine was built for
        assert llm.engine.scheduler.max_num_seqs == 8


def test_adaptive_goal_compares_with_the_same_drafters_fixed_settings():
    from leapfrog.bench.runner import adaptive_vs_fixed, format_adaptive
    head = {"method": "eagle3", "model": "h"}
    contenders = {
        "none": None,
        "c5": {**head, "num_speculative_tokens": 5, "eagle_topk": 1},
        "c7": {**head, "num_speculative_tokens": 7, "eagle_topk": 1},
        "c7-w8a8": {**head, "num_speculative_tokens": 7, "eagle_topk": 1, "draft_quantization": "w8a8"},
        "auto": {**head, "num_speculative_tokens": 10, "eagle_topk": 4, "num_draft_tokens": "auto"},
        "dm": {"method": "draft_model", "model": "d", "num_speculative_tokens": 4},
        "dm-adaptive": {"method": "draft_model", "model": "d", "num_speculative_tokens": 4, "adaptive": True},
        "ngram-adaptive": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True},   # no fixed sibling
        "hf-eagle3-k7": {**head, "num_speculative_tokens": 7, "eagle_topk": 1},   # transformers' counterpart
    }
    speed = {"none": 1.0, "c5": 1.5, "c7": 2.0, "c7-w8a8": 3.0, "auto": 1.9, "dm": 1.2, "dm-adaptive": 1.3,
             "ngram-adaptive": 1.1, "hf-eagle3-k7": 9.0}
    rows = [{"contender": n, "category": c, "temperature": 0.0, "batch_size": 4, "speedup": v}
            for n, v in speed.items() for c in ("all", "code")]
    rows.append({"contender": "auto", "category": "all", "temperature": 0.7, "batch_size": 4, "speedup": 0.9})
    goal = adaptive_vs_fixed(rows, contenders)
    assert [(g["contender"], g["temperature"]) for g in goal] == [("auto", 0.0), ("dm-adaptive", 0.0)]
    auto, dm = goal
    # the best of the same head, same quantization, not transformers' counterpart nor the w8a8 chain
    assert auto["best_fixed"] == "c7" and auto["vs_best_fixed"] == pytest.approx(0.95)
    assert dm["best_fixed"] == "dm" and dm["vs_best_fixed"] == pytest.approx(1.3 / 1.2)
    text = format_adaptive(goal, vs_best=0.96)
    assert "auto: 0 of 1 cells" in text and "dm-adaptive: 1 of 1 cells" in text and text.count("(short)") == 1
    assert format_adaptive([]) == ""


def test_share_target_loads_the_target_once(llama_dir, monkeypatch):
    from leapfrog.engine import engine as engine_module
    loads = []
    real = engine_module.load_model
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    kw = dict(temperatures=[0.0], max_tokens=6, batch_sizes=[2], repeats=1, warmup=0, out_dir=None,
              dtype="float32", progress=False)
    res = run_bench(str(llama_dir), [NG2, NG4], ITEMS, share_target=True, **kw)
    assert len(loads) == 1 and res.settings["share_target"] and res.settings["own_target"] == []
    assert all(r["equal_rate"] == 1.0 for r in res.rows if r["contender"] != "none")
    res = run_bench(str(llama_dir), [NG2], ITEMS[:2], share_target=False, **kw)
    assert len(loads) == 3 and not res.settings["share_target"]   # one copy per engine without it
    assert res.settings["own_target"] == ["ngram-k2"]
    res = run_bench(str(llama_dir), [NG2], ITEMS[:2], **kw)   # the default: shared where allowed
    assert len(loads) == 4 and res.settings["share_target"]


def test_share_target_by_default_falls_back_to_a_copy_where_refused(llama_dir, monkeypatch):
    """Where the engine refuses to share (engine.check_shareable: e.g. a target that streams its
    weights), the default loads that contender's own copy and says so; share_target=True is refused."""
    from leapfrog.engine import engine as engine_module
    from leapfrog.errors import ConfigError, NotShareable

    def refuse(owner, engine):
        raise NotShareable(engine_module._STREAMING_SHARE)
    monkeypatch.setattr(engine_module, "check_shareable", refuse)
    loads, said = [], []
    real = engine_module.load_model
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    kw = dict(temperatures=[0.0], max_tokens=4, batch_sizes=[1], repeats=1, warmup=0, out_dir=None,
              dtype="float32", progress=False, log=said.append)
    res = run_bench(str(llama_dir), [NG2], ITEMS[:2], **kw)
    assert len(loads) == 2 and res.settings["own_target"] == ["ngram-k2"] and not res.settings["share_target"]
    assert any("ngram-k2 loads its own copy of the target" in s and "streams its weights" in s for s in said)
    assert all(r["equal_rate"] == 1.0 for r in res.rows if r["contender"] != "none")
    with pytest.raises(ConfigError, match="streams its weights"):
        run_bench(str(llama_dir), [NG2], ITEMS[:2], share_target=True, **kw)


def test_greedy_share_mixes_greedy_and_sampled_requests_in_one_batch(llama_dir, monkeypatch, capsys):
    """greedy_share: in a cell of T > 0 that share of the items runs greedy (the same items in every
    contender), the rest sampled, in the same batches; the greedy ones are compared with none's."""
    from leapfrog import LLM
    from leapfrog.bench.runner import greedy_item
    from leapfrog.errors import ConfigError
    assert [i for i in range(8) if greedy_item(i, 0.5)] == [1, 3, 5, 7]
    assert [i for i in range(8) if greedy_item(i, 0.25)] == [3, 7]
    assert not any(greedy_item(i, 0.0) for i in range(8)) and all(greedy_item(i, 1.0) for i in range(8))
    temps: list[list[float]] = []
    orig = LLM.generate

    def generate(self, prompts, params=None, **kw):
        temps.append([p.temperature for p in params] if isinstance(params, list) else [params.temperature])
        return orig(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", generate)
    items = [WorkloadItem("code", f"x{i} = {i}\ny{i} = x{i} + 1\nx{i} = {i}\n", None, f"c{i}") for i in range(4)]
    res = run_bench(str(llama_dir), [NG2], items, temperatures=[0.0, 0.8], max_tokens=6, batch_sizes=[4], repeats=1,
                    warmup=0, out_dir=None, dtype="float32", progress=False, greedy_share=0.5)
    assert temps == [[0.0], [0.0], [0.8, 0.0, 0.8, 0.0], [0.8, 0.0, 0.8, 0.0]]
    assert res.settings["greedy_share"] == 0.5
    for r in res.rows:
        assert r["greedy_share"] == (0.5 if r["temperature"] > 0 else 0.0)
        assert r["equal_rate"] == 1.0   # greedy items only at T = 0.8: their outputs equal none's
    assert "50% of the requests run greedy" in format_table(res)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="greedy share"):
            run_bench(str(llama_dir), [NG2], items, greedy_share=bad, out_dir=None, progress=False)
    with pytest.raises(ConfigError, match="mixed load"):
        run_bench(str(llama_dir), [NG2], items, greedy_share=0.5, backends=["leapfrog", "transformers"],
                  out_dir=None, progress=False)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", str(llama_dir), "--greedy-share", "2"])
    assert e.value.code == 2 and "--greedy-share: 2.0: must be in [0, 1]" in capsys.readouterr().err


def test_share_target_by_default_gives_a_streaming_target_its_own_copy(llama_dir, draft_dir, monkeypatch):
    """The refusal that comes late (engine.py: a drafter beside a target larger than the cache,
    which streams its weights): by default that contender runs on its own, streaming copy and none's
    shared model is left as it was."""
    import torch

    from leapfrog.model import native_linear
    if not native_linear.native_linear_supported(torch.bfloat16, "cpu"):
        pytest.skip("no bf16 linear kernel on this CPU (nothing streams)")
    monkeypatch.setattr(native_linear, "last_level_cache_bytes", lambda: 1)
    monkeypatch.setattr(native_linear, "kernel_streams", lambda: True)   # (as on AVX-512 builds)
    monkeypatch.delenv("LEAPFROG_STREAM_WEIGHTS", raising=False)
    said = []
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}
    res = run_bench(str(llama_dir), [spec], ITEMS[:2], temperatures=[0.0], max_tokens=4, batch_sizes=[1], repeats=1,
                    warmup=0, out_dir=None, dtype="bfloat16", max_model_len=128, progress=False, log=said.append)
    assert res.settings["own_target"] == ["draft_model-k2"] and not res.settings["share_target"]
    assert any("draft_model-k2 loads its own copy" in s and "streams its weights" in s for s in said)
    assert all(r["equal_rate"] == 1.0 for r in res.rows if r["contender"] != "none")


def test_each_contender_runs_first_and_right_after_each_other_equally_often():
    """run_order: a balanced Latin square, so position and carry-over (an engine's first steps pay
    for the caches the one before it left) fall on all contenders alike; the rotation by one it
    replaced put the same contender before each one in every repeat."""
    from collections import Counter
    from leapfrog.bench.runner import run_order
    for n in range(2, 7):
        names = [f"c{i}" for i in range(n)]
        rows = [run_order(names, r) for r in range(n if n % 2 == 0 else 2 * n)]
        assert all(sorted(row) == names for row in rows)
        firsts = Counter(row[0] for row in rows)
        pairs = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
        assert set(firsts.values()) == {len(rows) // n}, n
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1, (n, pairs)
    # two repeats of none, two chains and "auto": "auto" no longer right after the same one
    rows = [run_order(["none", "c5", "c7", "auto"], r) for r in range(2)]
    before = {row[row.index("auto") - 1] for row in rows if row.index("auto") > 0}
    assert len(before) == 2 or any(row[0] == "auto" for row in rows)
