"""The presets of current models against their published parameter counts.

Counts are the safetensors totals the Hugging Face model pages give (Llama 3.x, Qwen2.5, Qwen3 8B/14B, Mistral
7B v0.1), and the model card's "1.7B, non-embedding 1.4B" for the tied Qwen3-1.7B. The planner leaves out
Qwen2.5's q/k/v biases ((hidden + 2 kv_dim) a layer) and Qwen3's q/k RMSNorms (2 x 128 a layer); the test adds them
back, so each count must match exactly, which checks every shape field that holds weights (layers, hidden, heads,
kv_heads, ffn, vocab, tied)."""

import pytest

from tandem.core.errors import ConfigError
from tandem.plan.inputs.model import CURRENT_PRESETS, preset

PUBLISHED = {   # name: (published parameter count, weights the planner leaves out per layer)
    "llama3-8b": (8_030_261_248, 0), "llama3-70b": (70_553_706_496, 0), "llama3.1-405b": (405_853_388_800, 0),
    "llama3.2-1b": (1_235_814_400, 0), "llama3.2-3b": (3_212_749_824, 0),
    "qwen2.5-0.5b": (494_032_768, 896 + 2 * 128), "qwen2.5-1.5b": (1_543_714_304, 1536 + 2 * 256),
    "qwen2.5-3b": (3_085_938_688, 2048 + 2 * 256), "qwen2.5-7b": (7_615_616_512, 3584 + 2 * 512),
    "qwen2.5-14b": (14_770_033_664, 5120 + 2 * 1024), "qwen2.5-32b": (32_763_876_352, 5120 + 2 * 1024),
    "qwen2.5-72b": (72_706_203_648, 8192 + 2 * 1024),
    "qwen3-8b": (8_190_735_360, 2 * 128), "qwen3-14b": (14_768_307_200, 2 * 128),
    "mistral-7b": (7_241_732_096, 0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_the_published_count(name):
    m = preset(name)
    count, per_layer = PUBLISHED[name]
    assert m.params + m.gpt.layers * per_layer == count
    assert m.source.startswith("preset (") and "config.json" in m.source and "rope_theta" in m.source


def test_qwen3_1_7b_against_its_model_card():
    m = preset("qwen3-1.7b")
    assert m.params == pytest.approx(1.7e9, rel=0.02)
    assert m.params - m.gpt.vocab * m.gpt.hidden == pytest.approx(1.4e9, rel=0.02)   # non-embedding


def test_every_current_preset_plans_and_seq_overrides():
    for name in CURRENT_PRESETS:
        assert preset(name).params > 0
    assert preset("llama3-70b").gpt.seq == 8192 and preset("llama3-70b", 32768).gpt.seq == 32768
    assert preset("llama3-70b").gpt.kv_heads == 8 and not preset("llama3-70b").gpt.dropout


def test_unknown_model_points_to_the_presets_and_hf_config():
    with pytest.raises(ConfigError) as e:
        preset("llama4-scout")
    msg = str(e.value)
    assert "llama3-70b" in msg and "qwen2.5-72b" in msg and "mistral-7b" in msg and "config.json" in msg
    assert "huggingface" in msg
