"""How many tokens to draft this step.

Fixed policy: K for every request (capped by the request's own limit and by what is left
of max_tokens and of the context), 0 when the batch is larger than disable_by_batch_size.

Adaptive policy (``adaptive: true``). With per-token acceptance rate alpha, drafting k tokens
yields, per sequence and step,

    E[tokens](k) = (1 - alpha^(k+1)) / (1 - alpha)            (Leviathan et al., eq. 1)

where every position accepts alike; the controller shapes it by position (rate.DepthShape: alpha's
level, each draft position's measured rate relative to it, ``expected_chain_tokens``), as
acceptance falls with the position and a batch's requests differ (the pooled alpha is weighted
toward those that accept most), and costs
cost(k) = t_draft(B, k) + t_verify(B, k + 1) + t_host(B), where t_draft(B, k) is the
measured drafting time of a step of k drafts (interpolated as t_verify below once two k are
measured: a draft model's catch-up forward does not grow with k; before that k times the measured
time per drafted token), t_verify(B, s) the measured time of one target forward
over s tokens per sequence at batch size B (with acceptance) and t_host(B) the rest of the
step (choosing k, committing, outputs: paid per step, so it favours longer drafts; left out, it
made no speculation look 8 % better than it was at T = 0.7; a drafting step's and a plain
step's measured apart, ``_hosts``), all moving averages keyed by batch-size bucket. The
controller picks

    k* = argmax_{k in 0..K} E[tokens](k) / cost(k)            (goodput, tokens per second)

k = 0 (no speculation) has E = 1 and cost t_verify(B, 1) + a plain step's t_host(B), and counts _SPEC_MARGIN
times its goodput (speculation's costs outside its steps: the constant's comment). t_verify(B, 1)
is measured first at every batch-size bucket (the lesser of the last two of _PLAIN_FIRST
one-token steps: the first steps after a prefill run slow) and again while speculating where no
speculation's estimated goodput is within _PLAIN_CLOSE of the best size's, or however far off
once the estimate is old enough that a refresh costs under _PLAIN_STALE_COST of the steps since
(``_explore``: _PLAIN_FIRST plain steps every _PLAIN_REFRESH exploration intervals, the lesser of the last two
replacing the estimate: the plain steps right after speculation run slow, a batch of 16 at T =
0.7 about 1.2-1.4x for three steps, then 1.0-1.1x its plain steps in a row). Other plain steps
are averaged in only from the _PLAIN_SETTLE-th of the same requests in a row on (the first ones
after drafting steps or a new request's prefill run slow too; so do drafting steps right after a
request joined: the first _SPEC_SETTLE of them leave the measured verify and host times alone), each as the median of it and the
run's two settled steps before it (one slow step, the OS's, must not raise the estimate:
speculation, then chosen over the raised estimate, leaves no plain step to bring it back down). A step's cost grows
with the context (attention reads every sequence's keys and values: a plain step of a batch of
16 of the built-in target 4.4 ms at 72 tokens a sequence, 6.3 at 192), and the sizes are
measured at different contexts, so every measured verify time is compared at the context of the
step being chosen, moved by a growth fitted within sizes (``_verify_table``, _ContextFit of the
log time: every size grows by the same factor per token of context, as attention works for each
token verified, about 1 us per sequence and token of context for plain decode there; none until
the contexts spread by a tenth of their mean, and never steeper than the step's whole time in
proportion to its context; the rounds' measured times below are compared as measured). alpha is the geometric model's
maximum-likelihood estimate, accepted / tried (TokenRate: a draft token is tried when all before
it were accepted), not accepted / drafted, which counts the untried tokens after a rejection as
rejected and so underestimates alpha the more, the longer the drafts (0.59 for a true 0.8 at
k = 4): it pulled K down. (For a tree, a step tries one more token than it accepted only where
the accepted path stopped at a node with children.) No size counts dearer than a longer one (a
forward over more tokens never costs less: such a size was measured slow, ``_monotone``). Unmeasured verify costs are interpolated linearly between measured ones
(beyond them see below; flat while one size is measured, so an unmeasured K gets tried once).
The first drafts at a batch size are a probe of the size a smaller batch size settled on, else
of K (less at larger batches: _seed_size, _probe_size) for _FIRST_PROBE_STEPS steps. Every
``adaptive_explore_interval`` steps the controller tries a
neighbour of k* if its estimated goodput is within 15 % of k*'s, so close calls stay measured
without paying for hopeless ones (from a batch of _HOLD_FROM, within 30 % where its verify time
went _STALE_STEPS steps unmeasured: that step's time replaces the estimate, which may date from a burst of slow steps;
auto tree sizes: the chain one level longer or shorter up to the depth, tree sizes doubled or
halved past it; while speculation is off, the size up only every 2 x bucket intervals: that
step first catches the drafter up on every token since it last drafted); while speculation is off it also drafts a probe (4
steps in a row) after 8 intervals of decode steps (tokens per sequence) times the batch-size bucket to keep alpha
current (and the costs: a transient that made speculation look bad must not turn it off for
good), twice as long after each probe that leaves it off (up to 8 times: at large batches it
never pays, and probes cost); from a batch of _HOLD_FROM on, speculation that turns off after
speculating is probed once with the size it ran after _REPROBE_STEPS plain steps, and so is
speculation that the first weighing at a batch size turns off (any batch size, with the probe size).
The first time of a forward shape includes one-off costs (kernel selection and packing for a
new row count: the first 21-token verify of the demo target measured 11.7 ms, later ones about
8), so a size's first measurement is only provisional: the next step runs the same size again
and that measurement replaces it (the provisional one is never used in the estimates; plain decode:
the lesser of the last two of _PLAIN_FIRST steps, above).
Beyond the largest measured size the cost is extrapolated along the slope from the smallest
measured size to the largest (flat while only plain decode is measured, so the first probe
happens). The first drafts at a batch size are a probe of _FIRST_PROBE_STEPS steps, judged
together (below, ``_explore``). A sample counts for at most
twice the current estimate, so one-off spikes (a drafter catching up on new prompts, a cold
shape, the OS) move it by at most 20 %; lasting changes are followed within a few steps.

Tree size (``num_draft_tokens: "auto"``, tree methods). The proposer grows its candidate tree
at a cost that does not depend on how many nodes are verified, then keeps the n most confident.
If c_1 >= c_2 >= ... are the candidates' path confidences (the product of the drafter's
probabilities along the path, ``DraftBatch.candidate_scores``) and m_i their mean over recent
proposals, verifying the best n accepts about a * C(n) tokens, C(n) = m_1 ** gamma + ... +
m_n ** gamma (the power for the best ``num_speculative_tokens`` candidates, past them the
confidences as they are), where gamma and a calibrate the drafter's confidence against the
measured acceptance (confidence.py: a drafter under-confident per level is the more so, the
deeper the candidate, and one linear factor made short chains look better than they are). So

    n* = argmax_{n in 0..N} (1 + a * C(n)) / (t_draft(B, L(n), W(n)) + t_verify(B, n + 1))

with the m_i averaged over the latest proposals that grew at least i candidates (confidence.py),
t_verify from the same measured table as
above and n = 0 meaning no speculation (cost t_verify(B, 1), no drafting). The tree grown for n
nodes has L(n) levels of width W(n) (SpeculativeConfig.tree_shape: a chain of n levels up to the
depth, wider beyond), and t_draft(B, L, W) is the measured drafting time of a step of that shape.
A chain (W = 1) follows the chains measured at B (three or more: the least-squares line in L
through them, ``_chain_line``; else ``_curve``), and outside the levels measured there the nearest
batch size's curve that covers them, scaled to the nearer end (``_chain_draft_times``). Another
shape not yet measured borrows the nearest measured one's time, scaled up by levels (never
down) and down by width when it is narrower than any measured one (a tree measured first must not
make the chain look as dear as itself: at T = 0.7 the chain was then never tried), so it gets
tried (``_borrowed``). A chain's drafting sample is first moved to its own catch-up: a step's
drafting starts with the head catching up on what the last step committed, so a chain explored
after longer ones pays for their acceptance (``_catch_up``: a fitted slope in the tokens caught
up on). One wider than any measured is scaled up by how much dearer such a shape
measured than borrowed at the nearest batch size that measured one (``_widening``: the fused tree
loop drafts 2-3.5x the chain's time at the same depth). (A step's time includes the head's
catch-up on the tokens just accepted, which does not shrink with the tree: scaled down to one
level it made one-level trees look cheap, and those only ever show one candidate's confidence,
so the tree never grew again.) a is accepted over predicted
tokens, sums over a window of predicted tokens (TokenRate; not an average of per-step ratios, which
single unlucky steps swing, nor moving averages per step). The tree shrinks as verification stops
being cheap (larger batches, slower CPUs) and as the drafter gets less sure; acceptance needs no
exploration, only the verify-cost curve does (as for K). Unseeded sampled requests draft a chain
whatever the size (the proposer's sampled chains: a node drawn from q has no confidence to rank it
by, and its candidate scores are None): their expected tokens are E[tokens](L(n)) with alpha
measured on them alone, and a batch of share f of them expects, per sequence,

    f * E[tokens](L(n)) + (1 - f) * (1 + a * C(n))  tokens

(f = 1: sizes up to the depth only, a chain's drafting and verification costs). (Scored as if
confident, their chains made C(n) = n, which overrates long chains and underrates short ones: at
T = 0.7 "auto" then kept speculation off 60 % of the steps, at 0.99x no speculation where a chain
of 5 ran 1.14x.)

Where the weighing's best size is a chain, greedy chains of it stop early: no level is drafted
once every chain of the batch has a path confidence under ``stop_confidence``'s c*, where another
level costs more than it brings (``SpecController.stop_confidence``, handed to the EAGLE proposer
by the engine; exploration, probes and measurement steps draft in full; the levels a stopped
chain did not draft count in the confidence curve below its last: ``_observe_tree``). At a batch
of 1 the chain of the depth runs in its place, under the same stop (_STOP_AT_DEPTH), where the
request is greedy: sampled chains (seeded ones too) never stop early, so there the best size runs.

Speculation rounds (num_scheduler_steps > 1 on the compiled fast path: engine ``_spec_rounds``).
When the engine has a rounds graph for a chain of ``round_k`` drafts (K, or the chain of the
depth for "auto" tree sizes) and the controller picks that size, the step runs up to
num_scheduler_steps rounds in one go, paying the host work once: a cost the one-round model above
does not see. So that size's goodput is its expected tokens per round (the same acceptance model:
E[tokens](K), or 1 + a * C(depth)) over the rounds' own measured time per round, t_round(B)
(``observe_rounds``: the whole step's time over its rounds; the first measurement at a batch size
is provisional and replaced by the second, later ones move it like the costs above), once
measured at that batch size; until then the rounds are tried (at most _ROUND_TRIES times: they
may not fit the batch). Likewise no speculation (size 0) where the engine has multi-step decode
(``round_sizes``; the graph hands EAGLE heads the target's features of every step): its
goodput is 1 over its measured time per decode step (one-token steps measure t_verify(B, 1)
first: the verify-cost curve starts from it). The rounds' acceptance updates alpha, or the
calibration a (predicted: C(depth) per round). (A measured rate of whole rounds steps, tokens
over time, swung 3x from one stretch of text to the next: acceptance is the noisy part, and it
is better averaged.)

Larger batches. A batch size where nothing has been drafted yet, above one where the estimates
settled on no speculation, starts with none too (``_inherits_off``: speculation's costs only grow
with the batch, acceptance does not depend on it), measuring only what it runs, until its first
probe. While speculation is off at a batch size (this, disable_by_batch_size, or estimates
favouring none) a new request's drafter prefill waits (``drafting_off``): the drafter catches up
on the whole request when it next drafts. That catch-up, on every token since the drafter last
drafted, is what switching speculation back on costs first; "auto" tree sizes weigh it, at the
fitted catch-up slope, spread over the steps the requests have left (``_resume_cost``), so a
size only about even with none is not switched on and off again and again.

Leases. Where the controller drafts nothing (disable_by_batch_size, or "auto" tree sizes off at
the batch size), a plain step of the whole batch ends by promising the engine the next steps of
the same requests that ``choose`` would certainly answer with no drafts, up to the next weighing,
probe or exploration (``_grant``, at most _LEASE_STEPS). The engine runs those without ``choose``
or ``observe`` (``leased``, ``lease_step``), and the controller measures them all when the lease
ends, at its last step or as soon as the batch is another (``_end_lease``): what it chooses and
measures is what choosing and observing every step would have (tests/spec_decode/
test_auto_tree.py). At a batch of 16 at T = 0.7, where "auto" drafts nothing for hundreds of
steps, choosing and observing had cost 0.04 ms of a 3.9 ms plain step.

Greedy and sampled batches. A sampled step costs more than a greedy one (the sampler's work on
every row, rejection sampling, a drafter drawing its chains from q: a plain step of a batch of 16
of the built-in target 7.9 ms at T = 0.7 against 6.0 at T = 0), so a batch at least half of
sampled requests keys tables of its own (``_bucket``'s _SAMPLED flag: verify and drafting costs,
host time, probes, the sizes settled on, alpha), measured afresh as a new batch size is (the
confidence curves and their calibration are shared: only scored drafts, greedy or seeded, feed
them). With one table per batch size for both, the estimates trailed a change of temperature:
after T = 0 at a batch of 16, "auto" drafted chains in 30 steps of the first batch at T = 0.7,
where no speculation paid. Where greedy batches settled on no speculation, sampled batches as
large or larger inherit it until their first probe (``_rules_out``: sampled chains accept less and
cost more to verify), never the other way round.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable

from leapfrog.request import Request
from leapfrog.spec_decode.confidence import confidence_curves
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.rate import DepthShape, TokenRate
from leapfrog.spec_decode.verify.result import AcceptanceResult

_EMA = 0.2
_PROBE_STEPS = 4   # a probe while speculation is off: this many steps in a row (one is too noisy to judge by)
#: the first drafts at a batch size: this many steps in a row, judged together (the first decode step
#: after a prompt accepts about half as much as later ones: judged on two steps, a batch of 4 turned
#: speculation off for 512 steps)
_FIRST_PROBE_STEPS = 8
_EXPLORE_MARGIN = 0.85  # explore a neighbouring K only if it is estimated within 15 % of the best
#: ... or within this of it where its verify time was measured but not for _STALE_STEPS steps, and
#: then the step's time replaces that estimate (it may have been taken in a burst of slow steps:
#: at a batch of 16, T = 0, four steps moved the chain of 4's verify estimate from 6.1 to 8.2 ms,
#: level with the chain of 5's, where fixed chains of 4 verify in about 6.5; weighed 0.80-0.82 of
#: the chain of 3 it was never explored again, and "auto" ran chains of 3 for the rest of the run,
#: 1.07x none, where in another run of the harness the chain of 4 ran 1.16x; stop 113)
#: (from a batch of _HOLD_FROM: at batch 1 the chain of the depth wins and its neighbours are
#: measured as often as close calls are, and the wider exploration ran "auto" 0.96 of the chain of
#: 7 against 0.97 in two tree_bench runs each at T = 0, 0.97-0.99 against 0.99-1.01 at T = 0.7)
_STALE_MARGIN = 0.7
_STALE_STEPS = 64
_ROUND_TRIES = 3   # picks of the rounds' size at a batch size before giving up on measuring rounds there
_PROBE_BACKOFF = 8   # a probe that finds speculation still not paying doubles the wait, up to this many times
#: "auto" tree sizes: a size whose confidence C(n) is within this many tokens of the largest size's
#: is the last weighed (larger ones expect less than this more, and cost more to verify)
_FLAT_TOKENS = 0.05
#: "auto" tree sizes: the sizes' goodputs are weighed again after this many steps; in between the
#: last weighing stands, exploration included (it moves little from one step to the next, and
#: weighing every step cost 0.06 ms, 3 % of a step of the chain of 5 at batch 1)
_REWEIGH_STEPS = 4
#: ... and at batches of one (the shortest steps, where a weighing of 44-50 sizes every 4 steps was
#: about 1 % of the built-in pair's 3.1 ms step), a weighing that agrees with the last one for the
#: same request (the same best size) doubles the wait for the next, up to this many steps; one
#: that does not, or a new request, is back to _REWEIGH_STEPS
_REWEIGH_SETTLED = 16
#: ... and this many while the last weighing put no speculation first: then only plain steps are
#: measured in between, which move plain decode's time, seldom the verdict (a weighing cost about
#: 0.2 ms at a batch of 16: every 4th step, 1.5 % of a 3.3 ms plain step, at a batch of 16 at T =
#: 0.7 where speculation does not pay and "auto" drafts nothing for hundreds of steps)
_REWEIGH_OFF_STEPS = 16
#: ... and at batches of one, an off weighing that agrees with the last one (no speculation best
#: again) doubles the wait for the next, up to this many steps: with a head that accepted nothing
#: (a random one, the built-in target at batch 1) "auto" weighed, granted and ended a lease every
#: 11 steps, 0.23 ms a cycle, 1.4 % of its 1.6 ms steps
_REWEIGH_OFF_SETTLED = 64
#: the most plain steps one lease promises (``_grant``: the steps after a plain one that ``choose``
#: would certainly draft nothing for; while "auto" drafts nothing at a batch size, or
#: disable_by_batch_size turns drafting off, the engine runs them without ``choose`` and ``observe``:
#: at a batch of 16 at T = 0.7 those cost 0.04 ms of a 3.9 ms plain step)
_LEASE_STEPS = 64
#: the hold (_Weighed.holding) from this batch size on: below it a probe comes soon after
#: speculation goes off (8 exploration intervals times the batch size: 128 steps at batch 1,
#: 2048 at 16), so a false turn-off costs little there and the hold buys nothing (at batch 1, T =
#: 0.7, "auto" with it ran 0.95-1.00 of the chain of 7 against 0.97-1.03 without it in seven
#: alternated runs each, inside the runs' noise: stop 97)
_HOLD_FROM = 8
#: from _HOLD_FROM on, speculation that turns off after speculating (the last weighing's best was a
#: size, this one's is none) is probed again with that size after this many plain steps, once (then
#: the probes' usual wait, _probe_due): the weighings that turn it off come mostly at a static
#: batch's start, where its first steps accept less (chains of 5 at a batch of 16: 3.9-4.1 tokens a
#: sequence in the first four steps, 4.9-5.0 from the seventh) and the confidence curve still
#: holds the last batch's tail (its least predictable requests, which finished last); while off
#: nothing measured moves either, and the next probe came 2048 steps later: "auto" sat out whole
#: batches of 16-32 at T = 0 where the chains ran 1.05-1.1x none (stop 112). So is speculation
#: that the first weighing at a batch size turns off, at any batch size: it has only the first
#: probe's few steps of acceptance (at batch 1, T = 0.7, seeded, a first probe's chains of 7 took
#: 1.6 tokens a step where the request's later ones took about 4, and the wait of 128 plain
#: steps, a whole request there, followed: stop 116)
_REPROBE_STEPS = 32
#: ... and in the first this many steps of a batch whose requests are mostly new (more than half of
#: a step's requests joined at once: a static batch's start), no weighing turns speculation off
#: after speculating, however many in a row say so: those steps accept less (above) and still beat
#: none, and the weighings there turned speculation off until the re-probe. In a same-process A/B
#: at T = 0 (10 runs each), "auto" ran 1.011x itself without the hold at batches of 16 (faster in
#: 9 of 10 runs) and 32 (8 of 10), with no turn-off left at a batch's start (stop 113)
_START_HOLD = 8
#: plain decode is measured first at a batch size, this many steps, the lesser of the last two
#: standing: the steps right after a prefill run slow (a batch of 16 after its 64-token prompts:
#: the forward 3.8, 3.5, 2.8, 2.6 ms, then 2.3), and the second of two made speculation look 20 %
#: better than it was; so do the steps right after drafting steps (a batch of 16 at T = 0.7 on an
#: AMX Xeon: 5.2, 5.2, 4.4, 4.0, then 3.7 ms, the same requests' steady plain steps), and the
#: lesser of the third and fourth still read 10 % slow (stop 100). (Refreshes run as many.)
_PLAIN_FIRST = 6
#: drafting steps right after a request joined the batch (its prefill ran) are slow too: a batch
#: of 16 verifying chains of 3, the forward 5.7, 5.4, 5.0 ms, then 4.7-4.8 (chains of 5: 7.7, 7.4,
#: 6.8, then 6.6), at a smaller context than the steps after; moved along the context fit they
#: made every size measured at a batch's start look 15-25 % dearer than it ran. The first this
#: many drafting steps after a join leave the verify times and host times measured alone.
_SPEC_SETTLE = 3
#: a plain step's time is averaged into t_verify(B, 1) only from the this-many-th plain step of the
#: same requests in a row on (``_plain_run``): the first ones after drafting steps or a new request's
#: prefill run slow (above). Averaged in, they held the estimated speed of no speculation 6-17 % under
#: what plain steps in a row made, while "auto" drafted at a batch of 16 at T = 0.7 (stop 100): plain
#: decode's speed is what a run of plain steps makes, which is what turning speculation off buys.
#: Each is averaged in as the median of it and the run's last two (``_settled_plain``): one slow
#: step (4.4 ms among 2.6-2.9 at a batch of 16, T = 0.7) raised the estimate by a fifth, "auto"
#: drafted over it, and with no plain step left to correct it, drafted on at 1.2x plain decode's
#: true cost (stop 104)
_PLAIN_SETTLE = 4
#: ... and left out when it is more than this many times plain decode's estimate at the step's
#: context, unless _PLAIN_BURST_STEPS of them come in a row (``_disturbed``): a burst of slow steps
#: (4.1, 6.4, 14.8, 4.4 ms among 3.0-3.3 at a batch of 16, T = 0.7; the machine's, not the
#: step's) raised the estimate by 40 % through the medians of three and through the context
#: fit, "auto" drafted chains of 4 for 73 steps where plain decode was 1.2x faster (stop 105)
_PLAIN_BURST = 1.25
_PLAIN_BURST_STEPS = 8
#: while speculating where no speculation is estimated within _PLAIN_CLOSE of the best size,
#: _PLAIN_FIRST plain steps every this many exploration intervals keep t_verify(B, 1) current
_PLAIN_REFRESH = 4
_PLAIN_REFRESH_STEPS = 64   # ... and every this many steps at most (a short exploration interval)
_PLAIN_CLOSE = 0.75
#: ... and however far off, once plain decode's estimate has stood for as many steps as keep a
#: refresh's cost under this share of them (1200 steps where none is estimated half the best
#: size's goodput, 1440 at 0.4): an estimate taken in a disturbance that made none look bad stood
#: for good. At a batch of 32, T = 0.7, with another process busy on one of the 2 cores for the
#: first 25 s, plain decode measured 90 ms a step (7.7 after), "auto" weighed chains of 2 1.9-2.0x
#: none and drafted them for the whole run at 25 ms a step, 0.92x none (in a run disturbed by
#: a test run alongside, 0.34x). A refresh is due at once where plain decode's estimate stands
#: over _PLAIN_BURST times a longer size's measured time (``_plain_due``): with the first 8 plain steps at a batch of
#: 32 timed 10x slow in the harness (T = 0.7, where drafting loses), "auto" without it drafted the
#: whole run, 0.65x none; with it, off after 45 steps, 0.84x (stop 113)
_PLAIN_STALE_COST = 0.0025
#: the verify times' context fit: no slope until the contexts spread this much (_ContextFit)
_CONTEXT_SPREAD = 0.1
#: speculation is chosen over none only where its estimated goodput is at least this many times
#: none's: what the step model leaves out costs speculation. The drafter's prefill of each new
#: prompt (an EAGLE head: about 12 % of the target's) happens outside decode steps; and requests
#: that accept unevenly finish apart (a static batch ends on its unluckiest ones, in steps of a
#: few sequences; continuous batching prefills their successors one by one). At a batch of 32 at
#: T = 0.7 the sizes were estimated 1.07x none and ran 0.94x (a batch of 16: 0.98x). It was 1.08
#: while plain decode's estimate also took the slow plain steps right after drafting steps
#: (_PLAIN_SETTLE): with them left out and 1.08 kept, "auto" held speculation off where it paid
#: 1.05-1.10x (batches of 16-32, T = 0) and met both adaptive goals in 40 of 72 cells of the batch
#: table against 48 before; with 1.03, 21 of 36 against 22 (stop 100, AMX Xeon).
#: (Exploration and the refresh of plain decode weigh none's goodput so scaled too.)
_SPEC_MARGIN = 1.03
#: "auto" tree sizes: the smallest size whose estimated goodput is within this factor of the best
#: size's runs (``shortest_near_best``). What the step model leaves out grows with the drafts: a
#: longer chain spreads the sequences' lengths more (acceptance varies), so a static batch ends in
#: a longer tail of a few sequences; at a batch of 4, T = 0, "auto" ran the chain of 7 where it made
#: tokens as cheaply as the chain of 5 in the full batch (0.25 ms a token each), and its batches'
#: tails (0.46 ms a token) held 2272 tokens against the chain of 5's 1526: 0.95 of its speed.
#: Not at a batch of 1 (no lengths to spread: there the best size runs)
_SIZE_MARGIN = 0.97
#: "auto" tree sizes: at batches up to this size, where the weighing's best is a chain shorter than the depth
#: and it sets a stop confidence, the chain of the depth runs with that stop: a level past the
#: best is drafted only where the path confidence is still above c*, where by the stop's own
#: measure it brings more than it costs, so the cap at the best only cuts levels worth drafting.
#: The weighing prices a chain of n as if it always drafted n levels, and its curve of mean
#: confidences flattens on a hard stretch of text, when the steps whose chains stay confident
#: are the ones a deeper level pays on: at T = 0 (16 held-out prompts, AMX Xeon) "auto" at depth
#: 7 ran chains of 6 in 26 % of its steps (4.81 tokens a step, against 5.62 at 7) and 0.949x the
#: chain of 7 (stop 102). Not at larger batches: the stop ends a step's chains only once every
#: row is under c*, and longer chains spread a static batch's lengths (_SIZE_MARGIN). Nor for a
#: sampled request, whose chain drafts every level (``SpecController.stops``): a seeded request
#: at a batch of 1 drafted the chain of 7 in 449 of 477 steps where the weighing put chains of
#: 4-6 first, 0.95-0.96x the chain of 5 (stop 115)
_STOP_AT_DEPTH = 1
#: "auto" tree sizes: the least chain seeded at a batch size when no smaller one is measured
#: (_seed_size)
_SEED_CHAIN = 4
#: "auto" tree sizes: a chain's measured drafting time counts for at most this many samples in the
#: line through the chains' (_chain_line)
_LINE_WEIGHT = 8
#: the fit of (log) verify time against the batch's context (_ContextFit): each sample's weight decays by
#: this factor per later sample of its size
_FIT_DECAY = 0.97
#: the stop confidence's ratio of a child's confidence to its parent's is taken at least this
#: (stop_confidence: a flat stretch of the curve must not collapse every chain to one level)
_MIN_CHILD_RATIO = 0.5


#: the flag of a batch-size bucket whose batch is mostly sampled requests (``_bucket``)
_SAMPLED = 1 << 24


def _bucket(batch_size: int, sampled: bool = False) -> int:
    """The key of the controller's tables for a batch of ``batch_size`` sequences: the power of two
    at or above it, flagged _SAMPLED where at least half the batch samples (its tables are its own:
    module docstring, "Greedy and sampled batches")."""
    b = 1
    while b < batch_size:
        b *= 2
    return b | (_SAMPLED if sampled else 0)


def _size(bucket: int) -> int:
    """The batch size of a bucket (without its _SAMPLED flag)."""
    return bucket & (_SAMPLED - 1)


def _smaller(b: int, bucket: int) -> bool:
    """Whether bucket ``b`` is a smaller batch size than ``bucket``, of the same kind (greedy or
    sampled: what one kind measured says nothing of the other's costs)."""
    return (b & _SAMPLED) == (bucket & _SAMPLED) and b < bucket


def _rules_out(b: int, bucket: int) -> bool:
    """Whether no speculation settled on at bucket ``b`` rules it out at ``bucket`` until probed
    (``_inherits_off``): a smaller batch size of the same kind, or a greedy batch no larger than a
    sampled ``bucket`` (a sampled chain accepts less, and sampling every verified row costs more:
    on the built-in pair every fixed setting ran slower at T = 0.7 than at T = 0, at every batch
    size measured, e.g. the chain of 5 at a batch of 16 1.06x none at T = 0, 0.84x at T = 0.7)."""
    return _smaller(b, bucket) or ((b & _SAMPLED) < (bucket & _SAMPLED) and _size(b) <= _size(bucket))


def _apart(b: int, bucket: int) -> tuple[int, int]:
    """How far apart two buckets are, for borrowing a measured shape: batch sizes (powers of two)
    apart, then of another kind (a sampled step's drafting is the nearest reference for a greedy
    one's at the same batch size, if a dearer one)."""
    return abs(_size(b).bit_length() - _size(bucket).bit_length()), int(((b ^ bucket) & _SAMPLED) != 0)


def mostly_sampled(reqs: list[Request]) -> bool:
    """At least half of ``reqs`` sample (temperature > 0): a batch whose tables are the sampled ones."""
    return 2 * sum(r.sampled for r in reqs) >= len(reqs) > 0


class SpecController:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.K = cfg.draft_budget
        self.max_model_len = max_model_len
        #: alpha (a prior until measured), greedy and sampled batches' apart (``acceptance``)
        self._acceptance = {False: TokenRate(), True: TokenRate()}
        #: ... and how it changes with the draft position, the two kinds apart (``expected_chain_tokens``)
        depth = min(self.K, cfg.num_speculative_tokens)   # (chains: no deeper than that)
        self._depth = {False: DepthShape.new(depth), True: DepthShape.new(depth)}
        #: bucket -> seconds per step outside drafting and verifying: drafting steps', and plain
        #: steps' apart (committing and appending several tokens a sequence, and the drafter's
        #: bookkeeping, cost more: at a batch of 16 0.61-0.74 ms against 0.23-0.35 plain; one
        #: shared time weighed plain decode at the drafting steps' while speculating, about 0.4 ms
        #: too slow on a 6 ms step)
        self.host_cost: dict[int, float] = {}
        self.plain_host: dict[int, float] = {}
        #: auto tree size: the share of the batch last chosen for that drafts chains without
        #: confidence (unseeded sampled requests: ``Request.unseeded_sampled``)
        self.free_share = 0.0
        #: ... and whether its chains stop at a stop confidence: only greedy chains do (the greedy
        #: chain loop; sampled requests, seeded ones too, draft their chains in full), so only an
        #: all-greedy batch runs the chain of the depth in the best chain's place (_STOP_AT_DEPTH)
        self.stops = False
        #: whether the batch last chosen for (or observed) is mostly sampled requests: its
        #: batch-size bucket is the sampled one (``_bucket``, ``_key``)
        self.sampled = False
        self._chosen: list[Request] | None = None   # the requests last chosen for (``choose``)
        self.shapes = [cfg.tree_shape(n) for n in range(1, self.K + 1)] if cfg.auto_tree else []
        self.verify_cost: dict[int, dict[int, float]] = {}   # bucket -> s -> seconds
        self.first_verify: dict[int, dict[int, float]] = {}  # bucket -> s -> first (cold) seconds
        self.confirm: dict[int, int] = {}                    # bucket -> size to run again (warm)
        #: bucket -> whether its last step was widened by another proposer's longer drafts (a
        #: prediction's): own drafts up to that width cost nothing extra, and that step's time says
        #: nothing about this method's widths
        self.widened: dict[int, bool] = {}
        self.probes: dict[int, _Probe] = {}   # bucket -> the probe under way (its measurements replace the estimates)
        #: bucket -> K -> seconds per drafting step (one K measured: K times its time per token;
        #: two or more: a curve in K, ``_curve``)
        self.draft_time: dict[int, dict[int, float]] = {}
        #: auto tree: bucket -> (levels, width) -> seconds per drafting step
        self.tree_draft_cost: dict[int, dict[tuple[int, int], float]] = {}
        #: (bucket, its key in draft_time or tree_draft_cost) -> draft cost measurements
        self.draft_samples: dict[tuple, int] = {}
        self.steps = 0
        self.last_k = self.K
        #: auto tree size: the confidence curves C(n), n = 1..K, and their calibrations (confidence.py)
        self.confidence = confidence_curves(self.K, cfg.num_speculative_tokens, native=cfg.auto_tree)
        self._weighed: dict[int, _Weighed] = {}   # auto tree size: bucket -> its last weighing of the sizes
        self.observations = 0   # verified steps observed (observe, observe_rounds)
        #: speculation rounds: the drafts per round of the engine's rounds graph (None: none compiled)
        self.round_k: int | None = None
        #: the sizes the engine runs as rounds: round_k, and 0 where it has multi-step decode
        self.round_sizes: tuple[int, ...] = ()
        self.round_time: dict[tuple[int, int], float] = {}   # (bucket, size) -> seconds per round (decode step)
        self.round_samples: dict[tuple[int, int], int] = {}  # (bucket, size) -> rounds steps measured
        self.round_tries: dict[tuple[int, int], int] = {}    # (bucket, size) -> picks to measure it
        self.best: dict[int, int] = {}   # bucket -> the size the estimates favour there (exploration aside)
        #: while speculation is off: bucket -> decode steps since it went off or was last probed, and
        #: the decode steps to wait before the next probe
        self.off_steps: defaultdict[int, int] = defaultdict(int)
        self.probe_wait: dict[int, int] = {}
        self.reprobe: dict[int, int] = {}   # bucket -> the size to probe when speculation turned off (_REPROBE_STEPS)
        self.first_probed: dict[int, int] = {}   # bucket -> the first probe's size, until the next choice (_explore)
        self.plain_samples: dict[int, int] = {}   # bucket -> one-token steps measured before t_verify(B, 1) stands
        #: bucket -> plain steps of a refresh of t_verify(B, 1) still to choose (0: the next observed
        #: one-token step is its last, whose sample replaces the estimate unless widened)
        self.refresh: dict[int, int] = {}
        #: bucket -> s -> the batch's context (sum of its sequences' lengths) where verify_cost[bucket][s]
        #: stands (averaged as the cost is), and bucket -> the fit of verify time against that context
        self.verify_context: dict[int, dict[int, float]] = {}
        self.verify_at: dict[int, dict[int, int]] = {}   # bucket -> s -> the observation that last moved it
        self.context_fit: dict[int, _ContextFit] = {}
        #: auto tree sizes, the drafter's catch-up (``_catch_up``): request -> tokens committed since
        #: the drafter last ran for it (what it catches up on before its next drafts), bucket ->
        #: the fit of drafting time against the batch's sum of those (one line per chain length,
        #: a shared slope), and (bucket, levels) -> the tokens a sequence commits a step of that chain
        self.committed: dict[str | int, int] = {}
        self.catch_up_fit: dict[int, _ContextFit] = {}
        #: while speculation is off at the batch size being chosen: its requests, else None (what
        #: switching it on would cost, ``_resume_cost``, is counted only when weighed: every 4th step)
        self.off_reqs: list[Request] | None = None
        self.chain_tokens: dict[tuple[int, int], float] = {}
        self.context: float | None = None   # the context of the step being chosen (choose) and observed
        #: bucket -> the time of its last observed step if that was an unwidened plain step (a plain
        #: run's estimate is the lesser of its last two steps)
        self.plain_prev: dict[int, float] = {}
        #: the plain steps in a row last observed, unwidened: (the batch size, the requests' ids, how
        #: many), or None after any other step (``_PLAIN_SETTLE``)
        self._plain_run: tuple[int, tuple, int] | None = None
        #: the requests of the last step observed, and steps since a request joined (_SPEC_SETTLE)
        self._seen_ids: set = set()
        self._since_join = 0
        self._since_start = 1 << 30
        self._plain_recent: list[float] = []   # the run's last two settled plain steps' t_verify (_settled_plain)
        self._plain_high: dict[int, int] = {}   # bucket -> settled plain samples in a row above the estimate's bound (_disturbed)
        #: auto tree sizes: the path confidence under which greedy chains of the size just chosen
        #: draft no further level (``stop_confidence``: the last weighing's best chain only, else None)
        self.stop_confidence: float | None = None
        #: the plain steps promised after the last one observed, while they run (``leased``)
        self._lease: _Lease | None = None

    def _key(self, batch_size: int, sampled: bool | None = None) -> int:
        """The bucket of a batch of ``batch_size`` sequences of the kind ``sampled`` (default: the
        kind last chosen for or observed, ``self.sampled``)."""
        return _bucket(batch_size, self.sampled if sampled is None else sampled)

    @property
    def acceptance(self) -> TokenRate:
        """The acceptance of chains (alpha: TokenRate) of the kind of batch last chosen for or
        observed (``sampled``): a greedy chain accepts more than a sampled one (the built-in pair's
        chain of 7: 5.6 tokens a step at T = 0 against 4.6 at T = 0.7), and a shared rate trailed a
        change of temperature by its window."""
        return self._acceptance[self.sampled]

    @acceptance.setter
    def acceptance(self, rate: TokenRate) -> None:
        self._acceptance[self.sampled] = rate

    def expected_chain_tokens(self, k: int) -> float:
        """E[tokens] of a step of chains of k drafts for the kind of batch last chosen for or
        observed: alpha's level, the positions' shape (rate.DepthShape)."""
        return self._depth[self.sampled].expected_tokens(self.alpha, k)

    @property
    def alpha(self) -> float:
        """The per-token acceptance rate of chains (TokenRate)."""
        return self.acceptance.value

    @alpha.setter
    def alpha(self, value: float) -> None:
        self.acceptance = TokenRate(value, 1.0)

    @property
    def calibration(self) -> float:
        """Auto tree size: measured accepted / predicted tokens (1 until a tree is verified), of the
        confidence model in use (confidence.py)."""
        return self.confidence.calibration

    @property
    def curve(self) -> list[float] | None:
        """Auto tree size: C(n), n = 1..K, the mean sums of the best n candidates' confidences (None
        until measured; confidence.py)."""
        return self.confidence.curve

    def cap(self, req: Request, k: int) -> int:
        return cap_drafts(req, k, self.max_model_len, self.cfg.tree)

    def choose(self, reqs: list[Request], batch_size: int | None = None, context: float | None = None) -> list[int]:
        """Draft lengths (tree sizes) for ``reqs``; ``batch_size``: the whole step's batch when
        other proposers' requests (predictions) share it (the verify cost and
        disable_by_batch_size go by it), and ``context`` its sequences' lengths summed (default:
        ``reqs``'s; the verify times are fitted against the whole forward's context)."""
        if self._lease is not None:
            self._end_lease()
        B = batch_size or len(reqs)
        self.sampled = mostly_sampled(reqs)
        self._chosen = reqs   # (``observe`` of the same step's requests need not count them again)
        bucket = self._key(B)
        auto = self.cfg.auto_tree   # (read once: a property, and every step reads it)
        sized = auto or self.cfg.adaptive
        stop = None   # (stop_confidence: only the weighing's best chain sets one)
        self.context = float(sum(r.num_computed for r in reqs)) if context is None else context
        if auto:
            self.free_share = sum(r.unseeded_sampled for r in reqs) / len(reqs) if reqs else 0.0
            self.stops = bool(reqs) and not any(r.sampled for r in reqs)
            self.off_reqs = reqs if reqs and self.best.get(bucket) == 0 else None
        for stale in (self.probes, self.refresh, self.first_probed):   # the batch moved on: its probe and refresh are stale
            for b in [b for b in stale if b != bucket]:
                del stale[b]
        if self.cfg.disable_by_batch_size is not None and B > self.cfg.disable_by_batch_size:
            k = 0
        elif (probe := self.probes.get(bucket)) is not None and probe.chosen < probe.steps:
            probe.chosen += 1   # (its next step measures a cold first size again, as ``confirm`` would)
            probe.pending = True
            k = probe.size
        elif self.refresh.get(bucket):   # (the rest of a refresh of t_verify(B, 1): _explore)
            k = 0
            self.refresh[bucket] -= 1
        elif sized and bucket in self.confirm:
            k = self.confirm.pop(bucket)  # a size measured once (cold): measure it warm
        elif sized and (size := self._round_unmeasured(bucket)) is not None:
            k = size   # (rounds at this batch size: measure them before weighing them)
            self.round_tries[(bucket, k)] = self.round_tries.get((bucket, k), 0) + 1
        elif sized and self._inherits_off(bucket) and not self.widened.get(bucket):
            k = self._inherited_off(bucket)
        elif auto:
            k = self._auto_tree_size(B, self.free_share)
            w = self._weighed.get(bucket)
            # (only greedy chains stop: a batch with a sampled request drafts its chains in full)
            stop = w.stop if w is not None and k == w.best and self.stops else None
        elif self.cfg.adaptive:
            k = self._adaptive_k(B)
        else:
            k = self.K
        self.steps += 1
        self.last_k = k
        self.stop_confidence = stop
        # (no drafts: no cap to apply; at batch 32 capping each request cost 25 us a step)
        return [self.cap(r, k) for r in reqs] if k else [0] * len(reqs)

    def drafting_off(self, batch_size: int, sampled: bool | None = None) -> bool:
        """Whether this controller drafts nothing at ``batch_size`` for now (disable_by_batch_size,
        or an adaptive size that settled on no speculation there): a new request's drafter prefill
        can wait (the drafter catches up on the whole request when it next drafts, and if it never
        does, it is never paid; a batch of 32 new 64-token prompts paid 5 % of its run for it).
        ``sampled``: whether that batch is mostly sampled requests (``mostly_sampled``; default:
        the kind last chosen for, which new requests may have changed)."""
        if self.cfg.disable_by_batch_size is not None and batch_size > self.cfg.disable_by_batch_size:
            return True
        bucket = self._key(batch_size, sampled)
        return (self.cfg.auto_tree or self.cfg.adaptive) and (self.best.get(bucket) == 0 or self._inherits_off(bucket))

    def _round_unmeasured(self, bucket: int) -> int | None:
        """A size the engine runs as rounds that is not yet measured (twice) at this batch size and
        has not been tried _ROUND_TRIES times already, once a plain one-token step is measured."""
        if not self._plain_ready(bucket):
            return None
        off = self._inherits_off(bucket)   # (then only multi-step decode is measured)
        return next((k for k in self.round_sizes if not (k and off) and self.round_samples.get((bucket, k), 0) < 2
                     and self.round_tries.get((bucket, k), 0) < _ROUND_TRIES), None)

    def plain_steps_ready(self, batch_size: int) -> bool:
        """Whether a step without drafts may run as multi-step decode: with an adaptive size, not
        while a one-token step at this batch size is still to be measured (t_verify(B, 1): the
        verify-cost curve starts from it)."""
        return self._plain_ready(self._key(batch_size))

    def _plain_ready(self, bucket: int) -> bool:
        """plain_steps_ready at a bucket."""
        return (not (self.cfg.auto_tree or self.cfg.adaptive) or 1 in self.verify_cost.get(bucket, {})
                or self._inherits_off(bucket))

    def _inherits_off(self, bucket: int) -> bool:
        """No drafting measured at this batch size yet, and a smaller one settled on no
        speculation: then so does this one until its first probe (costs only grow with the batch,
        as verification turns arithmetic-bound; acceptance does not depend on it), without first
        measuring what a smaller batch already ruled out (at a new batch of 32 that cost 16 % of a
        64-token run: two one-token steps, rounds, trees). Sampled batches also inherit it from
        greedy ones of their batch size or smaller (``_rules_out``)."""
        if self._drafted_at(bucket):
            return False
        return any(_rules_out(b, bucket) and best == 0 for b, best in self.best.items())

    def _drafted_at(self, bucket: int) -> bool:
        """Whether drafts were measured at this batch size (one-round steps or rounds)."""
        return bool(self.draft_time.get(bucket) or self.tree_draft_cost.get(bucket)
                    or any(size and b == bucket for b, size in self.round_samples))

    def _inherited_off(self, bucket: int) -> int:
        """The choice at a batch size that inherits no speculation (_inherits_off): 0, and a
        probe as at any batch size where speculation is off (its measurements end the
        inheritance)."""
        probe = 1 if self.cfg.adaptive else self._probe_size(_size(bucket))
        return self._explore(bucket, 0, lambda k: 0.0 if k else 1.0, 0, 0, probe)

    def _rounds_goodput(self, bucket: int, k: int,
                        resume: Callable[[float], float] | None = None) -> float | None:
        """Expected tokens per round over the measured time per round, when ``k`` is the rounds'
        size and their time is measured at this batch size (``resume``: what switching
        speculation on adds to a round, ``_resume_cost``)."""
        if k not in self.round_sizes or self.round_samples.get((bucket, k), 0) < 2:
            return None
        if k == 0:
            return 1.0 / self.round_time[(bucket, 0)]
        if self.cfg.auto_tree:
            if self.curve is None and self.free_share < 1:
                return None
            tokens = self._tree_tokens(self.free_share * self.expected_chain_tokens(k), self.free_share, k)
        else:
            tokens = self.expected_chain_tokens(k)
        return tokens / (self.round_time[(bucket, k)] + (resume(tokens) if resume is not None else 0.0))

    def observe_rounds(self, batch_size: int, rounds: int, seconds: float, accepted: int = 0, drafted: int = 0,
                       size: int | None = None, rejected: int | None = None,
                       committed: dict[str | int, int] | None = None) -> None:
        """One engine step of ``rounds`` speculation rounds of ``size`` drafts (default round_k;
        0: ``rounds`` steps of multi-step decode) over ``batch_size`` sequences in ``seconds``,
        whose kept rounds accepted ``accepted`` of ``drafted`` draft tokens (all sequences), and
        ``rejected`` of them ended on a rejected draft (alpha: accepted / (accepted + rejected);
        not given: accepted / drafted, which underestimates it). ``committed``: request -> the
        tokens its drafter catches up on next (speculation rounds: the last round's; multi-step
        decode: the step's requests, each counted on by ``rounds`` from what it had to catch up on
        before; ``_catch_up``, ``_resume_cost``); not given, none is known."""
        if self._lease is not None:
            self._end_lease()
        if committed is None:
            self.committed = {}
        elif size == 0:
            self.committed = {i: n + rounds for i in committed if (n := self.committed.get(i)) is not None}
        else:
            self.committed = dict(committed)
        bucket = self._key(batch_size)
        self.observations += 1
        key = (bucket, self.round_k if size is None else size)
        if key[1]:
            self.probes.pop(bucket, None)   # (a probe's size ran as rounds: the rounds stand for it)
            self._plain_run = None   # (the plain steps after drafting rounds run slow too)
            self._drafted_while_off(bucket)
        else:
            self.off_steps[bucket] += max(rounds, 0)
            self.refresh.pop(bucket, None)   # (plain steps ran as multi-step decode: measured as rounds)
        if rounds < 1 or seconds <= 0:
            return
        per, seen, old = seconds / rounds, self.round_samples.get(key, 0), self.round_time.get(key)
        self.round_samples[key] = seen + 1
        # the first step is provisional (the drafter's catch-up, cold caches)
        self.round_time[key] = per if old is None or seen < 2 else _bounded_ema(old, per)
        if not drafted or self.round_k is None:
            return
        if not self.cfg.auto_tree or self.free_share == 1:
            self.acceptance.update(accepted, drafted if rejected is None else accepted + rejected)
        elif self.curve is not None and self.free_share == 0:
            # predicted: the chain's mean confidence sum per kept round
            self.confidence.calibrate(accepted, self.confidence.chain_prediction(self.round_k, drafted / self.round_k))

    def _hosts(self, bucket: int) -> tuple[float, float]:
        """The host time of a plain step and of a drafting step at this batch size (either one
        not measured yet: the other's; neither: 0)."""
        plain, drafting = self.plain_host.get(bucket), self.host_cost.get(bucket)
        return (plain if plain is not None else drafting or 0.0,
                drafting if drafting is not None else plain or 0.0)

    def _verify_table(self, bucket: int) -> dict[int, float]:
        """The measured verify times at this batch size, each moved to the context of the step
        being chosen along the fitted growth (_ContextFit of log time): a step reads every
        sequence's keys and values, so its time grows with the batch's context, whatever its size
        (a batch of 16 of the built-in target: plain decode 4.4 ms at 72 tokens a sequence, 6.3 at
        192). Sizes are measured at different contexts (no speculation's last at the start of the
        requests or at a refresh, a size in use every step): compared as measured, plain decode
        measured near the end of one batch's requests looked 25 % dearer than it was at the start
        of the next, and "auto" speculated at a batch of 16 at T = 0.7 where it lost 10 %. Every
        size grows by the same factor per token of context, not by the same time: attention
        works for every verified token, so a size's growth scales with its time (a batch of 16,
        T = 0.7, 35 to 160 tokens a sequence: plain decode 2.5 us a token of context, five tokens
        a sequence 7.6, three times as much at three times the time; one shared slope in time
        made the larger sizes look cheaper the longer the requests ran, and "auto" turned
        speculation back on where it lost). A time moves at most in proportion to the context
        (as if attention were all of it) and to no less than half. Then no size costs more than a
        longer one (``_monotone``)."""
        table = self.verify_cost.get(bucket, {})
        fit, where, now = self.context_fit.get(bucket), self.verify_context.get(bucket), self.context
        if fit is not None and where and now is not None and (growth := fit.slope()):
            table = {s: t * _moved(growth, where[s], now) if s in where else t for s, t in table.items()}
        return _monotone(table)

    def _adaptive_k(self, B: int) -> int:
        bucket = self._key(B)
        table = self._verify_table(bucket)   # (once a choice: it fits the slope)
        t1 = table.get(1)
        if t1 is None:   # measure plain decode at this batch size first (unless drafting is free now)
            return self.K if self.widened.get(bucket) else 0
        if not self._drafted_at(bucket):   # (K at small batches, less as the batch grows: _seed_size)
            return self._first_probe(bucket, self._seed_size(B))
        plain_host, host = self._hosts(bucket)
        # drafting K tokens: the measured curve in K once two K are measured (a drafter's step has
        # a part that does not grow with K: a draft model's catch-up forward; K times the cost per
        # token measured at a small K overrated large K), else K times the cost per token (none
        # measured in one-round steps, only rounds: free)
        per_k, ks = self.draft_time.get(bucket, {}), list(range(1, self.K + 1))
        if len(per_k) >= 2:
            drafting = _curve(per_k, ks)
        else:
            per_token = sum(t / k for k, t in per_k.items())
            drafting = [k * per_token for k in ks]
        verify = _curve(table, [k + 1 for k in ks])

        def goodput(k: int) -> float:
            if (rounds := self._rounds_goodput(bucket, k)) is not None:
                return rounds * (_SPEC_MARGIN if k == 0 else 1.0)
            if k == 0:
                return _SPEC_MARGIN / (t1 + plain_host)
            t = verify[k - 1] or t1
            return self.expected_chain_tokens(k) / (drafting[k - 1] + t + host)

        best_k = max(range(self.K + 1), key=goodput)
        return self._explore(bucket, best_k, goodput, min(self.K, best_k + 1), max(0, best_k - 1), 1,
                             lambda k: k + 1)

    def _stops_key(self, bucket: int) -> bool:
        """What a weighing records of ``stops``: it decides the weighing only up to _STOP_AT_DEPTH
        (the chain of the depth in the best chain's place); past it every batch weighs alike (True),
        so a batch whose greedy and sampled requests change places keeps its weighing."""
        return self.stops or _size(bucket) > _STOP_AT_DEPTH

    def _auto_tree_size(self, B: int, free: float = 0.0) -> int:
        """The tree size by goodput (module docstring) for a batch of B sequences, a share
        ``free`` of them drafting chains without confidence (unseeded sampled requests)."""
        bucket = self._key(B)
        weighed = self._weighed.get(bucket)   # (first: a weighing stands only where all below held)
        lead = self._chosen[0].request_id if self._chosen else None   # (_Weighed.lead; choose set _chosen)
        if (weighed is not None and weighed.free == free and weighed.batch == B
                and weighed.stops == self._stops_key(bucket)
                and self.observations - weighed.at < (weighed.wait if not weighed.best or weighed.lead == lead
                                                      else _REWEIGH_STEPS)):
            return self._explore_weighed(bucket, weighed)
        table = self._verify_table(bucket)   # (once a weighing: it fits the slope)
        t1 = table.get(1)
        if t1 is None:   # measure plain decode at this batch size first (unless drafting is free now)
            return self._probe_size(B) if self.widened.get(bucket) else 0
        top = min(self.K, self.cfg.num_speculative_tokens) if free == 1 else self.K   # (chains only)
        if (self.curve is None and free < 1) or not self.tree_draft_cost.get(bucket):
            return self._first_probe(bucket, min(top, self._seed_size(B)))   # the head's confidences and the costs
        per_width, (plain_host, host) = self.tree_draft_cost[bucket], self._hosts(bucket)
        if free < 1 and self.curve is not None:
            # sizes past the first within _FLAT_TOKENS of the most confidence expect no more tokens
            # (about 1 % of a step's), at a higher verify cost: never weighed (the built-in head's
            # curve is flat past about 6 of 64 sizes, and weighing all 64 was most of a choice's
            # 0.11 ms a step)
            most = self.curve[-1] - _FLAT_TOKENS
            flat = next(n for n, c in enumerate(self.curve, 1) if c >= most)
            top = min(top, max(flat, self.cfg.num_speculative_tokens))
        # what verifying n nodes drafts and verifies: all chains (free = 1), else the tree
        shapes = [(lv, 1) if free == 1 else (lv, w) for lv, w in self.shapes[:top]]
        verify = _curve(table, [lv + 1 if free == 1 else n + 1 for n, (lv, _) in enumerate(shapes, 1)])
        drafting: dict[tuple[int, int], float] = {}
        chains = self._chain_draft_times(bucket)
        for shape in set(shapes):
            levels, width = shape
            if width == 1 and len(chains) >= 2:   # a chain: along the chains' curve in levels
                drafting[shape] = _curve(chains, [levels])[0]
                continue
            t_draft, near = _borrowed(per_width, shape)
            if near[1] < width:   # wider than any measured here: as much dearer as where it was measured
                t_draft *= self._widening(bucket, shape, near[1])
            drafting[shape] = t_draft
        chain = ([free * self.expected_chain_tokens(lv) for lv in range(self.cfg.num_speculative_tokens + 1)] if free
                 else [0.0] * (self.cfg.num_speculative_tokens + 1))   # (no chains without confidence: none of their tokens)
        gp = [1.0 / (t1 + plain_host)]
        cal = self.calibration   # (read once: every step weighs up to K sizes)
        model = self.confidence.model_curve(len(shapes)) if free < 1 else None
        resume = self._resume_cost(bucket)
        share = 1 - free   # (_tree_tokens inlined: every weighing runs this for up to K sizes)
        for n, (shape, t) in enumerate(zip(shapes, verify), 1):
            tokens = chain[shape[0]] if model is None else chain[shape[0]] + share * (1.0 + cal * model[n - 1])
            cost = drafting[shape] + (t or t1) + host
            gp.append(tokens / (cost + resume(tokens)) if resume is not None else tokens / cost)
        for k in self.round_sizes:
            if k < len(gp) and (rounds := self._rounds_goodput(bucket, k, resume)) is not None:
                gp[k] = rounds
        gp[0] *= _SPEC_MARGIN
        best = shortest_near_best(gp, _SIZE_MARGIN if _size(bucket) > 1 else 1.0)   # (one sequence: no spread)
        depth = self.cfg.num_speculative_tokens
        stop, ratio = None, 1.0
        if free == 0 and 2 <= best <= depth and len(chains) >= 2:
            # a level of the best chain: what it adds to the step's time, in tokens at the best's
            # goodput, at the mean slopes (the last level's own differences swung c* 3x): drafting
            # across the chains measured or borrowed (never _curve's flat part below them), verifying
            # from plain decode on
            lo, hi = min(chains), max(chains)
            extra = (chains[hi] - chains[lo]) / (hi - lo) + ((verify[best - 1] or t1) - t1) / best
            m = self.curve   # (the child's confidence: its parent's times about m_best / m_best-1)
            prev = 0.0 if m is None or len(m) < best else m[best - 2] - (m[best - 3] if best >= 3 else 0.0)
            ratio = min(1.0, max((m[best - 1] - m[best - 2]) / prev if prev > 0 else 1.0, _MIN_CHILD_RATIO))
            stop = stop_confidence(extra * gp[best], cal, self.confidence.gamma, ratio)
            if stop is not None and self.stops and _size(bucket) <= _STOP_AT_DEPTH and best < depth:
                best = depth   # the chain of the depth, stopped at c* (_STOP_AT_DEPTH)
        # neighbours to explore: the next chain lengths up to the depth (close in cost, so a chain one
        # level longer must stay measured: with 2 x best only, a spike in the chain of 5's drafting
        # cost kept "auto" on chains of 4 for a whole run), tree sizes by halves and doubles past it
        up = best + 1 if best < depth else best * 2
        down = best - 1 if best <= depth else max(depth, best // 2)
        w = _Weighed(self.observations, B, free, gp, best, min(top, max(1, up)), max(0, down),
                     min(top, self._probe_size(B)), stop, ratio, stops=self._stops_key(bucket))
        if (best == 0 and weighed is not None and weighed.best
                and (not weighed.holding or self._since_start < _START_HOLD)
                and _size(bucket) >= _HOLD_FROM and weighed.free == free and weighed.stops == self._stops_key(bucket)
                and weighed.best < len(gp)):
            # speculating, and no speculation weighed best for the first time (or in a batch's first
            # _START_HOLD steps): the last best size runs on until the next weighing agrees
            # (_Weighed.holding; not across another share
            # of unseeded sampled requests, whose sizes are weighed apart, nor past the sizes
            # weighed now: its neighbours are looked up in this weighing's goodputs)
            w = replace(weighed, at=self.observations, batch=B, goodput=gp, up=min(weighed.up, len(gp) - 1),
                        down=min(weighed.down, len(gp) - 1), holding=True, wait=_REWEIGH_STEPS)
        else:   # at a batch of one, a weighing that agrees with the last doubles the wait (the same request's
            # when speculating): _REWEIGH_SETTLED, _REWEIGH_OFF_SETTLED
            agrees = (weighed is not None and weighed.best == best and not weighed.holding and _size(bucket) == 1
                      and weighed.free == free and weighed.stops == self._stops_key(bucket)
                      and (not best or weighed.lead == lead))
            first, most = (_REWEIGH_STEPS, _REWEIGH_SETTLED) if best else (_REWEIGH_OFF_STEPS, _REWEIGH_OFF_SETTLED)
            w.wait = min(2 * weighed.wait, most) if agrees else first
        w.lead = lead
        self._weighed[bucket] = w
        return self._explore_weighed(bucket, w)

    def _catch_up(self, reqs: list[Request], result: AcceptanceResult, bucket: int, shape: tuple[int, int],
                  t_draft: float, num_draft: list[int]) -> float:
        """A drafting step's time moved to what the shape costs when run step after step. A step's
        drafting starts with the drafter catching up on the tokens the last step committed (an
        EAGLE head's forward over their target features), so a chain drafted after a longer one
        pays for the longer one's acceptance: at a batch of 16, the chain of 5 drafted 3.5-4.1 ms
        a step after chains of 5 and 4.2-4.9 after chains of 8, and, explored between the longer
        chains "auto" ran, it looked that much dearer (and the longer chains cheaper). The time
        is fitted against the tokens the batch caught up on, x (what these requests committed
        since the drafter last ran for them), one line per chain length with a shared slope
        (_ContextFit); the sample is moved along the slope from x to what a step of this chain commits (its mean per sequence
        measured over steps of it, times the batch) -> that time. A step after plain ones caught up
        on their tokens too (``observe`` and ``observe_rounds`` count them on): it goes into the fit
        (what switching speculation on costs: ``_resume_cost``; a probe's first step's time is
        not used as a cost anyway). Steps after a prefill (new requests: what the drafter caught up
        on is unknown), trees, and chains cut short
        (the stop confidence, max_tokens) are left as measured and out of the fit: a chain that
        stops where the head is unsure drafts fewer levels after a stretch that accepted little,
        and at a batch of 1 those steps steepened the slope until explored short chains looked
        cheap ("auto" at depth 10 then accepted 5.6 tokens a step against 5.9-6.1)."""
        done = [1 + n for n in result.num_accepted]
        ids = [r.request_id for r in reqs]
        caught = [self.committed.get(i) for i in ids]
        self.committed = dict(zip(ids, done))
        levels, width = shape
        if width != 1 or max(num_draft) < self.last_k:
            return t_draft   # (a tree, or a chain the stop confidence or max_tokens cut short of the size chosen)
        key = (bucket, levels)
        old = self.chain_tokens.get(key)
        own = sum(done) / len(done)
        self.chain_tokens[key] = own if old is None else _ema(old, own)
        if any(c is None for c in caught):
            return t_draft
        x = float(sum(caught))
        fit = self.catch_up_fit.setdefault(bucket, _ContextFit())
        fit.add(levels, x, t_draft)
        if old is None or not (slope := fit.slope()):
            return t_draft
        return max(0.5 * t_draft, t_draft + slope * (old * len(reqs) - x))

    def _resume_cost(self, bucket: int) -> Callable[[float], float] | None:
        """While speculation is off at this batch size: what switching it on adds to each step,
        given the tokens a step expects per sequence -> seconds, or None (on, or no catch-up slope
        fitted yet). The first drafting step catches the drafter up on every token since it last
        drafted (``self.off_reqs``), at the fitted slope (``_catch_up``), beyond the tokens a step of
        the size catches up on anyway (in its measured time); spread over the steps the requests
        have left at that size, at least an exploration interval (requests without max_tokens have
        the rest of the context left: the charge is then small). At a batch of 32 on an AVX2 CPU
        such a step after 48 plain ones took 185 ms against 93 for the chain of 3 step after step,
        where the chain ran even with no speculation: unweighed, "auto" switched it on and off
        again and again, 0.84-0.93x none."""
        fit = self.catch_up_fit.get(bucket)
        reqs = self.off_reqs
        if reqs is None or fit is None or not (slope := fit.slope()):
            return None
        # the tokens the drafter would catch up on (a request not known to ``committed`` counts its
        # whole sequence: while off its drafter prefill waits, ``drafting_off``), the tokens left
        # per sequence, and the sequences (this controller's: B may count predictions too)
        pending = sum(self.committed.get(r.request_id, r.num_computed) for r in reqs)
        left, n = sum(r.max_tokens - len(r.output_ids) for r in reqs) / len(reqs), len(reqs)
        interval = self.cfg.adaptive_explore_interval
        return lambda tokens: slope * max(0.0, pending - n * tokens) / max(interval, left / tokens)

    def _widening(self, bucket: int, shape: tuple[int, int], measured: int = 1) -> float:
        """How much dearer than ``_borrowed`` says a shape wider than any measured at this batch
        size (``measured``: the widest there) is: at another batch size that measured a shape wider
        than ``measured`` and one no wider, the wide shape's time over what ``_borrowed`` makes of
        it from the others; the wide shape closest in width to ``shape`` (as wide or wider before
        narrower: a narrower one's ratio is a lower bound), then the nearest batch size. At least 1;
        1 where no batch size measured both. Borrowed at face value from the chain of 10, a tree of
        11 nodes (10 levels, 2 wide: the fused tree loop) looked as cheap as the chain at a batch
        of 16 and drafted 4 steps at 22 ms against the chain's 8, where at a batch of 1 it had
        measured 14.1 ms against 4.0; and at a batch of 4 a 59-node tree (10 levels, 4 wide, never
        measured) ran 3 steps of 40 ms (13 ms of drafting) against the chain of 10's 9.6 (3.4)."""
        levels, width = shape
        best: tuple[tuple[int, int, int], float] | None = None   # ((width gap, narrower, batch sizes apart), factor)
        for b, all_costs in self.tree_draft_cost.items():   # (first samples are cold: left out)
            costs = {lw: t for lw, t in all_costs.items() if self.draft_samples.get((b, lw), 0) >= 2}
            wide = [lw for lw in costs if lw[1] > measured]
            narrow = {lw: t for lw, t in costs.items() if lw[1] <= measured}
            if b == bucket or not wide or not narrow:
                continue
            m = min(wide, key=lambda lw: (abs(lw[1] - width), lw[1] < width, abs(lw[0] - levels), lw))
            guess = _borrowed(narrow, m)[0]
            if guess > 0:
                key = (abs(m[1] - width), int(m[1] < width), _apart(b, bucket))
                if best is None or key < best[0]:
                    best = (key, costs[m] / guess)
        return max(1.0, best[1]) if best is not None else 1.0

    def _chain_draft_times(self, bucket: int) -> dict[int, float]:
        """Auto tree sizes: levels -> drafting seconds of a chain at this batch size: the measured
        ones (``_chains_measured``), and each level outside their range along the curve of the
        nearest batch size where two or more chains are measured, among those whose chains span
        that level if any, scaled to the nearer end of the range measured here (and never a shorter
        chain dearer than a longer one) (a step's drafting is the head's catch-up on the
        tokens just accepted plus one forward per level, in about the same proportions at every
        batch size). Without such a curve only the measured ones (a chain measured alone then lends
        its time to the others, never scaled down: ``_auto_tree_size``; with two or more, ``_curve``
        is flat below them). A batch size seeded at the top of the range (``_seed_size``) measures
        its longest chains first, and the shorter chains borrowing their time looked too dear to
        try: "auto" took 64 steps to come down from the chain of 7 to the chain of 5 at a batch of
        32, 0.90x the chain of 5; at depth 10, seeded at 8 and with 8-9 measured at batches of 16
        and 32 alone, it never tried a chain under 8 there."""
        own = self._chains_measured(bucket)
        if not own:
            return own
        refs = {b: chains for b in self.tree_draft_cost if b != bucket and len(chains := self._chains_measured(b)) >= 2}
        lo, hi = min(own), max(own)
        out = dict(own)
        for lv in range(1, self.cfg.num_speculative_tokens + 1):
            if lo <= lv <= hi or not refs:
                continue
            cover = [b for b, chains in refs.items() if min(chains) <= lv <= max(chains)]
            ref = refs[min(cover or refs, key=lambda b: (_apart(b, bucket), b))]
            edge = lo if lv < lo else hi
            t_edge, t_lv = _curve(ref, [edge, lv])
            if t_edge and t_lv and t_edge > 0 and t_lv > 0:
                out[lv] = own[edge] * t_lv / t_edge
        # (levels borrowed from different batch sizes' curves: never a shorter chain dearer than a
        # longer one)
        for lv in range(lo - 1, 0, -1):
            if lv in out and lv + 1 in out:
                out[lv] = min(out[lv], out[lv + 1])
        for lv in range(hi + 1, self.cfg.num_speculative_tokens + 1):
            if lv in out and lv - 1 in out:
                out[lv] = max(out[lv], out[lv - 1])
        return out

    def _chains_measured(self, bucket: int) -> dict[int, float]:
        """Levels -> the measured drafting seconds of chains at this batch size (three or more
        measured twice or more: on the line through those, ``_chain_line``)."""
        own = {lv: t for (lv, w), t in self.tree_draft_cost.get(bucket, {}).items() if w == 1}
        samples = {lv: self.draft_samples.get((bucket, (lv, 1)), 1) for lv in own}
        if sum(n >= 2 for n in samples.values()) < 3:
            return own
        return _chain_line(own, samples)

    def _explore_weighed(self, bucket: int, w: _Weighed) -> int:
        """_explore over a weighing of the auto tree sizes."""
        shapes = self.shapes   # (a size's verified tokens: its nodes + 1, or its levels + 1 where all draft chains)
        return self._explore(bucket, w.best, w.goodput.__getitem__, w.up, w.down, w.probe,
                             (lambda n: shapes[n - 1][0] + 1) if w.free == 1 else (lambda n: n + 1))

    def _tree_tokens(self, chains: float, free: float, n: int, cal: float | None = None,
                     model: list[float] | None = None) -> float:
        """Expected tokens per sequence of a step verifying n nodes, in a batch whose share
        ``free`` drafts chains without confidence (expecting ``chains``: free x E[tokens] of their
        levels) and the rest trees (1 + a C_gamma(n): confidence.py); ``cal`` and ``model``: the
        calibration a and C_gamma(1..), when the caller read them."""
        if free >= 1:
            return chains
        a = self.calibration if cal is None else cal
        model = self.confidence.model_curve(n) if model is None else model
        return chains + (1 - free) * (1.0 + a * model[n - 1])

    def _explore(self, bucket: int, best: int, goodput: Callable[[int], float], up: int, down: int,
                 probe: int, tokens: Callable[[int], int] | None = None) -> int:
        """``best``, except every ``adaptive_explore_interval`` steps: a neighbour (``up`` and
        ``down`` in turn) if its estimated goodput is within 15 % of best's, so close calls stay
        measured (from a batch of _HOLD_FROM, within 30 % where the verify time of its ``tokens`` a
        sequence went stale: _STALE_MARGIN); while speculation is off, ``probe`` when one is due (_probe_due) keeps acceptance
        (and a tree's confidences and calibration) current. A probe runs _PROBE_STEPS steps, and its
        measurements replace the estimates of its size (they may be many steps old: averaging
        fresh samples into them would keep speculation off long after what turned it off is gone):
        verify cost from its first step, drafting cost from its second (the first also catches the
        drafter up on every token since it last ran), acceptance from all of them together (one
        step's acceptance is too noisy: at T = 0.7 one unlucky step turned speculation off again).
        (A batch size's first probe, ``_first_probe``, runs _FIRST_PROBE_STEPS steps and adds its
        acceptance to what other batch sizes measured: it replaces nothing, so one cut short by
        the batch moving on cannot leave one step's acceptance as everyone's.) While speculating
        where no speculation is estimated within _PLAIN_CLOSE of best: 0, the first of a refresh's
        _PLAIN_FIRST plain steps (module docstring; ``choose`` runs the rest)."""
        interval = self.cfg.adaptive_explore_interval
        last, self.best[bucket] = self.best.get(bucket), best
        first = self.first_probed.pop(bucket, None)   # (the first choice after the first probe here)
        if best == 0 and ((last and _size(bucket) >= _HOLD_FROM) or first):
            # (turned off after speculating, or right after the first probe at this batch size, on
            # its few steps of acceptance: _REPROBE_STEPS)
            self.reprobe[bucket] = last or first
            self.off_steps[bucket] = 0
            self.probe_wait[bucket] = _REPROBE_STEPS
        if best == 0 and self._probe_due(bucket):
            probe = self.reprobe.pop(bucket, probe)
            self.probes[bucket] = _Probe(probe)
            return probe
        if best:
            self.off_steps.pop(bucket, None)
            self.probe_wait.pop(bucket, None)
            self.reprobe.pop(bucket, None)
        # t_verify(B, 1) again, at the context the sizes now run at (not where the engine runs plain
        # steps as multi-step decode, measured as rounds, nor while other proposers widen the steps)
        period = max(_PLAIN_REFRESH * interval, _PLAIN_REFRESH_STEPS)
        if (best and self.steps % period == period - 1 and 0 not in self.round_sizes
                and not self.widened.get(bucket) and self._plain_due(bucket, goodput(0) / goodput(best))):
            self.refresh[bucket] = _PLAIN_FIRST - 1
            return 0
        if self.steps and self.steps % interval == 0:
            n = self.steps // interval
            cand = up if n % 2 == 1 else down
            # while speculation is off, the size up every 2 x bucket intervals only (probes' scaling:
            # a drafting step after plain ones first catches the drafter up on every token since it
            # last drafted, B per step; at a batch of 32 on an AVX2 CPU a chain of 1 explored after
            # 60 plain steps of 17 ms took 107 ms, and with one every 2 intervals "auto" ran
            # 0.88-0.94x none in traces at batches of 16-32, where it had settled on none)
            # (a speculating neighbour whose verify time went stale: within _STALE_MARGIN)
            margin = (_STALE_MARGIN if best and cand and tokens is not None and _size(bucket) >= _HOLD_FROM
                      and self._stale(bucket, tokens(cand)) else _EXPLORE_MARGIN)
            if (cand != best and (best or self._explores_up_while_off(bucket, self.steps))
                    and goodput(cand) >= margin * goodput(best)):
                return cand
        return best

    def _plain_due(self, bucket: int, ratio: float) -> bool:
        """Whether plain decode is due a refresh while speculating at this batch size, where no
        speculation's estimated goodput is ``ratio`` of the best size's: it is within _PLAIN_CLOSE,
        or t_verify(B, 1) went unmeasured for as many steps as keep a refresh's cost (its
        _PLAIN_FIRST plain steps, each 1 - ratio of a step short of the best size's) under
        _PLAIN_STALE_COST of them, or it stands over _PLAIN_BURST times a longer size's measured
        time (measured slow: ``_monotone`` reads it at that time meanwhile; at a batch of 1 a few
        tokens verify in about one's time, and timing noise alone must not call a refresh)."""
        table = self.verify_cost.get(bucket, {})
        t1 = table.get(1)
        if ratio >= _PLAIN_CLOSE or (t1 is not None and any(_PLAIN_BURST * t < t1 for s, t in table.items()
                                                            if s > 1)):
            return True
        return self._unmeasured_for(bucket, 1) >= _PLAIN_FIRST * (1 - ratio) / _PLAIN_STALE_COST

    def _first_probe(self, bucket: int, size: int) -> int:
        """The first drafts at a batch size: a probe of ``size`` for _FIRST_PROBE_STEPS steps (its
        steps measure the costs of that size as a probe's do; acceptance goes into the running
        estimates). Never the rounds' size: the engine runs that as rounds, which measure neither
        a one-round drafting cost nor the confidences (the probe then came back every step)."""
        if size == self.round_k and size in self.round_sizes:
            size = size - 1 if size > 1 else size + 1
        self.probes[bucket] = _Probe(size, steps=_FIRST_PROBE_STEPS, replaces=False)
        self.first_probed[bucket] = size
        return size

    def _probe_due(self, bucket: int) -> bool:
        """Whether speculation, off at this batch size, is due a probe: after 8 exploration intervals
        of decode steps (tokens per sequence: a multi-step decode step counts its steps, so a probe
        comes as soon after a bad stretch of text as with one-token steps; counted in engine steps,
        8 steps each, a draft model's adaptive K sat out 1000 tokens of prompts it drafted well at
        0.84x fixed K) times the batch-size bucket (the same number of tokens in all: a probe's
        steps and the drafter's catch-up cost grow with the batch, and large batches are where
        speculation pays least), twice as long after each probe that leaves it off (up to
        _PROBE_BACKOFF times). After a turn-off from speculating at a batch of _HOLD_FROM or more,
        or by the first weighing at a batch size (``_explore``): _REPROBE_STEPS, once, and the
        usual wait after that probe."""
        base, wait = self._probe_wait(bucket)
        if self.off_steps[bucket] < wait:
            return False
        self.off_steps[bucket] = 0
        self.probe_wait[bucket] = base if bucket in self.reprobe else min(2 * wait, _PROBE_BACKOFF * base)
        return True

    def _probe_wait(self, bucket: int) -> tuple[int, int]:
        """(the first wait, the current wait) in off steps before a probe at this batch size
        (``_probe_due``)."""
        base = 8 * self.cfg.adaptive_explore_interval * _size(bucket)
        return base, self.probe_wait.get(bucket, base)

    def _explores_up_while_off(self, bucket: int, steps: int) -> bool:
        """Whether ``_explore`` at choice count ``steps`` may try the size up while speculation is off
        at this batch size: every 2 x bucket exploration intervals (its comment)."""
        interval = self.cfg.adaptive_explore_interval
        return bool(steps) and steps % interval == 0 and (steps // interval) % (2 * _size(bucket)) == 1

    def _seed_size(self, B: int) -> int:
        """The size of the first drafts at a batch of B sequences: the size the estimates settled on
        at the next smaller batch size measured, when there is one (speculation's costs only grow
        with the batch and acceptance does not depend on it, so the best size there bounds the best
        size here from above: probing it measures the top of the range, and the verify cost of the
        sizes below is interpolated between it and plain decode, where extrapolating up from a
        probe of 1 made each longer chain look dearer than it is and "auto" climbed one level per
        exploration interval: chains of 1-3 for a whole 128-token run at a batch of 16, 0.92x
        the chain of 7), else _probe_size. A tree is seeded no wider than the chain of the depth or
        _probe_size (a wide tree that paid at a batch of 1 is dear to verify 8 steps at 32). With
        no smaller batch size measured, "auto" tree sizes seed a chain of _SEED_CHAIN levels (up
        to the depth) at least: seeded with _probe_size's chain of 1 at a first batch of 32, the
        longer chains borrowed its drafting time (a head's catch-up on the batch's accepted tokens
        and one level, 8 ms) scaled up by levels, looked hopeless and were never tried: depth 10
        ran chains of 0-1, about 1.0x none, where the chain of 5 made 1.3x."""
        bucket = self._key(B)
        prior = max((b for b in self.best if _smaller(b, bucket)), default=None)
        if prior is None and self.cfg.auto_tree:
            return max(self._probe_size(B), min(self.cfg.num_speculative_tokens, _SEED_CHAIN))
        if prior is None or self.best[prior] == 0:
            return self._probe_size(B)
        if self.cfg.auto_tree:
            return min(self.best[prior], max(self.cfg.num_speculative_tokens, self._probe_size(B)))
        return self.best[prior]

    def _probe_size(self, B: int) -> int:
        """The tree size (or K) tried before any is measured at this batch size: 16 nodes per
        sequence at batch 1, fewer as the batch grows (a batch of 32 verifying 17 tokens each costs
        about 8 plain steps on a 2-core CPU). Every candidate's confidence is known whatever the size
        verified (DraftBatch.candidate_scores); the probe only has to measure the costs. An
        adaptive K's first probe likewise: K = 4 at a batch of 32 (110M shape, float32) cost 4.1
        plain steps a step, and its 8 steps took the first 48-token run to 0.83x no speculation;
        one token measures the verify slope, the drafting cost per token and alpha as well."""
        return max(1, min(self.K, 16 // B))

    def _observe_tree(self, drafts: DraftBatch, result: AcceptanceResult, probe: _Probe | None = None,
                      levels: list[int] | None = None, ratio: float | None = None) -> None:
        """Update the confidence curves and the calibrations from one verified step
        (confidence.py: position n of a curve moves only with the proposals whose tree grew at
        least n candidates). ``levels``: per request, the levels a chain is extended to (the depth,
        capped): a chain of fewer counts the levels it did not draft at its last level's confidence
        times a child's ratio per level: ``ratio`` where the step's chains stopped early
        (``stop_confidence``; left out, the deep positions moved only with the steps where some
        chain stayed confident, and read high), else its own last level's (the last confidence over
        the one before it, within _MIN_CHILD_RATIO-1). Left out, the positions past a short chain
        kept what they last read: after a stretch of unsure drafts their increments sat at 0.01-0.03
        while "auto" ran chains of 4-5 that never measured them again: at T = 0, batch 1, it ran
        chains of 4-6 in 40-60 % of its steps, where on the chain of 7's own steps cutting every
        chain to 6 / 5 levels makes 6 % / 13 % fewer tokens a second (the chains' own confidences,
        not the padding, decide what is predicted: only verified candidates count)."""
        scores = drafts.candidate_scores
        if not scores or not any(scores):   # (None: a sampled chain's, without confidence)
            return
        if levels is not None:
            scores = [sc if sc is None or not sc or len(sc) >= n else _extended(sc, n, ratio)
                      for sc, n in zip(scores, levels)]
        kept = [b for b, sc in enumerate(scores) if sc is not None]
        accepted = sum(result.num_accepted[b] for b in kept if drafts.num_draft[b])
        predicted = self.confidence.observe([scores[b] for b in kept], [drafts.num_draft[b] for b in kept],
                                            [result.num_accepted[b] for b in kept])
        if predicted is None:
            return
        if probe is not None and probe.replaces:   # a probe's steps replace the sums by their own
            probe.accepted += accepted
            probe.predicted = predicted if probe.predicted is None else [
                a + b for a, b in zip(probe.predicted, predicted)]
            self.confidence.replace_calibration(probe.accepted, probe.predicted)
        else:
            self.confidence.calibrate(accepted, predicted)

    def observe(self, reqs: list[Request], drafts: DraftBatch, result: AcceptanceResult,
                t_draft: float, t_verify: float, batch_size: int | None = None,
                verify_tokens: int | None = None, t_step: float | None = None) -> None:
        """One verified step of ``reqs`` (this controller's requests) with ``drafts``; ``t_verify``
        timed the whole step's forward (and acceptance), of ``batch_size`` sequences (default:
        len(reqs)) and ``verify_tokens`` tokens per sequence (default: these drafts' longest + 1);
        ``t_step`` the whole step, choosing the sizes, committing and outputs included (the rest
        is t_host). A step widened by another proposer's longer drafts updates acceptance and
        drafting cost, not the verify costs of this method's widths."""
        if self._lease is not None:
            self._end_lease()
        if reqs is not self._chosen:
            self.sampled = mostly_sampled(reqs)
        bucket = self._key(batch_size or len(reqs))
        auto = self.cfg.auto_tree   # (read once: a property, and every step reads it)
        self.observations += 1
        s = max(drafts.num_draft, default=0) + 1
        if s > 1:
            self._drafted_while_off(bucket)
        probe = self.probes.get(bucket)
        if probe is not None and (not probe.pending or s == 1):   # not a probe step: the probe is cut short
            del self.probes[bucket]
            probe = None
        elif probe is not None:   # (its drafts may be fewer than asked for: capped, or sampled chains)
            probe.pending = False
            probe.seen += 1
            if probe.seen >= probe.steps:
                del self.probes[bucket]
        fresh = probe is not None and probe.seen == 1         # verify cost
        fresh_draft = probe is not None and probe.seen == 2   # past the drafter's catch-up
        if auto:
            # chains short of the depth: their levels up to it extrapolated (_observe_tree), at the
            # stop confidence's ratio where the chains stopped short of what was asked
            ratio = None
            if (self.stop_confidence is not None and max(drafts.num_draft, default=0) < self.last_k
                    and (w := self._weighed.get(bucket)) is not None):
                ratio = w.ratio
            depth = self.cfg.num_speculative_tokens
            if drafts.total:   # (a plain step teaches the curves nothing; capping each request cost 25 us at 32)
                self._observe_tree(drafts, result, probe, [self.cap(r, depth) for r in reqs], ratio)
        settled, widened = True, (verify_tokens or s) > s
        ids, seen = tuple(r.request_id for r in reqs), self._seen_ids
        if joined := sum(i not in seen for i in ids):
            self._since_join = 0
            if 2 * joined > len(ids):   # (most of the batch new: a batch's start)
                self._since_start = 0
            self._seen_ids = set(ids)
        else:
            self._since_join += 1
            self._since_start += 1
            if len(seen) != len(ids):
                self._seen_ids = set(ids)
        if s == 1 and not widened:
            settled = self._plain_step(batch_size or len(reqs), ids)
        else:   # (a drafting step, or one widened by another proposer's drafts)
            self._plain_run = None
            settled = self._since_join >= _SPEC_SETTLE
        self._measure(bucket, s, t_verify, None if t_step is None else max(0.0, t_step - t_draft - t_verify),
                      widened, fresh, settled)
        n_draft = drafts.total
        if n_draft:
            # a step's drafting time at its K; a tree's at its shape (how many nodes are verified
            # out of those grown is free)
            if auto:
                costs, key = self.tree_draft_cost.setdefault(bucket, {}), self.cfg.tree_shape(s - 1)
            else:
                costs, key = self.draft_time.setdefault(bucket, {}), max(drafts.num_draft)
            # the first drafting step also pays for catching up on the prompt (EAGLE's head, a
            # draft model's prefill) and for cold shapes: the second sample replaces it
            seen = self.draft_samples.get((bucket, key), 0)
            self.draft_samples[(bucket, key)] = seen + 1
            old = costs.get(key)
            if auto:   # (a probe's first step too: into the fit)
                t_draft = self._catch_up(reqs, result, bucket, key, t_draft, drafts.num_draft)
            else:
                self.committed = {}
            if not fresh or old is None:   # a probe's first drafting step also catches up on what it skipped
                costs[key] = t_draft if old is None or seen < 2 or fresh_draft else _bounded_ema(old, t_draft)
            # alpha: from chains (auto tree sizes: the sampled chains, without confidence)
            scores = drafts.candidate_scores if auto else None
            chains = [b for b, n in enumerate(drafts.num_draft)
                      if n and (not auto or (scores is not None and scores[b] is None))]
            plists = drafts.parent_lists() if drafts.parents is not None and chains else None
            # per chain: accepted, and tried (the accepted and the rejected one, if any)
            counts = [(m := result.num_accepted[b], m + _stopped_early(result, b, drafts.num_draft[b],
                                                                      plists and plists[b])) for b in chains]
            accepted, tried = sum(m for m, _ in counts), sum(t for _, t in counts)
            self._depth[self.sampled].update(counts)
            if probe is not None and probe.replaces and tried:   # the probe's pooled rate replaces the estimate
                probe.tokens += accepted
                probe.tried += tried
                self.acceptance = TokenRate(probe.tokens, probe.tried)
            else:
                self.acceptance.update(accepted, tried)
        else:   # (the drafter's next catch-up also covers this step's token)
            self.committed = {r.request_id: n + 1 for r in reqs
                              if (n := self.committed.get(r.request_id)) is not None}
            if reqs is self._chosen and not self.last_k and len(reqs) == (batch_size or len(reqs)):
                self._grant(reqs, bucket)

    def _drafted_while_off(self, bucket: int) -> None:
        """Drafts ran at this batch size (a probe, exploration, rounds): a weighing of no
        speculation left out what they measured, so the next choice weighs again (from
        _REWEIGH_OFF_STEPS)."""
        if (w := self._weighed.get(bucket)) is not None and not w.best:
            del self._weighed[bucket]

    def _grant(self, reqs: list[Request], bucket: int) -> None:
        """After a plain step of the whole batch ``reqs``: promise the next steps of the same
        requests that ``choose`` would certainly draft nothing for (a lease, ``leased``), up to
        _LEASE_STEPS: any while disable_by_batch_size turns drafting off at this batch size; with
        "auto" tree sizes off at this batch size (no speculation weighed best, or inherited), those
        before its next weighing, its next probe and any step that may explore a size up
        (``_explore``: none where the weighing puts the size up outside its margin), with no
        probe, refresh, confirmation or rounds to measure and no other proposer widening its
        steps. The leased steps measure what plain steps measure, all at
        once when the lease ends (``_end_lease``): the same as step by step, as nothing reads
        them in between."""
        B = len(reqs)
        if self.cfg.disable_by_batch_size is not None and B > self.cfg.disable_by_batch_size:
            n = _LEASE_STEPS
        elif (not self.cfg.auto_tree or self.round_sizes or self.widened.get(bucket) or bucket in self.probes
              or bucket in self.refresh or bucket in self.confirm or 1 not in self.verify_cost.get(bucket, {})):
            return
        else:
            n = self._probe_wait(bucket)[1] - self.off_steps[bucket]   # (step j's choose sees off_steps + j - 1)
            # (whether a step of the lease may explore the size up, _explore: never where the batch
            # size inherits no speculation, _inherited_off, whose sizes up and down are 0)
            explores = False
            if not self._inherits_off(bucket):
                w = self._weighed.get(bucket)
                if (w is None or w.best or w.batch != B or w.free != self.free_share
                        or w.stops != self._stops_key(bucket)):
                    return
                n = min(n, w.wait - (self.observations - w.at))
                # (_explore tries the size up only within _EXPLORE_MARGIN of the best's goodput: this
                # weighing's, which stands through the lease)
                explores = w.up != w.best and w.goodput[w.up] >= _EXPLORE_MARGIN * w.goodput[w.best]
            if explores:
                for j in range(1, min(n, _LEASE_STEPS) + 1):   # step j's _explore sees steps + j - 1
                    if self._explores_up_while_off(bucket, self.steps + j - 1):
                        n = j - 1
                        break
        if n > 0:
            self._lease = _Lease(tuple(r.request_id for r in reqs), min(n, _LEASE_STEPS), bucket, self.context)

    def leased(self, reqs: list[Request]) -> bool:
        """Whether this step of ``reqs`` is one this controller promised to draft nothing for
        (``_grant``): the engine then runs it without ``choose`` and hands its times to
        ``lease_step``, not ``observe``. A lease ends at its last step, or when the batch is
        another (then this returns False, and the step is chosen as any other)."""
        lease = self._lease
        if lease is None:
            return False
        ids = lease.ids
        if len(reqs) == len(ids) and all(r.request_id == i for r, i in zip(reqs, ids)):
            return True
        self._end_lease()
        return False

    def lease_continues(self) -> bool:
        """Whether the leased step about to run (``leased``) is not its lease's last: the next step
        is leased too, so it drafts nothing either (the engine then skips the target's feature
        capture for EAGLE heads: engine ``_decode``)."""
        lease = self._lease
        return lease is not None and len(lease.times) + 1 < lease.steps

    def lease_step(self, t_verify: float, t_host: float) -> None:
        """A leased plain step ran (``leased``): its forward (and acceptance) took ``t_verify``, the
        rest of the step ``t_host``."""
        lease = self._lease
        if lease is None:
            return
        lease.times.append((t_verify, t_host))
        if len(lease.times) >= lease.steps:
            self._end_lease()

    def _end_lease(self) -> None:
        """Measure the leased steps that ran, as ``observe`` would have one by one (each at its
        context: the batch's committed a token a sequence a step), and end the lease."""
        lease, self._lease = self._lease, None
        n, B = len(lease.times), len(lease.ids)
        if not n:
            return
        for j, (t_verify, t_host) in enumerate(lease.times, 1):
            if lease.context is not None:
                self.context = lease.context + j * B
            self._measure(lease.bucket, 1, t_verify, t_host, False, settled=self._plain_step(B, lease.ids))
        self.observations += n
        self.steps += n
        self.committed = {i: c + n for i in lease.ids if (c := self.committed.get(i)) is not None}

    def _plain_step(self, batch_size: int, ids: tuple) -> bool:
        """Count an unwidened plain step of the requests ``ids`` in a batch of ``batch_size`` into the
        run of plain steps of the same batch in a row (``observe``, and ``_end_lease`` for each leased
        step: the lease's run goes on from the step that granted it) -> whether the step is settled,
        the _PLAIN_SETTLE-th of the run or later."""
        last = self._plain_run
        run = last[2] + 1 if last is not None and last[0] == batch_size and last[1] == ids else 1
        self._plain_run = (batch_size, ids, run)
        if run == 1:
            self._plain_recent = []
        return run >= _PLAIN_SETTLE

    def _settled_plain(self, t_verify: float, prev: float | None) -> float:
        """What a settled plain step of ``t_verify`` puts into t_verify(B, 1) (``_PLAIN_SETTLE``): the
        median of it and the run's last two settled steps, or while the run has fewer the lesser of
        it and the plain step before it (``prev``, one of the slow first ones): one slow step moves
        nothing, two in a row do."""
        recent = self._plain_recent
        if len(recent) == 2:
            a, b = recent
            sample = max(min(a, b), min(max(a, b), t_verify))   # (the median of three)
        else:
            sample = t_verify if prev is None else min(t_verify, prev)
        recent.append(t_verify)
        del recent[:-2]
        return sample

    def _disturbed(self, bucket: int, sample: float) -> bool:
        """Whether a settled plain step's ``sample`` (``_settled_plain``) is left out: above
        _PLAIN_BURST x t_verify(B, 1) as it stands and as moved to the step's context, and not yet
        the _PLAIN_BURST_STEPS-th such in a row (from then on each is taken, until one is within
        the bound: plain decode did get dearer)."""
        bound = _PLAIN_BURST * self.verify_cost[bucket][1]
        if sample <= bound or sample <= _PLAIN_BURST * self._verify_table(bucket)[1]:
            self._plain_high.pop(bucket, None)
            return False
        n = self._plain_high[bucket] = self._plain_high.get(bucket, 0) + 1
        return n < _PLAIN_BURST_STEPS

    def _unmeasured_for(self, bucket: int, s: int) -> float:
        """Observed steps since the verify time of ``s`` tokens a sequence at this batch size last
        moved (-inf: never measured)."""
        at = self.verify_at.get(bucket, {}).get(s)
        return -math.inf if at is None else self.observations - at

    def _stale(self, bucket: int, s: int) -> bool:
        """Whether the verify time of ``s`` tokens a sequence at this batch size was measured, but
        not in the last _STALE_STEPS observed steps (_STALE_MARGIN)."""
        return self._unmeasured_for(bucket, s) >= _STALE_STEPS

    def _measure(self, bucket: int, s: int, t_verify: float, host: float | None, widened: bool,
                 fresh: bool = False, settled: bool = True) -> None:
        """A verified step's times at this batch size (``observe``, ``_end_lease``): its host time
        (None: not timed), and its forward over ``s`` tokens a sequence, ``t_verify``, into the
        verify costs unless ``widened`` by another proposer's longer drafts (``fresh``: a probe's
        first step, which replaces the estimate), at the step's context (``self.context``). A plain
        step not ``settled`` (one of the first _PLAIN_SETTLE - 1 of the same requests in a row)
        moves t_verify(B, 1) only as a first measurement's or a refresh's step (the lesser of their
        last two) does."""
        if host is not None:
            kind = self.plain_host if s == 1 else self.host_cost
            old = kind.get(bucket)
            if old is None or settled or s == 1:   # (a slow drafting step after a join: _SPEC_SETTLE)
                kind[bucket] = host if old is None else _bounded_ema(old, host)
        self.widened[bucket] = widened
        if s == 1:
            self.off_steps[bucket] += 1
        prev_plain = self.plain_prev.pop(bucket, None)
        table, first = self.verify_cost.setdefault(bucket, {}), self.first_verify.setdefault(bucket, {})
        due = s == 1 and self.refresh.get(bucket) == 0   # (widened, a refresh's last step measures nothing)
        sample = t_verify   # (what goes into the estimate and the fit)
        if due:
            del self.refresh[bucket]
        if not self.widened[bucket]:
            old = table.get(s)
            replaced = True   # (else averaged in, or not in the table yet)
            if s == 1 and s not in table:   # the first plain steps: the lesser of the last two stands
                n = self.plain_samples[bucket] = self.plain_samples.get(bucket, 0) + 1
                if n >= _PLAIN_FIRST:
                    table[s] = min(t_verify, first.get(s, t_verify))
                else:
                    first[s] = t_verify
            elif due:   # a refresh's last step replaces the estimate, or the one before it if less
                table[s] = min(t_verify, t_verify if prev_plain is None else prev_plain)
            elif s == 1 and not settled:   # (a slow first plain step: neither the estimate nor the fit)
                self.plain_prev[bucket] = t_verify   # (for a refresh's last two)
                return
            elif not settled and not fresh and s in table:   # (a slow drafting step after a join: _SPEC_SETTLE)
                return
            elif s in table:
                # (a size not measured for _STALE_STEPS: the step replaces its estimate, _STALE_MARGIN)
                replaced = fresh or (s > 1 and self._stale(bucket, s))
                if s == 1:   # (settled: robust to one slow step, _PLAIN_SETTLE)
                    sample = self._settled_plain(t_verify, prev_plain)
                    if self._disturbed(bucket, sample):   # (neither the estimate nor the fit)
                        self.plain_prev[bucket] = t_verify
                        return
                table[s] = sample if replaced else _bounded_ema(table[s], sample)
            elif s in first:
                table[s] = t_verify  # the second measurement replaces the cold first one
                if self.confirm.get(bucket) == s - 1:
                    del self.confirm[bucket]
            else:
                first[s] = t_verify
                self.confirm[bucket] = s - 1
            if s == 1:
                self.plain_prev[bucket] = t_verify
            if s in table:
                self.verify_at.setdefault(bucket, {})[s] = self.observations
            if s in table and self.context is not None:   # where the estimate stands, and the fit
                where = self.verify_context.setdefault(bucket, {})
                x = self.context
                where[s] = x if replaced or s not in where else _ema(where[s], x)
                self.context_fit.setdefault(bucket, _ContextFit(min_spread=_CONTEXT_SPREAD)).add(
                    s, x, math.log(max(sample if old is None else min(sample, 2 * old), 1e-9)))   # (_verify_table)


def shortest_near_best(goodput: list[float], margin: float = _SIZE_MARGIN) -> int:
    """The size to run from the estimated goodputs of sizes 0.. (0: no speculation, its margin
    applied): none where it weighs best, else the smallest size within ``margin`` of the best."""
    top = max(range(len(goodput)), key=goodput.__getitem__)
    if top == 0:
        return 0
    return next(n for n in range(1, top + 1) if goodput[n] >= margin * goodput[top])


def _borrowed(costs: dict[tuple[int, int], float], shape: tuple[int, int]) -> tuple[float, tuple[int, int]]:
    """A drafting time for ``shape`` (levels, width) from the measured ``costs`` of shapes: the
    nearest measured one's (closest in width, then in levels), scaled up by levels (never down)
    and down by width when the shape is narrower than it (unmeasured and narrower than any
    measured: optimistic, so it gets tried). -> (seconds, the shape borrowed from).

    >>> _borrowed({(5, 1): 2.0, (5, 4): 6.0}, (10, 1)), _borrowed({(5, 4): 6.0}, (5, 2))
    ((4.0, (5, 1)), (3.0, (5, 4)))
    """
    levels, width = shape
    near = min(costs, key=lambda lw: (abs(lw[1] - width), abs(lw[0] - levels), lw))
    t = costs[near] * max(1.0, levels / near[0])
    if near[1] > width:
        t *= width / near[1]
    return t, near


def _curve(table: dict[int, float], sizes: list[int]) -> list[float | None]:
    """A measured cost curve (size -> seconds) at each of ``sizes``: measured, interpolated linearly
    between measured sizes, extrapolated beyond them along the slope from the smallest to the
    largest measured (flat with one size measured; the last two sizes' slope, noisy when they are
    close, came out flat at a batch of 4, and a 65-token tree looked as cheap as 7 tokens), flat
    below the smallest; None when nothing is measured."""
    xs = sorted(table)
    if not xs:
        return [None] * len(sizes)
    first, last = xs[0], xs[-1]
    # (beyond the largest: along the slope from the smallest; one size measured: flat)
    slope = max(0.0, (table[last] - table[first]) / (last - first)) if len(xs) >= 2 else None
    out: list[float | None] = []
    for s in sizes:   # (every weighing reads up to K sizes: the cases by cost, bisect last)
        if (t := table.get(s)) is not None:
            out.append(t)
        elif s > last:
            out.append(table[last] if slope is None else table[last] + slope * (s - last))
        elif s < first:
            out.append(table[first])
        else:
            i = bisect.bisect_left(xs, s)
            a, b = xs[i - 1], xs[i]
            out.append(table[a] + (table[b] - table[a]) * (s - a) / (b - a))
    return out


def stop_confidence(tokens: float, a: float, gamma: float, ratio: float = 1.0) -> float | None:
    """The path confidence c under which a greedy chain drafts no further level, when a level
    costs ``tokens`` (its drafting and verification time times the step's goodput: the tokens that
    time would make at the best size's rate). A node of path confidence c is accepted about
    a * c ** gamma times (confidence.py), and a child of a node of confidence c has about
    c * ``ratio`` (the mean confidences' ratio of the last two levels, taken within
    _MIN_CHILD_RATIO-1); so once every
    chain of the batch is below c* = (tokens / a) ** (1 / gamma) / ratio, another level costs more
    than it brings, and the head's loop stops (the fused chains' ``min_confidence``; every row
    keeps what was drafted: verification is padded to the longest row). At the optimum, c* is about the mean confidence of the best chain's last node, so at a
    batch of 1 chains that fall below the average stop early, where "auto" drafted all 10 levels
    every step (2.5 ms a step, against 1.7 for the chain up to 10 ending at c = 0.3, which ran
    7 % faster). At large batches every row must be below it, which seldom happens. None when the
    level costs nothing.

    >>> round(stop_confidence(0.3, 1.0, 1.0), 3), round(stop_confidence(0.3, 1.2, 0.5), 4), stop_confidence(0.0, 1.0, 1.0)
    (0.3, 0.0625, None)
    >>> round(stop_confidence(0.3, 1.0, 1.0, ratio=0.75), 3), round(stop_confidence(0.3, 1.0, 1.0, ratio=0.1), 3)
    (0.4, 0.6)
    >>> stop_confidence(3.0, 1.0, 1.0)
    1.0
    """
    if tokens <= 0 or a <= 0:
        return None
    return min(1.0, (tokens / a) ** (1.0 / gamma) / min(1.0, max(ratio, _MIN_CHILD_RATIO)))


def _extended(scores: list[float], n: int, ratio: float | None = None) -> list[float]:
    """A chain's path confidences extended to ``n`` levels: each level past its last at its
    parent's times ``ratio`` (default: the chain's own last ratio, _child_ratio).

    >>> [round(c, 3) for c in _extended([0.9, 0.72], 4)], _extended([0.5], 3, ratio=0.5)
    ([0.9, 0.72, 0.576, 0.461], [0.5, 0.25, 0.125])
    """
    r = _child_ratio(scores) if ratio is None else ratio
    return scores + [scores[-1] * r ** j for j in range(1, n - len(scores) + 1)]


def _child_ratio(scores: list[float]) -> float:
    """A chain's last level's confidence over its parent's (its first level's own, for one level),
    within _MIN_CHILD_RATIO-1: what a next level would multiply the path confidence by.

    >>> _child_ratio([0.9, 0.81]), _child_ratio([0.6]), _child_ratio([0.9, 0.1]), _child_ratio([0.0, 0.0])
    (0.9, 0.6, 0.5, 0.5)
    """
    parent = scores[-2] if len(scores) >= 2 else 1.0
    return min(1.0, max(scores[-1] / parent if parent > 0 else 0.0, _MIN_CHILD_RATIO))


def _moved(growth: float, where: float, now: float) -> float:
    """The factor a verify time measured at context ``where`` takes at ``now``, at ``growth`` in log
    time per token of context (_ContextFit over log times): at most in proportion to the context
    either way (as if attention were the whole step), never below half.

    >>> round(_moved(1e-4, 1000, 1500), 4), _moved(1e-2, 1000, 1500), _moved(1e-2, 1000, 900)
    (1.0513, 1.5, 0.9)
    >>> _moved(1e-2, 1000, 100), _moved(1e-2, 0, 100)
    (0.5, 1.0)
    """
    if where <= 0:   # (no context to scale from)
        return 1.0
    ratio = now / where
    factor = min(max(math.exp(growth * (now - where)), min(1.0, ratio)), max(1.0, ratio))
    return max(0.5, factor)


def _monotone(table: dict[int, float]) -> dict[int, float]:
    """A verify-cost table (tokens per sequence -> seconds) with no size dearer than a longer one: each
    the least of its own and the longer sizes' times. One forward over more tokens a sequence never
    costs less (``benchmarks/step_bench.py``'s curves), so a size measured dearer than a longer one
    was measured slow: in the first steps after a prefill, or long ago, and not run since. At a batch
    of 32 the chain of 9 (10 tokens) stood at 46 ms from the first steps after the prompts, the chain
    of 10 at 36 ms; the chains of 5-8 were interpolated from plain decode up to the 46 ms (the chain
    of 7 at 38 ms, measured 29 in the chain engine), looked 20 % worse than the chain of 10, were never
    explored, and "auto" at depth 10 ran the chain of 10 there, 0.90x the chain of 7.

    >>> _monotone({1: 10.0, 10: 46.0, 11: 36.0, 12: 40.0})
    {1: 10.0, 10: 36.0, 11: 36.0, 12: 40.0}
    """
    out, least = {}, float("inf")
    for s in sorted(table, reverse=True):
        least = min(least, table[s])
        out[s] = least
    return dict(sorted(out.items()))


def _chain_line(times: dict[int, float], samples: dict[int, int]) -> dict[int, float]:
    """Chains' drafting times (levels -> seconds) on the least-squares line t = c0 + c1 * levels
    through those measured twice or more (three or more of them; a first measurement also pays for
    catch-ups and cold shapes, and is replaced by the second), each weighted by its samples (up to
    _LINE_WEIGHT), read at every level of ``times``: a step's drafting is the head's catch-up plus
    one forward per level, and the measured points scatter about that line (the catch-up varies
    with what the batch accepted, the points with when they were measured). Interpolated as
    measured, at a batch of 4 the chain of 6 measured 2.87 ms between 3.40 for 5 and 4.90 for 7, and
    "auto" kept to it for a whole run where the chain of 7 ran 5 % faster. A negative slope (noise)
    gives the weighted mean; no level reads under half the least time the line went through (an
    extrapolation past the fitted levels)."""
    fit = {lv: t for lv, t in times.items() if samples.get(lv, 1) >= 2}
    w = {lv: float(min(samples[lv], _LINE_WEIGHT)) for lv in fit}
    total = sum(w.values())
    mx = sum(w[lv] * lv for lv in fit) / total
    mt = sum(w[lv] * t for lv, t in fit.items()) / total
    sxx = sum(w[lv] * (lv - mx) ** 2 for lv in fit)
    slope = max(0.0, sum(w[lv] * (lv - mx) * (t - mt) for lv, t in fit.items()) / sxx) if sxx > 0 else 0.0
    floor = 0.5 * min(fit.values())
    return {lv: max(floor, mt + slope * (lv - mx)) for lv in times}


def _stopped_early(result: AcceptanceResult, b: int, num_draft: int, parents: list[int] | None) -> bool:
    """Whether request b's accepted drafts stopped at a rejection (so one more draft was tried):
    a chain (``parents`` None) accepted fewer than it drafted; a tree's accepted path ends at a
    node with children (the root, -1, when nothing was accepted)."""
    if parents is None:
        return result.num_accepted[b] < num_draft
    path = result.accepted(b)
    return (path[-1] if path else -1) in parents


def _ema(old: float, sample: float, first: bool = False) -> float:
    return sample if first else (1 - _EMA) * old + _EMA * sample


def _bounded_ema(old: float, sample: float) -> float:
    """A cost estimate's update: the sample counts for at most twice the estimate (one-off spikes
    move it by at most 20 %)."""
    return _ema(old, min(sample, 2 * old))


def cap_drafts(req: Request, k: int, max_model_len: int, tree: bool = False) -> int:
    """No drafts past max_tokens or past the cache row's end, none beyond the request's own
    num_speculative_tokens. For trees k counts nodes: they need room in the row (one column
    each), while their depth is capped by the proposer (tree_depth_cap)."""
    if req.num_speculative_tokens is not None:
        k = min(k, req.num_speculative_tokens)
    left = req.max_tokens - len(req.output_ids) - 1
    room = max_model_len - req.num_computed - 1
    return max(0, min(k, room) if tree and left > 0 else min(k, left, room))


def tree_depth_cap(req: Request) -> int:
    """The deepest draft worth verifying: one level per token still allowed after the bonus."""
    return max(0, req.max_tokens - len(req.output_ids) - 1)


@dataclass
class _Weighed:
    """A weighing of the auto tree sizes: after ``at`` observed steps, for ``batch`` sequences of
    which a share ``free`` of unseeded sampled requests, the goodput of each size (0: no
    speculation), the best and the neighbours and probe size ``_explore`` takes."""
    at: int
    batch: int
    free: float
    goodput: list[float]
    best: int
    up: int
    down: int
    probe: int
    #: the best chain's stop confidence (``stop_confidence``; None: the best is no chain) and the
    #: ratio of a child's confidence to its parent's it assumed
    stop: float | None = None
    ratio: float = 1.0
    #: no speculation weighed best, for the first time since speculating: ``best`` is still the
    #: last weighing's size, until the next weighing (with that size's fresh measurements) agrees.
    #: While off, nothing measured moves acceptance or the calibration, so a weighing that turned
    #: speculation off on an unlucky stretch held for as long as it stayed off (at a batch of 16
    #: the first probe comes after 2048 steps): at a batch of 16, T = 0, a calibration of 0.83-0.86
    #: (it swung 0.83-1.11 between weighings, 1.0 on average) kept the chains off for 7-14 weighings
    #: where they ran 1.14x none (stop 97)
    holding: bool = False
    #: whether the batch weighed for stops its chains (SpecController.stops: all greedy; True past
    #: _STOP_AT_DEPTH, where it changes nothing: ``_stops_key``)
    stops: bool = False
    #: steps this weighing stands while it puts speculation first (_REWEIGH_SETTLED), and the
    #: first request of the batch it was weighed for
    wait: int = _REWEIGH_STEPS
    lead: str | None = None


@dataclass
class _Lease:
    """Plain steps promised (``SpecController._grant``): the requests' ids (in the batch's
    order), how many steps, the batch-size bucket, the batch's context at the step before the
    first, and each leased step's forward and host seconds so far."""
    ids: tuple[str, ...]
    steps: int
    bucket: int
    context: float | None
    times: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class _ContextFit:
    """A time t against a context X, one line per size with a slope shared by all, t ~ a_s +
    slope * X (the verify times: their logs against the batch's context, the sum of its sequences'
    lengths, _verify_table; the drafter's catch-up: its time against the tokens caught up on,
    _catch_up): least squares within sizes,
    pooled, each sample's weight decaying by _FIT_DECAY per later sample of its size. No slope
    (0) until the contexts of some size spread, and never a negative one. ``min_spread``: no
    slope either until the contexts' standard deviation within sizes is at least this share of
    their mean (the verify times: 0.1. At a batch of 32, two probe steps 111 tokens of context
    apart fitted 0.13 ms a token from their timing noise alone, three 0.016, where attention
    costs a few us; moved along it, plain decode looked 5x dearer, 132 ms a step against 26
    measured, and "auto" speculated where none was best)."""
    sums: dict[int, list[float]] = field(default_factory=dict)   # s -> [weight, Σx, Σt, Σx², Σxt]
    min_spread: float = 0.0

    def add(self, s: int, x: float, t: float) -> None:
        v = self.sums.setdefault(s, [0.0] * 5)
        for i, term in enumerate((1.0, x, t, x * x, x * t)):
            v[i] = _FIT_DECAY * v[i] + term

    def slope(self) -> float:
        sxx = sxt = weight = sx_all = 0.0
        for w, sx, st, sxx_s, sxt_s in self.sums.values():
            if w > 1.5:
                sxx += sxx_s - sx * sx / w
                sxt += sxt_s - sx * st / w
                weight += w
                sx_all += sx
        # (a spread of less than a token of context is rounding: contexts of 32 x 500 tokens square
        # to about 1e8, and their sums' cancellation leaves about 1e-6 where the spread is 0)
        if sxx <= weight or sxx < weight * (self.min_spread * sx_all / weight) ** 2:   # (sx_all / weight: the mean)
            return 0.0
        return max(0.0, sxt / sxx)


@dataclass
class _Probe:
    """A probe of ``size`` for ``steps`` steps (while speculation is off, or a batch size's first
    drafts): steps chosen and observed so far (``pending``: this step's choice was the probe), the
    tokens it accepted and predicted (auto tree size: the calibration), and accepted of tried (the
    acceptance rate: TokenRate), which replace the running estimates when ``replaces``."""
    size: int
    steps: int = _PROBE_STEPS
    replaces: bool = True
    chosen: int = 1
    seen: int = 0
    pending: bool = True
    accepted: float = 0.0
    predicted: list[float] | None = None   # [G]: each confidence model's (confidence.py)
    tokens: int = 0
    tried: int = 0
