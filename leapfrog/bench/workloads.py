"""Workload loaders for ``leapfrog bench``: public speculative-decoding prompt sets and your own JSONL.

Formats (detected from the file name, then from the fields of the first record):

- Spec-Bench / MT-bench / EAGLE eval ``question.jsonl`` and the CNN/DM ``spec_bench_summarization_80.jsonl``:
  ``{"question_id", "category", "turns": [...]}``; the first turn becomes a user chat message.
  An empty category (EAGLE's alpaca set) takes the name of the file's folder.
- HumanEval ``HumanEval.jsonl.gz`` (or ``.jsonl``): ``{"task_id", "prompt", ...}``, category "code",
  plain-text completion prompt.
- GSM8K ``test.jsonl``: ``{"question", "answer"}``, category "math", the question as a user message.
- EditEval ``edit_eval.jsonl``: ``{"task_id", "instruction", "context"?, "input", "output"}``, category "edit",
  a user message with the instruction (+ context) and the code to edit; the code to edit is also the
  item's prediction (for predicted-outputs contenders).
- Your own JSONL: ``{"prompt": str}`` (plain text) or ``{"messages": [{"role", "content"}, ...]}`` (chat),
  optional ``category`` (default "default") and ``id``.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leapfrog.errors import ConfigError


@dataclass
class WorkloadItem:
    category: str
    prompt: str | None          # plain text (completion style)
    messages: list[dict] | None  # chat messages (rendered with the tokenizer's chat template)
    id: str
    prediction: str | None = None  # the expected output (predicted-outputs contenders; EditEval: the input code)


def read_jsonl(path: Path, what: str = "workload") -> list[dict[str, Any]]:
    """The objects of a JSONL file (optionally .gz); a clear ConfigError for anything else.
    ``what``: the file's role in the messages ("workload", "corpus")."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise ConfigError(f"cannot read {what} file {path}: {e}") from None
    rows = []
    for n, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            d = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON ({e}); a {what} file is JSONL") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}:{n}: each line must be a JSON object")
        rows.append(d)
    if not rows:
        raise ConfigError(f"{path}: no records")
    return rows


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _turns(rows, path: Path) -> list[WorkloadItem]:
    out = []
    folder = path.parent.name or "default"
    for i, d in enumerate(rows):
        turns = d.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ConfigError(f"{path}: record {i + 1} has no 'turns' list of strings")
        cat = d.get("category") or folder
        out.append(WorkloadItem(str(cat), None, _user(turns[0]), str(d.get("question_id", i))))
    return out


def _humaneval(rows, path: Path) -> list[WorkloadItem]:
    out = []
    for i, d in enumerate(rows):
        if not isinstance(d.get("prompt"), str):
            raise ConfigError(f"{path}: record {i + 1} has no 'prompt'")
        out.append(WorkloadItem("code", d["prompt"], None, str(d.get("task_id", i))))
    return out


def _gsm8k(rows, path: Path) -> list[WorkloadItem]:
    out = []
    for i, d in enumerate(rows):
        if not isinstance(d.get("question"), str):
            raise ConfigError(f"{path}: record {i + 1} has no 'question'")
        out.append(WorkloadItem("math", None, _user(d["question"]), str(d.get("id", i))))
    return out


def _editeval(rows, path: Path) -> list[WorkloadItem]:
    out = []
    for i, d in enumerate(rows):
        if not isinstance(d.get("instruction"), str) or not isinstance(d.get("input"), str):
            raise ConfigError(f"{path}: record {i + 1} needs 'instruction' and 'input'")
        text = d["instruction"].strip()
        if d.get("context"):
            text += "\n\n" + str(d["context"]).strip()
        text += "\n\n```python\n" + d["input"] + "\n```\n\nRewrite the whole code with the change applied."
        out.append(WorkloadItem("edit", None, _user(text), str(d.get("task_id", i)), prediction=d["input"]))
    return out


def _custom(rows, path: Path) -> list[WorkloadItem]:
    out = []
    for i, d in enumerate(rows):
        cat = str(d.get("category") or "default")
        rid = str(d.get("id", i))
        if isinstance(d.get("prompt"), str):
            out.append(WorkloadItem(cat, d["prompt"], None, rid))
        elif isinstance(d.get("messages"), list):
            msgs = d["messages"]
            if not msgs or not all(isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str)
                                   for m in msgs):
                raise ConfigError(f"{path}: record {i + 1}: 'messages' must be a non-empty list of "
                                  "{'role', 'content'} dicts")
            out.append(WorkloadItem(cat, None, [dict(m) for m in msgs], rid))
        else:
            raise ConfigError(f"{path}: record {i + 1} needs 'prompt' (str) or 'messages' (chat list)")
    return out


def detect_format(path: Path, first: dict[str, Any]) -> str:
    name = path.name.lower()
    if "humaneval" in name and "task_id" in first and "prompt" in first:
        return "humaneval"
    if "edit_eval" in name or ("instruction" in first and "input" in first and "output" in first):
        return "editeval"
    if "turns" in first:
        return "turns"
    if "question" in first and "answer" in first:
        return "gsm8k"
    if "prompt" in first or "messages" in first:
        return "custom"
    raise ConfigError(f"{path}: unknown workload format (fields {sorted(first)}); expected Spec-Bench/MT-bench "
                      "'turns', HumanEval 'prompt', GSM8K 'question', EditEval 'instruction'/'input', "
                      "or your own 'prompt' / 'messages'")


_LOADERS = {"turns": _turns, "humaneval": _humaneval, "gsm8k": _gsm8k, "editeval": _editeval, "custom": _custom}


def load_workload(path: str | Path, limit: int | None = None) -> list[WorkloadItem]:
    """Read one workload file (format detected from its name and fields); ``limit`` keeps the first N items
    of each category (so a limited Spec-Bench run still covers every category)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"workload {path} is a directory; give a .jsonl (or .jsonl.gz) file")
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    rows = read_jsonl(path)
    items = _LOADERS[detect_format(path, rows[0])](rows, path)
    return limit_per_category(items, limit)


def limit_per_category(items: list[WorkloadItem], limit: int | None) -> list[WorkloadItem]:
    """At most ``limit`` items of each category, in file order."""
    if limit is None:
        return items
    seen: dict[str, int] = {}
    out = []
    for it in items:
        if seen.get(it.category, 0) < limit:
            seen[it.category] = seen.get(it.category, 0) + 1
            out.append(it)
    return out
