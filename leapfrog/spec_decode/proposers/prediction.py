"""Predicted outputs (OpenAI's ``prediction``; "speculative edits"): the caller passes the text it
expects, and the drafts come from it.

Alignment. ``Alignment`` follows the output token by token against the prediction's tokens:
while the output equals ``pred[pos]`` the pointer advances (those tokens *appeared in the
completion*: OpenAI's accepted_prediction_tokens). At the first difference the alignment is lost
and ``anchor`` keeps where it was. From then on, after every output token, it tries to
re-synchronize: the last m output tokens (m = ``max_match`` down to ``min_match``, only tokens
written since the alignment was lost) are searched
in ``pred[anchor:]`` and the nearest occurrence wins, so the pointer lands right after it (a
re-synchronization that breaks again within max_match tokens does not move the anchor: short
runs repeat in code, and a false rejoin must not skip the true one). An
insertion (the output adds lines) rejoins at the anchor, a deletion (the output skips lines)
further on, a replacement in between; one edit in the middle does not end speculation for the
rest. Example, pred = "A B C D E F", output "A B X Y C D": after X the alignment is lost
(anchor 2); with min_match 2, "C D" is found at 2, so pos = 4 and the next draft is "E F".

Drafts. While aligned, the next ``k`` prediction tokens are proposed as a chain of point-mass
drafts (q = None: a deterministic function of the context, so the verifier keeps the output the
target's). ``k`` adapts to the recent acceptance: it doubles after every fully accepted step, up
to ``MAX_DRAFT`` (64), and a re-synchronization keeps it. While unaligned, a guess: the last one
or two output tokens are looked up in the ``GUESS_WINDOW`` tokens after the anchor and the
tokens after the nearest occurrence are drafted (k after a two-token match, ``GUESS_DRAFT``
after a one-token one) during the ``GUESS_AFTER`` tokens after the loss, so a one-line edit
costs a step or two, not the min_match tokens a re-synchronization waits for (an accepted guess
then re-synchronizes the alignment by itself); an output that has left the prediction for good
stops paying for guesses.
Measured (bench ``--workload rewrite``, the target's own output as the prediction, fp32): one
renamed identifier keeps 92 % of the exact prediction's speedup (10.4x vs 11.3x).

Everything is decided by the output tokens alone (never by step boundaries or batch-mates), so a
request's usage counts are the same whatever else runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from leapfrog.request import Request
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.proposers.ngram import occurrences
from leapfrog.spec_decode.verify.result import AcceptanceResult

MAX_DRAFT = 64
START_DRAFT = 8
GUESS_WINDOW = 64   # while unaligned, the last output tokens are looked up this far past the anchor
GUESS_DRAFT = 16
GUESS_AFTER = 16    # ... only this many output tokens after losing it (a local edit rejoins soon)


def find_rejoin(pred: np.ndarray, tail: np.ndarray, start: int, min_match: int, max_match: int
                ) -> tuple[int, int] | None:
    """pred [P], tail [n] (the latest output tokens) -> (i, m): the longest m in
    [min_match, max_match] such that tail[-m:] occurs in pred at some i >= start, the nearest such
    i; None if no m does."""
    for m in range(min(max_match, len(tail)), min_match - 1, -1):
        cand = occurrences(pred[start:], tail[len(tail) - m:])
        if len(cand):
            return start + int(cand[0]), m
    return None


@dataclass
class Alignment:
    """Where the output stands in the prediction (module docstring). Pure bookkeeping over tokens."""
    pred: np.ndarray                 # [P] the prediction's token ids
    min_match: int = 3
    max_match: int = 8
    pos: int = 0                     # next expected prediction index (valid while synced)
    synced: bool = True
    anchor: int = 0                  # where the alignment was lost
    since_lost: int = 0              # output tokens since then
    run: int = 0                     # tokens matched since the last (re)synchronization
    hit: np.ndarray | None = None    # [P] bool: prediction tokens that appeared in the output
    seen: int = 0                    # output tokens processed
    k: int = START_DRAFT             # next draft length
    resyncs: int = 0

    def advance(self, output: list[int]) -> None:
        """Process output[seen:] token by token."""
        if self.seen >= len(output):
            return
        tail: np.ndarray | None = None
        for n in range(self.seen, len(output)):
            t = output[n]
            if self.synced and self.pos < len(self.pred) and self.pred[self.pos] == t:
                self.hit[self.pos] = True
                self.pos += 1
                self.run += 1
                continue
            if self.synced:
                # a re-synchronization that held for fewer than max_match tokens was probably a
                # false one (code repeats short runs): keep searching from the earlier anchor
                if self.run >= self.max_match or self.resyncs == 0:
                    self.anchor = self.pos
                self.synced, self.since_lost = False, 0
            self.since_lost += 1
            if tail is None:
                tail = np.asarray(output, dtype=np.int64)
            # only tokens written since the alignment was lost: with older ones in the tail, the
            # context before the edit would pick a later repeat of itself, not the rejoin
            hit = find_rejoin(self.pred, tail[n + 1 - min(self.max_match, self.since_lost):n + 1], self.anchor,
                              self.min_match, self.max_match)
            if hit is not None:
                i, m = hit
                self.pos, self.synced, self.run = i + m, True, 0
                self.hit[i:i + m] = True
                self.resyncs += 1
        self.seen = len(output)

    def __post_init__(self) -> None:
        if self.hit is None:
            self.hit = np.zeros(len(self.pred), dtype=bool)

    @property
    def matched(self) -> int:
        """Prediction tokens that appeared in the output, each counted once (OpenAI's
        accepted_prediction_tokens; the rest are rejected_prediction_tokens)."""
        return int(self.hit.sum())

    def drafts(self, k: int, output: list[int]) -> list[int]:
        if k <= 0:
            return []
        if self.synced:
            return self.pred[self.pos:self.pos + min(k, self.k)].tolist()
        if self.since_lost > GUESS_AFTER:   # not a local edit: guesses would only waste rows
            return []
        # A guess: where the last 2 (else 1) output tokens occur soonest in the GUESS_WINDOW tokens
        # after the anchor, draft what follows them there. A local edit rejoins within a token or
        # two, long before the min_match tokens a re-synchronization needs are out.
        window = self.pred[self.anchor:self.anchor + GUESS_WINDOW]
        hit = find_rejoin(window, np.asarray(output[-2:], dtype=np.int64), 0, 1, 2) if len(output) else None
        if hit is None:
            return []
        i = self.anchor + hit[0] + hit[1]
        n = self.k if hit[1] == 2 else GUESS_DRAFT   # a two-token match is trusted like the alignment
        return self.pred[i:i + min(k, n)].tolist()

    def verified(self, num_draft: int, num_accepted: int) -> None:
        if num_draft and num_accepted == num_draft and num_draft >= self.k:
            self.k = min(MAX_DRAFT, 2 * self.k)


class PredictionProposer:
    """Drafts from each request's prediction (``Request.prediction_ids``); the engine routes the
    requests that carry one here and the others to its configured proposer."""

    def __init__(self) -> None:
        self.align: dict[str, Alignment] = {}

    def start(self, req: Request) -> None:
        self.align[req.request_id] = Alignment(np.asarray(req.prediction_ids, dtype=np.int64))

    def propose(self, reqs: list[Request], ks: list[int]) -> DraftBatch:
        drafts = []
        for r, k in zip(reqs, ks):
            a = self.align[r.request_id]
            a.advance(r.output_ids)
            drafts.append(a.drafts(k, r.output_ids))
        return DraftBatch.from_lists(drafts)

    def on_verified(self, reqs: list[Request], drafts: DraftBatch, result: AcceptanceResult) -> None:
        for r, n, acc in zip(reqs, drafts.num_draft, result.num_accepted):
            self.align[r.request_id].verified(n, acc)

    def finish(self, req: Request) -> None:
        a = self.align.pop(req.request_id, None)
        if a is not None:
            a.advance(req.output_ids)
            req.metrics.accepted_prediction_tokens = a.matched
            req.metrics.rejected_prediction_tokens = len(a.pred) - a.matched

    def reset(self, req: Request) -> None:
        """Nothing to roll back: the alignment follows the committed output tokens only."""
