"""Predicted outputs: the alignment and re-synchronization (pure), then through the engine:
greedy equality, the sampling law, usage counts, routing next to a configured method, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError, RequestError
from leapfrog.spec_decode.proposers.prediction import Alignment, find_rejoin
from tests.conftest import greedy_baseline
from tests.spec_decode.test_sampling_lossless import PROMPT, assert_follows_target


def walk(pred: list[int], out: list[int], **kw) -> Alignment:
    a = Alignment(np.array(pred, dtype=np.int64), **kw)
    for n in range(1, len(out) + 1):   # token by token, as steps would
        a.advance(out[:n])
    return a


PRED = list(range(100, 140))   # 40 distinct tokens


def test_exact_prediction_stays_aligned():
    a = walk(PRED, PRED[:25])
    assert a.synced and a.pos == 25 and a.matched == 25
    assert a.drafts(10, PRED[:25]) == PRED[25:33]   # k starts at 8


def test_insertion_rejoins_at_the_anchor():
    out = PRED[:10] + [1, 2, 3, 4] + PRED[10:20]
    a = walk(PRED, out, min_match=3)
    assert a.synced and a.pos == 20 and a.resyncs == 1
    assert a.matched == 20   # every prediction token that appeared, once


def test_deletion_skips_ahead():
    out = PRED[:10] + PRED[18:30]
    a = walk(PRED, out, min_match=3)
    assert a.synced and a.pos == 30 and a.matched == 22
    assert a.drafts(4, out) == PRED[30:34]


def test_replacement_and_the_guess_before_resync():
    out = PRED[:10] + [7] + PRED[11:12]          # one token replaced, one more written
    a = walk(PRED, out, min_match=3)
    assert not a.synced and a.anchor == 10
    # the last output token occurs right after the anchor: the guess drafts what follows it
    assert a.drafts(5, out) == PRED[12:17]
    out += PRED[12:16]
    a.advance(out)
    assert a.synced and a.pos == 16


def test_prediction_that_never_matches_drafts_nothing():
    a = walk(PRED, [1, 2, 3, 4, 5, 6, 7])
    assert not a.synced and a.matched == 0 and a.drafts(8, [1, 2, 3, 4, 5, 6, 7]) == []


def test_empty_prediction():
    a = walk([], [1, 2, 3])
    assert a.drafts(8, [1, 2, 3]) == [] and a.matched == 0


def test_false_resync_keeps_the_anchor():
    # the output's edit contains a 3-token run that also occurs later in the prediction; after
    # it fails, the search still starts from the first anchor and finds the true rejoin
    pred = PRED[:10] + [50, 51, 52] + PRED[10:20] + [50, 51, 52, 60] + PRED[20:30]
    out = PRED[:10] + [50, 51, 52, 99] + PRED[10:20]
    a = walk(pred, out, min_match=3)
    assert a.synced and a.pos == 23


def test_find_rejoin_prefers_longest_then_nearest():
    pred = np.array([1, 2, 3, 9, 2, 3, 1, 2, 3])
    assert find_rejoin(pred, np.array([1, 2, 3]), 0, 2, 3) == (0, 3)
    assert find_rejoin(pred, np.array([1, 2, 3]), 1, 2, 3) == (6, 3)
    assert find_rejoin(pred, np.array([7, 2, 3]), 0, 2, 3) == (1, 2)
    assert find_rejoin(pred, np.array([7, 8]), 0, 2, 3) is None


def test_k_doubles_on_full_acceptance_up_to_64():
    a = Alignment(np.arange(500))
    for want in (16, 32, 64, 64):
        a.verified(a.k, a.k)
        assert a.k == want
    a.verified(64, 3)
    assert a.k == 64


MAX = 40


@pytest.fixture(scope="module")
def setup(llama_dir, tokenizer):
    llm, prompts, outs = greedy_baseline(llama_dir, tokenizer, 4, MAX)
    return llm, prompts, [o.outputs[0].token_ids for o in outs]


def _edited(ids: list[int]) -> list[int]:
    return ids[:12] + [5, 6] + ids[14:30] + ids[33:]   # a replacement and a deletion


@pytest.mark.parametrize("kind", ["exact", "edited", "junk", "empty", "text"])
def test_greedy_equal_with_any_prediction(setup, tokenizer, kind):
    llm, prompts, ref = setup
    preds = {"exact": ref, "edited": [_edited(r) for r in ref], "junk": [[7] * 30 for _ in ref],
             "empty": [[] for _ in ref], "text": [tokenizer.decode(r) for r in ref]}[kind]
    sps = [SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, prediction=p) for p in preds]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, p in zip(outs, preds):
        m = o.metrics
        n_pred = len(p) if not isinstance(p, str) else len(tokenizer.encode(p, add_special_tokens=False))
        assert m.accepted_prediction_tokens + m.rejected_prediction_tokens == n_pred
        if kind == "exact":
            assert m.accepted_prediction_tokens == MAX and m.num_target_forwards <= 5
        if kind == "edited":
            assert m.accepted_prediction_tokens >= MAX - 6 and m.num_target_forwards < MAX // 2
        if kind in ("junk", "empty"):
            assert m.num_draft_tokens == 0 and m.accepted_prediction_tokens == 0


def test_prediction_next_to_a_configured_method(llama_dir, draft_dir, setup):
    """A batch mixing requests with a prediction (chains from it) and without (the server's
    draft_model, with q): both outputs stay the target's; only the latter use the draft."""
    _, prompts, ref = setup
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8,
              speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    sps = [SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, prediction=ref[i] if i % 2 else None)
           for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[1].metrics.accepted_prediction_tokens == MAX and outs[0].metrics.accepted_prediction_tokens is None
    assert outs[1].metrics.num_target_forwards < outs[0].metrics.num_target_forwards
    # sampled requests in the mixed batch: q rows for the draft model, one-hot for the prediction
    sp = [SamplingParams(temperature=0.8, max_tokens=MAX, ignore_eos=True, seed=None,
                         prediction=ref[i] if i % 2 else None) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX for o in outs)


def test_prediction_sampling_follows_target(tmp_path_factory):
    """The target's greedy continuation as the prediction, under sampling: tokens 2 and 3 follow
    the target's law (point-mass chain drafts, rejection sampling, residual and bonus paths)."""
    from leapfrog.demo import save_random_llama
    from tests.spec_decode.test_sampling_lossless import SMALL
    target = save_random_llama(tmp_path_factory.mktemp("tinyp"), None, seed=3, **SMALL)
    greedy = LLM(model=str(target), dtype="float32", skip_tokenizer_init=True, max_model_len=16).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, prediction=greedy)
    assert_follows_target(target, None, sp, seed=11)
    sp = SamplingParams(temperature=0.7, top_k=4, max_tokens=3, ignore_eos=True, prediction=greedy)
    assert_follows_target(target, None, sp, seed=12)


@pytest.mark.parametrize("pred, why", [(3.5, "string or a list of token ids"), ([1, -2], "string or a list"),
                                       ([True], "string or a list")])
def test_bad_prediction_type(pred, why):
    with pytest.raises(ConfigError, match=why):
        SamplingParams(prediction=pred)


def test_bad_prediction_for_the_model(setup):
    llm, prompts, _ = setup
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(prediction=[10 ** 6]), use_tqdm=False)
    with pytest.raises(RequestError, match="new tokens fit"):
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(prediction=[5] * 300), use_tqdm=False)
    # the engine is fine afterwards
    out = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
