"""benchmarks/controller_bench.py: a recorded run's controller calls replay on a fresh controller to
the same return values (with either confidence model), and a replay that returns otherwise is
reported, not timed as if it were that run."""

from __future__ import annotations

import json

import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.demo import DEMO_DIR
from leapfrog.spec_decode.native_confidence import load_native_confidence

pytestmark = pytest.mark.skipif(not load_native_confidence(), reason="the C++ confidence model did not build here")


@pytest.fixture
def controller_bench(load_script):
    return load_script("benchmarks/controller_bench.py")


def test_the_bench_replays_each_run_to_the_same_choices(controller_bench, tmp_path):
    rc = controller_bench.main(["--batch-sizes", "1", "2", "--num-prompts", "2", "--max-tokens", "24",
                                "--depth", "4", "--topk", "2", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "controller_bench.json").read_text())["results"]
    assert [r["batch_size"] for r in results] == [1, 2]
    for r in results:
        rows = r["contenders"]
        assert set(rows) == {"auto (C++ model)", "auto (Python model)", "chain of 4"}
        assert all(row["mismatches"] == 0 and row["steps"] > 0 for row in rows.values())
        assert rows["auto (C++ model)"]["calls"] == rows["auto (Python model)"]["calls"]   # (one trace)
        assert rows["auto (C++ model)"]["us_per_call"]["observe"] > 0


def test_a_replay_that_chooses_otherwise_is_counted(controller_bench):
    head = {"method": "eagle3", "model": str(DEMO_DIR / "eagle3"), "num_speculative_tokens": 4,
            "eagle_topk": 2, "num_draft_tokens": "auto"}
    llm = LLM(str(DEMO_DIR / "target"), speculative_config=head)
    trace = controller_bench.record(llm, ["def add(a, b):\n", "class Stack:\n"], SamplingParams(max_tokens=16), 1)
    assert controller_bench.replay(trace, "native")[1] == 0
    first = next(i for i, c in enumerate(trace.calls) if c[0] == "choose")
    name, args, kwargs, out, stop = trace.calls[first]
    trace.calls[first] = (name, args, kwargs, [k + 1 for k in out], stop)
    assert controller_bench.replay(trace, "python")[1] >= 1
