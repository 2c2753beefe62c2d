from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from leapfrog.demo import save_random_llama, stdlib_sample_text


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """A small code corpus: standard-library text cut into 12 files."""
    d = tmp_path_factory.mktemp("corpus")
    text = stdlib_sample_text(120_000)
    n = 12
    size = len(text) // n
    for i in range(n):
        (d / f"mod{i:02d}.py").write_text(text[i * size:(i + 1) * size])
    return d


@pytest.fixture(scope="session")
def bigram_target(tmp_path_factory, tokenizer):
    """A real Llama checkpoint whose attention and MLP outputs are zeroed: its next-token
    distribution depends on the current token only (a peaked bigram table, untied head), so a
    small draft can learn it in a few steps, while an untrained draft cannot guess it."""
    import transformers as tf
    path = save_random_llama(tmp_path_factory.mktemp("bigram"), tokenizer, seed=1, hidden_size=64,
                             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return path


def assert_resumed_like(straight, resumed, steps: int) -> None:
    """A run stopped and resumed (``resumed``, a train_* result) matches one trained straight
    through: the same losses step by step and the same weights, to float noise."""
    assert [s for s, _ in resumed.state.losses] == list(range(1, steps + 1))
    assert [v for _, v in resumed.state.losses] == pytest.approx([v for _, v in straight.state.losses], rel=1e-4)
    wa, wb = load_file(straight.path / "model.safetensors"), load_file(resumed.path / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
