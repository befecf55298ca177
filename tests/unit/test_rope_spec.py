"""model/rope.py: each rotary variant's frequency table and cos/sin factor against transformers'
(ROPE_INIT_FUNCTIONS, the default from Llama's rotary embedding), at the published configs;
every config form read; the published form written; unknown and dynamic types refused by name."""

import copy
import math

import pytest
import torch

from rlcu.model.rope import RopeSpec, inv_freq, mscale

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
QWEN_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen's documented form
CASES = [  # (config.json's rope keys, head_dim)
    ({"rope_theta": 1e6}, 128),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, 64),
    ({"rope_theta": 5e5, "rope_scaling": LLAMA31}, 128),
    ({"rope_theta": 5e5, "rope_scaling": LLAMA31}, 20),
    ({"rope_theta": 1e6, "rope_scaling": QWEN_YARN, "max_position_embeddings": 131072}, 128),
    ({"rope_theta": 1e6, "rope_scaling": {**QWEN_YARN, "beta_fast": 16, "beta_slow": 2}}, 20),
]


def _hf(keys: dict, D: int):
    keys = copy.deepcopy(keys)  # transformers writes into the rope dicts it is given
    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, **keys)
    rtype = cfg.rope_parameters["rope_type"]
    if rtype == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg, device="cpu")
    return ROPE_INIT_FUNCTIONS[rtype](cfg, "cpu")


@pytest.mark.parametrize("keys,D", CASES)
def test_inv_freq_and_mscale_are_transformers(keys, D):
    spec = RopeSpec.from_hf(keys)
    ref, factor = _hf(keys, D)
    got = inv_freq(spec, D)
    assert got.dtype == torch.float32 and got.shape == (D // 2,)
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=0)
    assert mscale(spec) == pytest.approx(factor, rel=1e-12)


def test_yarn_factor_is_the_papers():
    spec = RopeSpec.from_hf({"rope_scaling": QWEN_YARN})
    assert mscale(spec) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert mscale(RopeSpec.from_hf({"rope_scaling": {**QWEN_YARN, "attention_factor": 1.5}})) == 1.5
    # the table: the first (fast) pairs kept, the last (slow) ones divided by the factor
    f, f0 = inv_freq(spec, 128), inv_freq(RopeSpec(theta=1e4), 128)
    assert f[0] == f0[0] and torch.allclose(f[-1], f0[-1] / 4)


def test_config_forms_agree_and_write_the_published_form():
    top = RopeSpec.from_hf({"rope_theta": 5e5, "rope_scaling": LLAMA31})
    tf5 = RopeSpec.from_hf({"rope_parameters": {"rope_theta": 5e5, **LLAMA31}})
    old = RopeSpec.from_hf({"rope_theta": 5e5, "rope_scaling": {**LLAMA31, "type": "llama3"}})
    assert top == tf5 == old
    assert top.to_hf() == {"rope_theta": 5e5, "rope_scaling": LLAMA31}
    assert RopeSpec.from_hf(top.to_hf()) == top
    assert RopeSpec.from_hf({"rope_theta": 1e6}).to_hf() == {"rope_theta": 1e6, "rope_scaling": None}
    assert RopeSpec.from_hf({}) == RopeSpec(theta=1e4)
    assert RopeSpec.from_hf({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}) == RopeSpec(theta=5e5)
    y = RopeSpec.from_hf({"rope_scaling": QWEN_YARN})
    assert RopeSpec.from_hf(y.to_hf()) == y


@pytest.mark.parametrize("keys,words", [
    ({"rope_scaling": {"rope_type": "su"}}, ["x.json", "rope_scaling.rope_type", "default, linear, llama3, yarn",
                                            "'su'"]),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["x.json", "'dynamic' is not supported", "max_position"]),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, ["rope_parameters", "low_freq_factor", "required"]),
    ({"rope_scaling": {"type": "linear", "factor": 0.5}}, ["rope_scaling", "factor", ">= 1"]),
    ({"rope_scaling": {"type": "linear"}}, ["factor is required"]),
    ({"rope_theta": -1.0}, ["rope_theta", "> 0"]),
    ({"rope_scaling": {**LLAMA31, "low_freq_factor": 4.0}}, ["low_freq_factor", "high_freq_factor"]),
    ({"rope_scaling": {**QWEN_YARN, "mscale": 0.7}}, ["rope_scaling.mscale", "not supported"]),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, ["original_max_position_embeddings", "required"]),
    ({"rope_scaling": "yarn"}, ["rope_scaling must be an object"]),
])
def test_refusals_name_the_field(keys, words):
    with pytest.raises(ValueError) as e:
        RopeSpec.from_hf(keys, "x.json")
    for w in words:
        assert w in str(e.value)


def test_fields_of_another_type_are_refused():
    with pytest.raises(ValueError, match="low_freq_factor is not a field of rope_type 'linear'"):
        RopeSpec(type="linear", factor=2.0, low_freq_factor=1.0)
    with pytest.raises(ValueError, match="head_dim must be even"):
        inv_freq(RopeSpec(), 7)
