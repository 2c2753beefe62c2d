"""The proposer protocol and registry.

Lifecycle (called explicitly by the engine):
    start(req)                      a request was added
    propose(reqs, ks) -> DraftBatch up to ks[b] drafts for reqs[b] (fewer, even 0, is legal)
    on_verified(reqs, drafts, res)  after verification, before the tokens are appended:
                                    roll the proposer's own state back to what was accepted
    finish(req)                     the request ended (finished or aborted)
    reset(req)                      (optional) a batched step failed and is retried request by
                                    request: drop any state the failed step may have half-advanced
                                    (default: finish + start, rebuilding from the tokens)
    compile()                       (optional) enforce_eager=False: compile the proposer's own
                                    forwards at start-up (model/compiled.py)
    prefill(reqs)                   (optional) the target has just prefilled these prompts (their
                                    first token appended): run the proposer's own forward over them
                                    now, not in the first decode step

Proposers that read the target's own states (EAGLE) set ``target_states`` ("hidden" or a tuple
of layer indices, see ModelRunner.step) and get ``on_target_states(req, start, states [n, F])``
after every target forward, for the committed tokens at positions start..start+n-1.

Constructors take only what they need: their SpeculativeConfig and a TargetInfo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from leapfrog.request import Request
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.verify.result import AcceptanceResult


@dataclass(frozen=True)
class TargetInfo:
    """What a proposer may know about the target."""
    vocab_size: int
    tokenizer: Any
    eos_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    num_rows: int
    max_model_len: int
    max_num_batched_tokens: int
    model: Any = None  # the target LlamaModel (self-speculation, tests' oracle proposers)
    batch_invariant: bool = False  # run model proposers batch-invariant like the target
    enforce_eager: bool = True     # False: model proposers compile their forwards too (Proposer.compile)
    allow_pickle: bool = False     # draft checkpoints may be pickle files (the user said so)
    checkpoint: Any = None         # the target's loader.Checkpoint (draft_model "self")
    load_format: str = "auto"      # how the target was loaded ("dummy": draft_model "self" draws the same weights)
    seed: int = 0                  # the engine's seed (a dummy target's weights)


class Proposer(Protocol):
    def start(self, req: Request) -> None: ...
    def propose(self, reqs: list[Request], ks: list[int]) -> DraftBatch: ...
    # (EAGLE's also takes ``stop_confidence``: "auto" tree sizes' SpecController.stop_confidence,
    # which the engine passes only when set, so only to a proposer of a tree method)
    def on_verified(self, reqs: list[Request], drafts: DraftBatch, result: AcceptanceResult) -> None: ...
    def finish(self, req: Request) -> None: ...


PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register_proposer(name: str):
    def deco(cls):
        PROPOSERS[name] = cls
        return cls
    return deco


class StatelessProposer:
    """Base for proposers with no per-request state to roll back."""

    def start(self, req: Request) -> None:
        pass

    def on_verified(self, reqs: list[Request], drafts: DraftBatch, result: AcceptanceResult) -> None:
        pass

    def finish(self, req: Request) -> None:
        pass


class ContextBuffers:
    """Each request's tokens (prompt + output) as a numpy array, grown in place: amortised
    O(new tokens) per step (model-free proposers match against it)."""

    def __init__(self) -> None:
        self._buf: dict[str, tuple[np.ndarray, int]] = {}  # req id -> (buffer, filled)

    def get(self, req: Request) -> np.ndarray:
        n, P = req.num_tokens, len(req.prompt_ids)
        buf, filled = self._buf.get(req.request_id, (None, 0))
        if buf is None or len(buf) < n:
            new = np.empty(max(2 * n, 64), dtype=np.int64)
            new[:filled] = buf[:filled] if buf is not None else []
            buf = new
        if filled < P:
            buf[filled:P] = req.prompt_ids[filled:]
            filled = P
        buf[filled:n] = req.output_ids[filled - P:]
        self._buf[req.request_id] = (buf, n)
        return buf[:n]

    def drop(self, req: Request) -> None:
        self._buf.pop(req.request_id, None)
