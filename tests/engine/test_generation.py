"""Engine-level generation behaviour: seeds, stops, penalties, n, chat, over-long prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError, RequestError
from leapfrog.model.loader import load_model, read_checkpoint
from tests.conftest import prompts_of
from tests.stats import chisq_pvalue


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8)


def gen(llm, prompt, **kw):
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_seeded_runs_reproduce_regardless_of_batch(llm, tokenizer):
    p = prompts_of(tokenizer, 3)
    sp = SamplingParams(temperature=1.0, max_tokens=20, seed=42, ignore_eos=True)
    a = gen(llm, p[0], temperature=1.0, max_tokens=20, seed=42, ignore_eos=True).token_ids
    b = llm.generate([{"prompt_token_ids": x} for x in p], sp, use_tqdm=False)[0].outputs[0].token_ids
    c = gen(llm, p[0], temperature=1.0, max_tokens=20, seed=43, ignore_eos=True).token_ids
    assert a == b
    assert a != c


def test_first_token_distribution_matches_model(llm, llama_dir, tokenizer):
    """Engine sampling at temperature 0.7 + top_k follows softmax of the model's logits (chi-square)."""
    prompt = prompts_of(tokenizer, 1)[0]
    model = load_model(read_checkpoint(llama_dir), torch.float32, torch.device("cpu"), 256)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor([prompt]), torch.arange(len(prompt))[None]).hidden[0, -1:])[0]
    x = logits / 0.7
    x[x < x.topk(8).values[-1]] = -float("inf")
    ref = torch.softmax(x, -1).numpy()
    N = 3000
    outs = llm.generate([{"prompt_token_ids": prompt}] * N,
                        SamplingParams(temperature=0.7, top_k=8, max_tokens=1), use_tqdm=False)
    counts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=len(ref))
    assert chisq_pvalue(counts, ref) > 1e-3


def test_stop_string_excluded_and_included(llm, tokenizer):
    p = prompts_of(tokenizer, 1)[0]
    full = gen(llm, p, temperature=0, max_tokens=40, ignore_eos=True)
    text = full.text
    stop = text[10:13]
    cut = text.index(stop)
    out = gen(llm, p, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert full.token_ids[:len(out.token_ids)] == out.token_ids and len(out.token_ids) < 40
    inc = gen(llm, p, temperature=0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert inc.text == text[:cut + len(stop)]


def test_stop_token_ids_kept_in_ids(llm, tokenizer):
    p = prompts_of(tokenizer, 1)[0]
    full = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True).token_ids
    stop_id = full[5]
    first = full.index(stop_id)
    out = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.token_ids == full[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens suppresses the stop id until enough tokens were generated
    late = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id],
               min_tokens=first + 2)
    assert len(late.token_ids) >= first + 2
    assert stop_id not in late.token_ids[:first + 2]


def test_stop_strings_count_from_the_token_after_min_tokens(llm, tokenizer):
    """As stop ids, stop strings end the output only from token min_tokens + 1 on (vLLM's rule): a
    stop string the min_tokens-th token completes does not stop it (it stopped it there)."""
    p = prompts_of(tokenizer, 1)[0]
    full = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True)
    k = next(j for j in range(3, 20) if (w := tokenizer.decode(full.token_ids[j - 1:j])).strip()
             and w not in tokenizer.decode(full.token_ids[:j - 1]))   # token k's text, new there
    stop = tokenizer.decode(full.token_ids[k - 1:k])
    at_k = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], min_tokens=k - 1)
    assert at_k.finish_reason == "stop" and len(at_k.token_ids) == k   # (checked from token k on)
    late = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], min_tokens=k)
    assert len(late.token_ids) > k and late.token_ids[:k] == full.token_ids[:k]

def test_eos_stops_unless_ignored(llm, tokenizer):
    p = prompts_of(tokenizer, 1)[0]
    full = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True).token_ids
    eos = full[3]
    llm.engine.eos_ids = (eos,)
    try:
        llm.engine.requests.clear()
        out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    finally:
        llm.engine.eos_ids = (llm.get_tokenizer().eos_token_id,)
    # eos ids are bound at add time; the new request saw the patched eos
    assert out[0].outputs[0].token_ids == full[:full.index(eos) + 1]
    assert out[0].outputs[0].finish_reason == "stop"


def test_penalties_change_output_and_n(llm, tokenizer):
    p = prompts_of(tokenizer, 1)[0]
    plain = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True).token_ids
    pen = gen(llm, p, temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=3.0).token_ids
    assert plain != pen
    assert len(set(pen)) >= len(set(plain))
    outs = llm.generate({"prompt_token_ids": p}, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1),
                        use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs) == 3
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1
    # the request's metrics count every choice's tokens (they counted the first choice's)
    assert outs[0].metrics.num_generated_tokens == sum(len(o.token_ids) for o in outs[0].outputs)


def test_text_prompt_and_chat(llm):
    out = llm.generate("def foo(x):", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out.prompt == "def foo(x):" and out.prompt_token_ids
    assert len(out.outputs[0].token_ids) <= 5
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "<|assistant|>" in chat[0].prompt
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
                     SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)   # text parts, as the server
    joined = llm.chat([{"role": "user", "content": "h\ni"}], SamplingParams(temperature=0, max_tokens=4),
                      use_tqdm=False)   # (joined by a newline, as vLLM joins them)
    assert parts[0].prompt_token_ids == joined[0].prompt_token_ids
    dumped = {"role": "assistant", "content": "hi", "name": None, "tool_calls": None, "function_call": None,
              "refusal": None, "annotations": [], "audio": None}   # (the openai SDK's model_dump())
    again = llm.chat([{"role": "user", "content": "hi"}, dumped], SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)
    plain = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}],
                     SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert again[0].prompt_token_ids == plain[0].prompt_token_ids


@pytest.mark.parametrize("messages, pattern", [
    ([{"role": "user", "content": "hi", "name": "bob"}], "message 0: name: Extra inputs"),   # (were dropped)
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "1"}],
     "message 1: tool_call_id: Extra inputs"),
    ([{"role": "bogus", "content": "hi"}], "message 0: role: Input should be"),   # (was rendered)
    ([{"role": "user"}], "message 0: .*user message needs content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "type 'image_url' is not supported"),
    ([{"role": "user", "content": ["hi"]}], "content part 0 must be an object"),   # (said "content.str")
    ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], "tool_calls: Extra inputs"),
    ([], "non-empty"),                                   # (was [] silently)
    ([[{"role": "user", "content": "a"}], []], "conversation 1: .*non-empty"),
    ([[{"role": "user", "content": 5}]], "conversation 0: message 0: content"),
    ("hi", "non-empty list"),
])
def test_chat_messages_checked_as_the_server_checks_them(llm, messages, pattern):
    with pytest.raises(RequestError, match=pattern):
        llm.chat(messages, use_tqdm=False)


def test_over_long_and_bad_prompts(llm):
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 300}, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 200}, SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(RequestError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]}, use_tqdm=False)
    with pytest.raises(RequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(RequestError):
        llm.generate(12, use_tqdm=False)
    with pytest.raises(RequestError, match="multi_modal_data"):   # refused, not ignored
        llm.generate({"prompt": "x", "multi_modal_data": {}}, use_tqdm=False)
    with pytest.raises(RequestError, match="got a dict"):
        llm.generate("x", {"max_tokens": 3}, use_tqdm=False)
    # params changed after construction are checked when used, and the stop list is the one set now
    sp = SamplingParams(temperature=0, max_tokens=3)
    sp.max_tokens = -5
    with pytest.raises(ConfigError, match="max_tokens"):
        llm.generate("x", sp, use_tqdm=False)
    for n in (0, 2.5):   # (n is read by generate itself: it was an IndexError / TypeError there)
        sp = SamplingParams(temperature=0, max_tokens=3)
        sp.n = n
        with pytest.raises(ConfigError, match="SamplingParams.n"):
            llm.generate("x", sp, use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = gen(llm, [1, 2, 3], temperature=0, max_tokens=12, ignore_eos=True)
    sp.stop = [free.text[4:7]] if len(free.text) > 7 else None
    if sp.stop:
        got = llm.generate({"prompt_token_ids": [1, 2, 3]}, sp, use_tqdm=False)[0].outputs[0]
        assert got.finish_reason == "stop" and len(got.text) < len(free.text)
    # the engine is still healthy afterwards
    assert gen(llm, [1, 2, 3], temperature=0, max_tokens=3, ignore_eos=True).token_ids


def test_more_requests_than_rows_queue(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=2)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [i + 1, i + 2]} for i in range(7)], sp, use_tqdm=False)
    single = [llm.generate({"prompt_token_ids": [i + 1, i + 2]}, sp, use_tqdm=False)[0] for i in range(7)]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in single]
    assert llm.engine.kv.num_free == 2


def test_final_only_steps_give_each_request_once_when_it_ends(llm):
    """LLMEngine.step(final_only=True) (LLM.generate's loop): only finished requests' outputs, with
    the text and tokens that stepping with every output gives."""
    def run(final_only: bool) -> dict:
        eng = llm.engine
        for i, n in enumerate((3, 9)):
            eng.add_request(f"fo-{final_only}-{i}", None, [5 + i, 6, 7], SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True))
        last, seen = {}, []
        while eng.has_unfinished():
            for out in eng.step(final_only=final_only):
                seen.append(out.finished)
                last[out.request_id.rsplit("-", 1)[1]] = (out.outputs[0].text, out.outputs[0].token_ids)
        return last, seen

    every, seen_every = run(False)
    final, seen_final = run(True)
    assert not all(seen_every)                  # stepping with every output shows running requests
    assert seen_final == [True, True]           # final_only: each request once, when it ends
    assert final == every and len(final["1"][1]) == 9
