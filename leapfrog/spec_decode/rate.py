"""Accepted tokens per tried (or predicted) token over a window of recent tokens: the acceptance
rate and calibrations of the adaptive controllers (spec_decode/adaptive.py, confidence.py)."""

from __future__ import annotations

from dataclasses import dataclass

_RATE_WINDOW = 64   # tried (predicted) draft tokens: the acceptance rate's and calibration's memory (TokenRate)
_RATE_STEPS = 16    # ... and steps, at most


@dataclass
class TokenRate:
    """Accepted tokens per token of ``per``, over sums that forget at a rate per token of ``per``
    (a window of about ``window`` of them (_RATE_WINDOW), however many steps or sequences brought them), and
    within about ``steps`` steps at most (_RATE_STEPS) (when acceptance collapses, a chain tries one token a
    step: 64 steps of drafting in vain before speculation turned off):

    - alpha, the per-token acceptance rate of chains: accepted / tried. A draft token is tried
      when every one before it in its chain was accepted, so a chain tries its accepted tokens
      plus the rejected one, if any (the geometric model's maximum-likelihood estimate);
    - an auto tree's calibrations: accepted / predicted (confidence.py: each confidence model's
      C_gamma of the verified candidates).

    Moving averages per step swung with single steps (at T = 0.7, batch 1: a few unlucky steps
    turned speculation off for 128 tokens; at T = 0 a tree's calibration for 24 steps). ``prior``
    until something is measured."""
    accepted: float = 0.0
    per: float = 0.0
    prior: float = 0.7
    window: float = _RATE_WINDOW   # tokens of ``per`` remembered
    steps: int = _RATE_STEPS       # steps remembered, at most

    @property
    def value(self) -> float:
        return self.accepted / self.per if self.per > 0 else self.prior

    def update(self, accepted: float, per: float) -> None:
        """One step's accepted tokens, and tried (predicted) ones."""
        if per > 0:
            keep = min((1 - 1 / self.window) ** per, 1 - 1 / self.steps)
            self.accepted, self.per = keep * self.accepted + accepted, keep * self.per + per
