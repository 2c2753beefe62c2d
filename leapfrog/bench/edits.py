"""Built-in workloads for predicted outputs and suffix decoding, made from held-out code files.

- ``rewrite``: the prompt is the start of a file (``prompt_lines`` lines at a third of it), the
  prediction the file's real continuation (``pred_lines`` lines) with ``changed`` lines edited
  (a renamed identifier, a deleted line, an inserted line), as a caller who knows the file and
  expects a small change would pass it.
- ``rewrite-shown``: the same items, with the original lines (head and continuation) shown in
  the prompt first and the head repeated after them: the text the model is asked to continue is
  in its context, as when a caller asks for a rewrite of code it sends (OpenAI's predicted
  outputs use case). What it measures is whether the model copies from its context.
- ``variations``: the same functions requested several times with different argument names
  (the header and first lines of each function, its parameters renamed per variant), one
  variant after another, so that earlier outputs predict later ones (suffix decoding's global
  tree).

The demo model's held-out files are the standard-library files its training run held out
(``training_record.json`` next to the checkpoints).
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from pathlib import Path

from leapfrog.bench.workloads import WorkloadItem
from leapfrog.errors import ConfigError
from leapfrog.train.corpus import Document

BUILTIN = ("rewrite", "rewrite-shown", "variations")


def heldout_documents(model_dir: Path) -> list[Document]:
    """The held-out files of a model trained by ``leapfrog.train`` (its training_record.json)."""
    path = Path(model_dir) / "training_record.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: the built-in workloads need a model trained by leapfrog.train")
    record = json.loads(path.read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = [Document(n, (root / n).read_text(encoding="utf-8", errors="replace"))
            for n in record["split"]["heldout"] if (root / n).is_file()]
    if not docs:
        raise ConfigError("none of the held-out files is in this Python's standard library")
    return docs


_IDENT = re.compile(r"\b([A-Za-z_][A-Za-z_0-9]{2,})\b")


def edit_lines(lines: list[str], changed: int, rng: random.Random,
               ops: tuple[str, ...] = ("rename", "delete", "insert")) -> list[str]:
    """``lines`` with ``changed`` edits at distinct lines of ordinary length, each one of ``ops``:
    rename the first identifier of a line, delete a line, or insert a modified copy after it."""
    out = list(lines)
    cand = [i for i, ln in enumerate(out) if 10 <= len(ln.strip()) <= 100 and _IDENT.search(ln)]
    for i in sorted(rng.sample(cand, min(changed, len(cand))), reverse=True):
        op = rng.choice(ops)
        renamed = _IDENT.sub(lambda m: m.group(1) + "_new", out[i], count=1)
        if op == "rename":
            out[i] = renamed
        elif op == "delete":
            del out[i]
        else:
            out.insert(i + 1, renamed)
    return out


def rewrite_items(docs: list[Document], n: int, changed: int = 2, prompt_lines: int = 24,
                  pred_lines: int = 24, seed: int = 0, shown: bool = False) -> list[WorkloadItem]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        d = docs[i % len(docs)]
        lines = d.text.splitlines(keepends=True)
        start = (len(lines) * (1 + i // len(docs))) // (2 + n // len(docs))
        head = lines[start:start + prompt_lines]
        cont = lines[start + prompt_lines:start + prompt_lines + pred_lines]
        if not head or len(cont) < max(1, pred_lines // 2):   # a file too short to predict much of
            continue
        pred = "".join(edit_lines(cont, changed, rng))
        prompt = "".join(head + cont) + "\n\n" + "".join(head) if shown else "".join(head)
        items.append(WorkloadItem("rewrite-shown" if shown else "rewrite", prompt, None, f"{d.name}:{start}",
                                  prediction=pred))
    return items


_DEF = re.compile(r"^([ \t]*)def (\w+)\(([^)]*)\):[ \t]*$")


def variations_items(docs: list[Document], n_functions: int, n_variants: int = 4, body_lines: int = 3
                     ) -> list[WorkloadItem]:
    """Functions with 2+ named parameters, each requested n_variants times with renamed ones."""
    items = []
    for d in docs:
        lines = d.text.splitlines(keepends=True)
        for j, ln in enumerate(lines):
            m = _DEF.match(ln.rstrip("\n"))
            if not m:
                continue
            params = [p.strip().split("=")[0].split(":")[0].strip("* ") for p in m.group(3).split(",")]
            params = [p for p in params if p and p not in ("self", "cls")]
            if len(params) < 2:
                continue
            block = "".join(lines[j:j + 1 + body_lines])
            for v in range(n_variants):
                names = {p: f"{p}_{v}" if v else p for p in params}
                text = re.sub(r"\b(" + "|".join(map(re.escape, params)) + r")\b", lambda mm: names[mm.group(1)], block)
                items.append(WorkloadItem("variations", text, None, f"{d.name}:{j}:v{v}"))
            if len(items) >= n_functions * n_variants:
                return items
    return items


def builtin_workload(name: str, model_dir: Path, limit: int | None = None, seed: int = 0) -> list[WorkloadItem]:
    """``rewrite``, ``rewrite-shown`` or ``variations`` (module docstring), ``limit`` items (12 / 6
    functions x 4)."""
    docs = heldout_documents(model_dir)
    if name in ("rewrite", "rewrite-shown"):
        return rewrite_items(docs, limit or 12, seed=seed, shown=name == "rewrite-shown")
    if name == "variations":
        return variations_items(docs, max(1, (limit or 24) // 4))
    raise ConfigError(f"unknown built-in workload {name!r}; choose from {list(BUILTIN)}")
