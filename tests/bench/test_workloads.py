"""Each workload loader reads a small fixture in its format (made here, not from /work/shared)."""

from __future__ import annotations

import gzip
import json

import pytest

from leapfrog.bench.workloads import WorkloadItem, load_workload
from leapfrog.errors import LeapfrogError


def _write(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_spec_bench_turns(tmp_path):
    p = _write(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 161, "category": "translation", "turns": ["Translate: Hallo"]},
        {"question_id": 162, "category": "translation", "turns": ["Translate: Welt"], "reference": ["world"]}])
    items = load_workload(p)
    assert items[0] == WorkloadItem("writing", None, [{"role": "user", "content": "Write a poem."}], "81")
    assert [i.category for i in items] == ["writing", "translation", "translation"]
    assert [i.id for i in load_workload(p, limit=1)] == ["81", "161"]   # limit is per category


def test_mt_bench_and_cnn_dm_and_eagle(tmp_path):
    (tmp_path / "alpaca").mkdir()
    mt = _write(tmp_path / "mt.jsonl", [{"question_id": 1, "category": "math", "turns": ["2+2?", "3+3?"]}])
    cnn = _write(tmp_path / "spec_bench_summarization_80.jsonl",
                 [{"question_id": 241, "category": "summarization", "turns": ["Summarize: A B C."]}])
    eag = _write(tmp_path / "alpaca" / "question.jsonl",
                 [{"question_id": 0, "category": "", "turns": ["Calculate x."], "reference": ["y"]}])
    assert load_workload(mt)[0].messages == [{"role": "user", "content": "2+2?"}]
    assert load_workload(cnn)[0].category == "summarization"
    assert load_workload(eag)[0].category == "alpaca"    # empty category: the folder's name


@pytest.mark.parametrize("gz", [True, False])
def test_humaneval(tmp_path, gz):
    name = "HumanEval.jsonl.gz" if gz else "HumanEval.jsonl"
    p = _write(tmp_path / name, [{"task_id": "HumanEval/0", "prompt": "def f(x):\n", "entry_point": "f",
                                  "canonical_solution": "    return x\n", "test": ""}], gz=gz)
    assert load_workload(p) == [WorkloadItem("code", "def f(x):\n", None, "HumanEval/0")]


def test_gsm8k(tmp_path):
    p = _write(tmp_path / "test.jsonl", [{"question": "How many eggs?", "answer": "3\n#### 3"}] * 3)
    items = load_workload(p, limit=2)
    assert len(items) == 2 and items[0].category == "math"
    assert items[0].messages == [{"role": "user", "content": "How many eggs?"}]


def test_editeval(tmp_path):
    p = _write(tmp_path / "edit_eval.jsonl", [{"task_id": "EditEval/0", "instruction": "Rename x to y.",
                                               "context": "", "input": "x = 1", "output": "y = 1", "test": ""}])
    it = load_workload(p)[0]
    assert it.category == "edit" and it.id == "EditEval/0"
    assert "Rename x to y." in it.messages[0]["content"] and "x = 1" in it.messages[0]["content"]


def test_custom_prompt_and_messages(tmp_path):
    p = _write(tmp_path / "mine.jsonl", [
        {"prompt": "def f():", "category": "code"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}])
    a, b = load_workload(p)
    assert a == WorkloadItem("code", "def f():", None, "0")
    assert b.category == "default" and b.prompt is None and len(b.messages) == 2


@pytest.mark.parametrize("content,match", [
    (None, "not found"),
    ("not json\n", "not valid JSON"),
    ('{"foo": 1}\n', "unknown workload format"),
    ("", "no records"),
    ('{"messages": "hi"}\n', "messages"),
])
def test_bad_files(tmp_path, content, match):
    p = tmp_path / "w.jsonl"
    if content is not None:
        p.write_text(content)
    with pytest.raises(LeapfrogError, match=match):
        load_workload(p)
    with pytest.raises(LeapfrogError, match="directory"):
        load_workload(tmp_path)
