"""Continuous batching: admission into KV rows, prompt chunking, who runs each step.

Requests join (when a row is free and fewer than max_num_seqs run) and leave (finish or
abort) between steps. A prompt longer than the step's token budget is computed in chunks
over several steps. No torch here: this is bookkeeping over Requests and the KV manager.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from leapfrog.request import Request, Status
from leapfrog.kv.manager import KVManager


@dataclass
class SchedulerOutput:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt tokens this step)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        while self.waiting and len(self.running) < self.max_num_seqs:
            row = self.kv.allocate()
            if row is None:
                break
            req = self.waiting.popleft()
            req.row, req.status, req.num_computed = row, Status.RUNNING, 0
            self.running.append(req)
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in self.running:
            if not req.in_prefill:
                out.decode.append(req)
            elif budget > 0:
                n = min(len(req.prompt_ids) - req.num_computed, budget)
                out.prefill.append((req, n))
                budget -= n
        return out

    def finish(self, req: Request) -> None:
        """Free the request's row at once (finished or aborted)."""
        req.status = Status.FINISHED
        if req in self.running:
            self.running.remove(req)
            if req.row is not None:
                self.kv.free(req.row)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.row = None
