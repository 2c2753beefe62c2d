"""Structured outputs with speculation: every finished output parses and validates, greedy and
seeded output equal the output without speculation under the same constraint, and the sampled
law under a ``choice`` constraint is the exact constrained law (chi-square)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError, RequestError
from leapfrog.sampling.grammar import (MAX_CHOICE_CHARS, MAX_CHOICES, GrammarCompiler, GrammarError,
                                       StructuredOutputsParams)
from tests.conftest import prompts_of
from tests.stats import chisq_pvalue

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "size"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "size": {"enum": ["small", "large"]}}}
CONSTRAINTS = {
    "json": dict(json=SCHEMA),
    "regex": dict(regex=r"[a-c]{2,5}-[0-9]{1,3}"),
    "choice": dict(choice=["yes", "no", "maybe"]),
    "lark": dict(grammar='start: "(" item ("," item)* ")"\nitem: /[xyz]/'),
    "gbnf": dict(grammar='root ::= "[" [0-9] "]"'),
}


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        v = json.loads(text)
        return (set(v) == {"name", "ok", "size"} and isinstance(v["name"], str) and len(v["name"]) <= 6
                and isinstance(v["ok"], bool) and v["size"] in ("small", "large"))
    pattern = {"regex": r"[a-c]{2,5}-[0-9]{1,3}", "choice": r"yes|no|maybe", "lark": r"\([xyz](,[xyz])*\)",
               "gbnf": r"\[[0-9]\]"}[kind]
    return re.fullmatch(pattern, text) is not None


def test_params_are_checked():
    for kw in ({}, dict(regex="a", choice=["b"]), dict(choice=[]), dict(json=5), dict(grammar=" ")):
        with pytest.raises(ConfigError):
            StructuredOutputsParams(**kw)
    with pytest.raises(ConfigError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"
    # bounded choice lists (the matcher is built on the engine's thread), and no min_tokens
    # against a grammar that decides where the output ends
    assert len(StructuredOutputsParams(choice=[f"c{i}" for i in range(MAX_CHOICES)]).choice) == MAX_CHOICES
    for choice in ([f"c{i}" for i in range(MAX_CHOICES + 1)], ["x" * (MAX_CHOICE_CHARS + 1)]):
        with pytest.raises(ConfigError, match="at most"):
            StructuredOutputsParams(choice=choice)
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(structured_outputs={"regex": "a"}, min_tokens=3)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8)


def test_bad_constraints_are_request_errors(plain):
    for so in (dict(json={"type": "nonsense"}), dict(regex="(unclosed"), dict(grammar="start: undefined_rule"),
               dict(regex="[^\\x00-\\U0010FFFF]")):   # the last: no output can satisfy it (was an empty "stop")
        with pytest.raises(RequestError, match="constraint"):
            plain.generate("x", SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    for kw in (dict(allowed_token_ids=[0]), dict(bad_words=["LLM"])):   # could leave no token: refused
        with pytest.raises(RequestError, match="not supported"):
            plain.generate("x", SamplingParams(max_tokens=4, structured_outputs={"regex": "LLM"}, **kw),
                           use_tqdm=False)
    # the engine goes on
    assert plain.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


#: compiles, but past llguidance's Earley row limit (2000 items) once its "{" is consumed
BIG_OBJECT = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}


def test_a_grammar_past_its_limits_fails_its_request_alone(plain):
    """The matcher errs partway through the output: the request fails with a GrammarError (a
    RequestError: the server's 400) naming the token, never a silent "stop"; others go on."""
    ref = plain.generate("x", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    with pytest.raises(GrammarError, match="json constraint failed at output token 1: .*max is 2000"):
        plain.generate("x", SamplingParams(max_tokens=4, structured_outputs={"json": BIG_OBJECT}), use_tqdm=False)
    eng = plain.engine
    eng.add_request("big", "x", None, SamplingParams(max_tokens=4, structured_outputs={"json": BIG_OBJECT}))
    eng.add_request("plain", "x", None, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["big"].outputs[0].finish_reason == "error" and isinstance(done["big"].error, GrammarError)
    assert done["plain"].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_drafts_that_break_the_matcher_leave_the_committed_output_alone(tokenizer):
    """A draft token that leads the matcher past a limit (its errors are sticky: rollback does
    not clear them) makes the row unreachable and rebuilds the matcher from the committed tokens:
    the output is the one without speculation."""
    comp = GrammarCompiler(tokenizer, 320)
    so = StructuredOutputsParams(json={"anyOf": [{"type": "string", "maxLength": 4}, BIG_OBJECT]})
    state = comp.matcher(so)
    brace, quote = (tokenizer.convert_tokens_to_ids(c) for c in ("{", '"'))
    assert state.allowed()[brace] and state.allowed()[quote]
    assert state.allowed([brace]) is None   # the draft's row: unreachable, and the matcher rebuilt
    before = state.m
    assert state.allowed([brace]) is None and state.m is not before
    state.advance(quote)
    assert state.num_consumed == 1 and state.allowed()[quote]   # inside the string: it may close
    state.advance(quote)
    assert state.finished   # the string '""' is the whole output
    with pytest.raises(GrammarError, match="output token 1"):
        fresh = comp.matcher(so)
        fresh.advance(brace)


def _spec(method, llama_dir, draft_dir, tmp_path):
    if method == "eagle":
        from tests.spec_decode.test_eagle import make_head
        return {"method": "eagle", "model": str(make_head(llama_dir, tmp_path, "eagle")), "num_speculative_tokens": 3,
                "eagle_topk": 2, "num_draft_tokens": 5}
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec["model"] = str(draft_dir)
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    return spec


@pytest.mark.parametrize("method", ["draft_model", "ngram", "suffix", "eagle"])
def test_outputs_parse_and_equal_without_speculation(llama_dir, draft_dir, tokenizer, plain, method, tmp_path):
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 2)]
    jobs, kinds = [], []
    for kind, so in CONSTRAINTS.items():
        for j, sp in enumerate([dict(temperature=0), dict(temperature=0.8, seed=11)]):
            jobs.append((prompts[j], SamplingParams(max_tokens=64, structured_outputs=so, **sp)))
            kinds.append(kind)
    ref = plain.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8,
              speculative_config=_spec(method, llama_dir, draft_dir, tmp_path))
    got = llm.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    assert llm.get_metrics()["num_draft_tokens"] > 0
    for kind, g, r in zip(kinds, got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids, kind
        assert g.outputs[0].finish_reason == "stop", (kind, g.outputs[0].text)
        assert valid(kind, g.outputs[0].text), (kind, g.outputs[0].text)


def test_unseeded_sampling_always_parses(llama_dir, draft_dir, tokenizer):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, max_num_seqs=16,
              speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": p} for p in prompts_of(tokenizer, 4)] * 4
    for kind in ("json", "lark"):
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=64,
                                                    structured_outputs=CONSTRAINTS[kind]), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "stop" and valid(kind, o.outputs[0].text) for o in outs), \
            [o.outputs[0].text for o in outs]
    assert llm.get_metrics()["num_accepted_tokens"] > 0


CHOICES = ["yes", "no", "maybe", "yellow"]


def exact_choice_law(llm, prompt: list[int], temperature: float) -> np.ndarray:
    """P(each choice) under the target masked by the grammar, summed over every tokenization
    the grammar admits (depth-first over token paths)."""
    eng = llm.engine
    model = eng.model
    law = np.zeros(len(CHOICES))
    tok = eng.tokenizer

    def visit(path: list[int], prob: float) -> None:
        g = eng._grammars.matcher(StructuredOutputsParams(choice=CHOICES))
        for t in path:
            g.advance(t)
        if g.finished:
            law[CHOICES.index(tok.decode(path))] += prob
            return
        allowed = g.allowed()
        with torch.no_grad():
            ids = torch.tensor([prompt + path])
            logits = model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]).hidden[0, -1:])[0]
        p = torch.softmax((logits / temperature).masked_fill(~allowed, -torch.inf), -1).double()
        for t in allowed.nonzero().flatten().tolist():
            visit(path + [t], prob * float(p[t]))

    visit([], 1.0)
    return law


def test_choice_sampling_law_with_speculation(llama_dir, draft_dir, tokenizer):
    """Unseeded rejection sampling (draft_model) and seeded matching (suffix) under a choice
    constraint: the choices' frequencies follow the exact constrained law."""
    prompt = prompts_of(tokenizer, 1)[0]
    N = 600
    for spec, seeded in (({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}, False),
                         ({"method": "suffix", "num_speculative_tokens": 4}, True)):
        llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=64, speculative_config=spec)
        sps = [SamplingParams(temperature=1.5, max_tokens=8, seed=i if seeded else None,
                              structured_outputs={"choice": CHOICES}) for i in range(N)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps, use_tqdm=False)
        counts = np.bincount([CHOICES.index(o.outputs[0].text) for o in outs], minlength=len(CHOICES))
        law = exact_choice_law(llm, prompt, 1.5)
        assert law.sum() == pytest.approx(1.0, abs=1e-6)
        assert (law > 0.02).sum() >= 2, law          # a law with some spread, so the test can fail
        assert chisq_pvalue(counts, law) > 1e-3, (counts, law * N)
        assert llm.get_metrics()["num_draft_tokens"] > 0
