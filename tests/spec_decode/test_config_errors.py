"""speculative_config values of the wrong type or range: a ConfigError naming the field, never a
TypeError (an unhashable list as method) or a value accepted silently (a number as model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.errors import ConfigError
from leapfrog.spec_decode.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("change, pattern", [
    ({"method": ["ngram"]}, r"speculative_config\.method=\['ngram'\]: must be a string \(one of \['draft_model', 'eagle', 'eagle3', 'ngram'"),
    ({"method": {"ngram": 1}}, r"speculative_config\.method=.*must be a string"),
    ({"method": 3}, r"speculative_config\.method=3: must be a string"),
    ({"method": None}, r"speculative_config\.method=None: must be a string"),
    ({"method": "eagle9"}, r"speculative_config\.method='eagle9': must be one of"),
    ({"num_speculative_tokens": "2"}, r"speculative_config\.num_speculative_tokens='2': must be an integer in \[1, 32\]"),
    ({"num_speculative_tokens": 2.0}, r"speculative_config\.num_speculative_tokens=2\.0: must be an integer"),
    ({"num_speculative_tokens": True}, r"speculative_config\.num_speculative_tokens=True: must be an integer"),
    ({"num_speculative_tokens": 33}, r"speculative_config\.num_speculative_tokens=33: must be an integer in \[1, 32\]"),
    ({"method": "draft_model", "model": 5}, r"speculative_config\.model=5: must be a string"),
    ({"method": "draft_model", "model": ["d"]}, r"speculative_config\.model=\['d'\]: must be a string"),
    ({"prompt_lookup_min": "1"}, r"speculative_config\.prompt_lookup_min='1': must be an integer >= 1"),
    ({"prompt_lookup_max": "5"}, r"speculative_config\.prompt_lookup_max='5': must be an integer >= 1"),
    ({"disable_by_batch_size": "4"}, r"speculative_config\.disable_by_batch_size='4': must be an integer >= 1 \(or null\)"),
    ({"max_model_len": 1}, r"speculative_config\.max_model_len=1: must be an integer >= 2 \(or null\)"),
    ({"max_model_len": "64"}, r"speculative_config\.max_model_len='64': must be an integer >= 2"),
    ({"adaptive": "yes"}, r"speculative_config\.adaptive='yes': must be true or false"),
    ({"adaptive": True, "adaptive_explore_interval": 1},
     r"speculative_config\.adaptive_explore_interval=1: must be an integer >= 2"),
    ({"method": "draft_model", "model": "d", "draft_dtype": "fp8"}, r"speculative_config\.draft_dtype='fp8': must be one of"),
    ({"method": "draft_model", "model": "d", "draft_dtype": 16}, r"speculative_config\.draft_dtype=16: must be a string"),
])
def test_bad_field_named(change, pattern):
    with pytest.raises(ConfigError, match=pattern):
        SpeculativeConfig.from_dict({**NGRAM, **change})


@pytest.mark.parametrize("spec, pattern", [
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
     r"prompt_lookup_min applies to method 'ngram' only, not 'draft_model'"),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     r"prompt_lookup_max applies to method 'ngram' only"),
    ({**NGRAM, "draft_dtype": "bfloat16"}, r"draft_dtype applies to methods 'draft_model', 'eagle' and 'eagle3'"),
    ({**NGRAM, "adaptive_explore_interval": 8}, r"adaptive_explore_interval applies with \"adaptive\": true"),
    ({"method": "suffix", "num_speculative_tokens": 4, "max_spec_factor": -5},
     r"max_spec_factor=-5: must be a number in \[0, 1e\+06\]"),
])
def test_keys_no_method_reads_are_refused(spec, pattern):
    """A key the chosen method never reads (or a value that turns it off in silence) is an error,
    not a setting accepted and ignored."""
    with pytest.raises(ConfigError, match=pattern):
        SpeculativeConfig.from_dict(spec)
    assert SpeculativeConfig.from_dict({**NGRAM, "adaptive": True, "adaptive_explore_interval": 8})


def test_non_string_keys_and_non_dicts():
    with pytest.raises(ConfigError, match="unknown key"):
        SpeculativeConfig.from_dict({**NGRAM, 1: 2, "zz": 3})
    with pytest.raises(ConfigError, match="must be a dict, got list"):
        SpeculativeConfig.from_dict([NGRAM])


def test_path_model_accepted_as_string():
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": Path("/some/draft"), "num_speculative_tokens": 2})
    assert cfg.model == "/some/draft"


def test_engine_reports_it_and_a_good_engine_still_works(llama_dir):
    with pytest.raises(ConfigError, match=r"speculative_config\.method"):
        LLM(model=str(llama_dir), speculative_config={"method": ["ngram"], "num_speculative_tokens": 2})
    llm = LLM(model=str(llama_dir), dtype="float32", speculative_config=NGRAM)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("extra, pattern", [
    ({"speculative_token_tree": "[(0, 0)]", "num_speculative_tokens": 2}, r"path \(0, 0\) has no parent \(0,\)"),
    ({"speculative_token_tree": "nonsense"}, "not a list of tuples"),
    ({"speculative_token_tree": "[(0,), (0,)]", "num_speculative_tokens": 1}, "appears twice"),
    ({"speculative_token_tree": "[(0,), (-1,)]", "num_speculative_tokens": 1}, r"child ranks in \[0, 128\)"),
    ({"speculative_token_tree": "[(0,), (1000000000,)]", "num_speculative_tokens": 1}, r"child ranks in \[0, 128\)"),
    ({"speculative_token_tree": "{(0,): 1}", "num_speculative_tokens": 1}, "not a list of tuples .*a dict"),
    ({"speculative_token_tree": "[b'\\x00', b'\\x00\\x00']", "num_speculative_tokens": 2},   # (read as (0,), (0, 0))
     "path b'\\\\x00' is of type bytes"),
    ({"speculative_token_tree": "[{0}, {0, 1}]", "num_speculative_tokens": 2}, r"path \{0\} is of type set"),
    ({"speculative_token_tree": [{0: "a"}], "num_speculative_tokens": 1}, "is of type dict"),
    ({"speculative_token_tree": "[(0,), {}]", "num_speculative_tokens": 1}, r"path \{\} is of type dict"),
    ({"speculative_token_tree": "[(0,), (1,)]", "num_speculative_tokens": 1, "adaptive": True},
     "adaptive with a static speculative_token_tree"),
    ({"speculative_token_tree": "[(0,)]" + " " * 500 + "x", "num_speculative_tokens": 1}, r"\.\.\.: not a list"),
    ({"speculative_token_tree": "[(0,), (1,)]", "num_speculative_tokens": 1, "eagle_topk": 1}, "leave eagle_topk out"),
    ({"num_draft_tokens": 50, "eagle_topk": 1}, "grows at most 3 candidate nodes"),
    ({"speculative_token_tree": "[(0,), (0, 0)]", "num_speculative_tokens": 3}, "2 deep but num_speculative_tokens=3"),
    ({"speculative_token_tree": "[(0,)]", "num_speculative_tokens": 1, "num_draft_tokens": 4}, "leave num_draft"),
    ({"num_draft_tokens": 0}, r"num_draft_tokens=0: must be an integer in \[1, 128\] or \"auto\""),
    ({"num_draft_tokens": "lots"}, "num_draft_tokens='lots'"),
    ({"eagle_topk": 0}, r"eagle_topk=0: must be an integer in \[1, 128\]"),
    ({"adaptive": True, "num_draft_tokens": 8}, "num_draft_tokens='auto'"),
])
def test_tree_config_errors(extra, pattern):
    d = {"method": "eagle3", "model": "h", "num_speculative_tokens": 3, **extra}
    with pytest.raises(ConfigError, match=pattern):
        SpeculativeConfig.from_dict(d)


def test_eagle_tree_keys_refused_for_other_methods():
    for key, value in (("num_draft_tokens", 8), ("eagle_topk", 2), ("speculative_token_tree", "[(0,)]")):
        for method in ("ngram", "suffix"):
            with pytest.raises(ConfigError, match=f"{key} applies to methods \\['eagle', 'eagle3'\\] only"):
                SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 3, key: value})


def test_null_means_not_given_for_every_optional_key():
    """``null`` in an optional key is the default, as vLLM reads it: draft_dtype, eagle_topk, the
    n-gram and suffix keys were refused ("applies to methods ...") where draft_quantization and
    speculative_token_tree were taken."""
    from leapfrog.spec_decode.config import SUFFIX_KEYS

    base = {"method": "ngram", "num_speculative_tokens": 3}
    nulls = {k: None for k in ("eagle_topk", "draft_dtype", "draft_quantization", "speculative_token_tree",
                               "prompt_lookup_min", "prompt_lookup_max", "adaptive_explore_interval", *SUFFIX_KEYS)}
    assert SpeculativeConfig.from_dict({**base, **nulls}) == SpeculativeConfig.from_dict(base)
    with pytest.raises(ConfigError, match="draft_dtype applies to methods"):   # a value still is refused
        SpeculativeConfig.from_dict({**base, "draft_dtype": "float32"})
