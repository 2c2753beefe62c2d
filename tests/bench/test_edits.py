"""The built-in prediction / suffix workloads (bench/edits.py) made from the demo model's held-out
standard-library files: what each item's prompt and prediction are."""

from __future__ import annotations

import difflib
import random

import pytest

from leapfrog.bench.edits import builtin_workload, edit_lines
from leapfrog.demo import DEMO_DIR
from leapfrog.errors import ConfigError


def test_edit_lines_changes_that_many_lines():
    lines = [f"value_{i} = compute_{i}(x)\n" for i in range(30)]
    for n in (0, 1, 3):
        out = edit_lines(lines, n, random.Random(n))
        changed = sum(1 for op in difflib.ndiff(lines, out) if op[0] in "+-")
        assert (changed == 0) if n == 0 else (n <= changed <= 2 * n)


def test_rewrite_items_predict_the_real_continuation_with_edits():
    plain = builtin_workload("rewrite", DEMO_DIR, limit=4)
    shown = builtin_workload("rewrite-shown", DEMO_DIR, limit=4)
    assert len(plain) == len(shown) >= 3
    for a, b in zip(plain, shown):
        assert a.prediction == b.prediction and a.prediction
        assert b.prompt.endswith(a.prompt) and len(b.prompt) > 2 * len(a.prompt)
        # the shown original and the prediction differ only in the edited lines
        original = b.prompt[len(a.prompt):-len(a.prompt) - 2]
        assert 0.8 < difflib.SequenceMatcher(None, original, a.prediction).ratio() < 1.0


def test_variations_rename_parameters_and_unknown_names_are_refused():
    items = builtin_workload("variations", DEMO_DIR, limit=8)
    assert len(items) == 8
    assert items[0].prompt != items[1].prompt and items[1].prompt.count("_1") >= 2
    with pytest.raises(ConfigError, match="unknown built-in workload"):
        builtin_workload("rewrites", DEMO_DIR)
