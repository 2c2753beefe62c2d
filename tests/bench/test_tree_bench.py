"""benchmarks/tree_bench.py's contender list: indices stay where earlier runs' ``--only`` put them,
and ``--compare-head`` compares the heads on the same chains, quantized alike."""

from __future__ import annotations

import pytest


@pytest.fixture
def tree_bench(load_script):
    return load_script("benchmarks/tree_bench.py")


def test_the_compare_head_runs_the_same_depths_quantized_alike(tree_bench):
    specs = tree_bench.contenders("D", "H", 4, "C", [7], "w8a8", [7])
    # indices 0..9 and the head's own chains and "auto" sizes stay where they were
    assert specs[8]["model"] == specs[9]["model"] == "C" and specs[8]["num_speculative_tokens"] == 5
    assert specs[10] == {"method": "eagle3", "model": "H", "num_speculative_tokens": 7, "eagle_topk": 1}
    assert specs[11]["num_draft_tokens"] == "auto" and specs[11]["model"] == "H"
    assert specs[12] == {"method": "eagle3", "model": "C", "num_speculative_tokens": 7, "eagle_topk": 1}
    assert specs[13] == {**specs[11], "model": "C"}
    plain = [s for s in specs if "draft_quantization" not in s and s["method"] == "eagle3"]
    quantized = [s for s in specs if s.get("draft_quantization") == "w8a8"]
    assert quantized == [{**s, "draft_quantization": "w8a8"} for s in plain]   # both heads', same order
    assert quantized[-2:] == [{**specs[12], "draft_quantization": "w8a8"}, {**specs[13], "draft_quantization": "w8a8"}]


def test_without_a_compare_head_nothing_moves(tree_bench):
    specs = tree_bench.contenders("D", "H", 4, None, [7], "w8a8", [7])
    assert len(specs) == 10 + 6   # 8 + the chain and "auto" of 7, then the head's 6 quantized
    assert all(s.get("model") != "C" for s in specs)
    assert specs[8]["num_speculative_tokens"] == 7 and specs[9]["num_draft_tokens"] == "auto"
