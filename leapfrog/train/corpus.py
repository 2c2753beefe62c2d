"""Text corpora for training: the Python standard library's own source, or the user's files.

A corpus is a list of ``Document`` (a name and its text, or its token ids for targets without a
tokenizer: JSONL lines ``{"token_ids": [...]}``). The held-out split is by document
(file), decided by a hash of its name and a seed, so no file is in both halves and the split
does not depend on the order files are listed in.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from leapfrog.errors import ConfigError

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java"}


@dataclass(frozen=True)
class Document:
    name: str   # a path relative to the corpus root, or "<file>:<line>" for JSONL
    text: str
    token_ids: tuple[int, ...] | None = None  # already tokenized (JSONL "token_ids"); text is then ""

    @property
    def empty(self) -> bool:
        return not self.token_ids if self.token_ids is not None else not self.text.strip()


def fingerprint(docs: list[Document]) -> str:
    """The documents' names and contents, hashed: caches and resumed runs are keyed on what the
    corpus says, not on file names (an edited file, or another folder's train.jsonl, is new data)."""
    h = hashlib.sha256()
    for d in docs:
        h.update(json.dumps([d.name, d.text, list(d.token_ids) if d.token_ids is not None else None]).encode())
    return h.hexdigest()


def stdlib_documents(root: str | os.PathLike | None = None) -> list[Document]:
    """Every ``*.py`` file of the standard library (PSF license), sorted by relative path;
    third-party packages (site-packages) are left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    docs = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document(rel.as_posix(), text))
    return docs


def _jsonl_document(obj: dict, name: str, where: str) -> Document:
    ids = obj.get("token_ids")
    if ids is None:
        return Document(name, _jsonl_text(obj, where))
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{where}: 'token_ids' must be a list of non-negative integers")
    if ids and max(ids) >= 2**63:   # (past int64; ids past the target's vocab_size are refused with it)
        raise ConfigError(f"{where}: token id {max(ids)} is no token id (they are below the target's vocab_size)")
    return Document(name, "", tuple(ids))


def _jsonl_text(obj: dict, where: str) -> str:
    if isinstance(obj.get("text"), str):
        return obj["text"]
    if isinstance(obj.get("prompt"), str):
        completion = obj.get("completion")
        if completion is not None and not isinstance(completion, str):
            raise ConfigError(f"{where}: 'completion' must be a string, got {type(completion).__name__}")
        return obj["prompt"] + (completion or "")
    if isinstance(obj.get("messages"), list):
        return "\n".join(str(m.get("content", "")) for m in obj["messages"] if isinstance(m, dict))
    raise ConfigError(f"{where}: a JSONL line needs a 'text', 'prompt' or 'messages' field (or 'token_ids')")


def _read_text(f: Path) -> str:
    """A corpus file's text; not UTF-8 (a binary file, a legacy encoding) is named, not trained
    on as replacement characters."""
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"corpus file {f}: not UTF-8 text ({e}); convert it to UTF-8 or leave it out") from None
    except OSError as e:
        raise ConfigError(f"corpus file {f}: {e.strerror or e}") from None


def read_documents(path: str | os.PathLike) -> list[Document]:
    """A text file (one document), a JSONL file (one document per line: ``text``, ``prompt``
    [+ ``completion``], chat ``messages``, or ``token_ids``: a list of the target's token ids, for
    targets without a tokenizer) or a directory (every text file under it)."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        docs = [Document(f.relative_to(p).as_posix(), _read_text(f)) for f in files]
    elif p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")):
        from leapfrog.bench.workloads import read_jsonl
        docs = [_jsonl_document(obj, f"{p.name}:{i}", f"{p}:{i}") for i, obj in enumerate(read_jsonl(p, "corpus"), 1)]
    elif p.is_file():
        docs = [Document(p.name, _read_text(p))]
    else:
        raise ConfigError(f"corpus {str(path)!r}: no such file or directory")
    docs = [d for d in docs if not d.empty]
    if not docs:
        raise ConfigError(f"corpus {str(path)!r} holds no text")
    return docs


def heldout_or_training(train: list[Document], held: list[Document]) -> list[Document]:
    """The held-out documents; with none (one document, or --heldout-fraction 0) the last training
    one, and a warning that the "held-out" figures then measure training text."""
    if held:
        return held
    print("[leapfrog train-draft] warning: nothing is held out (one document, or --heldout-fraction 0): the "
          "held-out figures below are measured on training text", file=sys.stderr)
    return train[-1:]


def _name_hash(name: str, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}:{name}".encode()).digest()


def _in_heldout(name: str, fraction: float, seed: int) -> bool:
    return int.from_bytes(_name_hash(name, seed)[:8], "big") / 2**64 < fraction


def split_by_file(docs: list[Document], heldout_fraction: float, seed: int = 0
                  ) -> tuple[list[Document], list[Document]]:
    """(train, held-out): each document lands wholly in one half. At least one document is held
    out when there are two or more."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ConfigError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    held = [d for d in docs if _in_heldout(d.name, heldout_fraction, seed)]
    if heldout_fraction > 0 and not held and len(docs) > 1:
        held = [min(docs, key=lambda d: _name_hash(d.name, seed))]
    names = {d.name for d in held}
    return [d for d in docs if d.name not in names], held


def pack_stream(tokenizer, docs: list[Document], eos_token_id: int | None = None) -> Tensor:
    """All documents tokenized and joined, each followed by EOS -> [T] int64 token stream.

    Documents given as token ids are taken as they are; ``tokenizer`` may be None when all are.
    EOS: the tokenizer's, else ``eos_token_id`` (None: no separator)."""
    eos = tokenizer.eos_token_id if tokenizer is not None else eos_token_id
    text = [j for j, d in enumerate(docs) if d.token_ids is None]
    if text and tokenizer is None:
        raise ConfigError(f"document {docs[text[0]].name!r} is text, and there is no tokenizer to encode it; "
                          "give the corpus as JSONL lines of token ids ({\"token_ids\": [...]}) instead")
    encoded: dict[int, list[int]] = {}
    batch = 256
    for i in range(0, len(text), batch):
        part = text[i:i + batch]
        enc = tokenizer([docs[j].text for j in part], add_special_tokens=False)["input_ids"]
        encoded.update(zip(part, enc))
    ids: list[int] = []
    for j, d in enumerate(docs):
        ids.extend(d.token_ids if d.token_ids is not None else encoded[j])
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
