"""``--prompts-file`` of ``generate`` and ``check``: one reader, one format.

One prompt per line (``\\n`` escapes allowed, blank lines skipped), or JSONL lines with
``"prompt"`` (a string) or ``"prompt_token_ids"`` (a non-empty list of integers; read first when
both are given); other keys (a dataset's metadata) are not read, except that one starting with
"prompt" is refused as a misspelling. A file that does not parse is a ConfigError naming the
file and the line (the CLI's exit code 2).
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
        # other keys are a dataset's metadata (HumanEval's task_id, ...) and stay unread; one that
        # starts with "prompt" is a misspelling of ours (prompt_token_id ran "prompt" silently)
        typo = sorted(k for k in d if k.startswith("prompt") and k not in ("prompt", "prompt_token_ids"))
        if typo:
            raise ConfigError(f"{where}, line {i}: unknown key {typo[0]!r} (the keys read are \"prompt\" and "
                              "\"prompt_token_ids\")")
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
