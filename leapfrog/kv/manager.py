"""Who owns which cache row, and how many of its columns are valid.

One integer per row is the whole state of a sequence's cache: commit advances it,
rollback lowers it, nothing is copied.
"""

from __future__ import annotations

from leapfrog.errors import RequestError


class KVManager:
    def __init__(self, num_rows: int, max_model_len: int) -> None:
        self.num_rows = num_rows
        self.max_model_len = max_model_len
        self._free = list(range(num_rows - 1, -1, -1))  # pop() gives the lowest row
        self.lengths = [0] * num_rows

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def token_budget(self) -> int:
        return self.num_rows * self.max_model_len

    def used_tokens(self) -> int:
        return sum(self.lengths[r] for r in range(self.num_rows) if r not in self._free)

    def check_fits(self, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise RequestError(
                f"request needs {num_tokens} tokens of context (prompt + max_tokens) but max_model_len "
                f"is {self.max_model_len}; shorten the prompt, lower max_tokens or raise max_model_len")

    def allocate(self) -> int | None:
        if not self._free:
            return None
        self._free.sort(reverse=True)
        row = self._free.pop()
        self.lengths[row] = 0
        return row

    def free(self, row: int) -> None:
        self.lengths[row] = 0
        self._free.append(row)

    def set_length(self, row: int, length: int) -> None:
        """Commit (length grows) or roll back (length shrinks) a row."""
        assert 0 <= length <= self.max_model_len, (row, length)
        self.lengths[row] = length
