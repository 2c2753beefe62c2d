"""``--prompts-file`` of ``generate`` and ``check``: one reader, one format.

One prompt per line (``\\n`` escapes allowed, blank lines skipped), or JSONL lines with
``"prompt"`` (a string) or ``"prompt_token_ids"`` (a non-empty list of integers), one of them and
no other key (a misspelt key is refused, as ``LLM.generate`` refuses it). A file that does not
parse is a ConfigError naming the file and the line (the CLI's exit code 2).
"""

from __future__ import annotations

import json

from leapfrog.errors import ConfigError

Prompt = str | list[int]


def read_prompts(path: str, flag: str = "--prompts-file") -> list[Prompt]:
    where = f"{flag} {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror or e}") from None
    out: list[Prompt] = []
    for i, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        if not ln.lstrip().startswith("{"):
            out.append(ln.replace("\\n", "\n"))
            continue
        try:
            d = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}, line {i}: invalid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{where}, line {i}: a JSON line must be an object with \"prompt\" or "
                              "\"prompt_token_ids\"")
        other = sorted(set(d) - {"prompt", "prompt_token_ids"})
        if other or len(d) > 1:   # (a misspelt key is refused, not ignored, as LLM.generate refuses it)
            raise ConfigError(f"{where}, line {i}: " + (f"unknown key {other[0]!r}; " if other else "")
                              + "a JSON line holds \"prompt\" or \"prompt_token_ids\", one of them")
        if "prompt_token_ids" in d:
            ids = d["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ConfigError(f"{where}, line {i}: \"prompt_token_ids\" must be a non-empty list of integers")
            out.append(list(ids))
        elif isinstance(d.get("prompt"), str):
            out.append(d["prompt"])
        else:
            raise ConfigError(f"{where}, line {i}: a JSON line needs \"prompt\" (a string) or \"prompt_token_ids\"")
    if not out:
        raise ConfigError(f"{where}: no prompts in it")
    return out
