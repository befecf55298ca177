"""bench/decode_step.py's `hot` model (the rest_hot variant: every layer reads layer 0's weights, so
they stay in L2) computes what a model whose every layer holds a copy of layer 0's weights
computes, through the engine's own layer (model/layer.py with engine/paged_forward.py's K/V and
schedule), on the CPU twins."""

import torch

from bench.decode_step import NoAttention, hot
from rlcu.engine.paged_forward import final, logits, schedule
from rlcu.model.causal_lm import Qwen3
from rlcu.model.config import Qwen3Config
from rlcu.model.layer import layer_fwd


def _rest(m, kv, ids, pos, slots):
    x = m.w["embed"][ids.long()].clone()
    cache = NoAttention(m, kv, slots, None, None, None, 1, 0)
    for i in range(m.cfg.num_hidden_layers):
        layer_fwd(m, i, x, pos, cache, schedule(m, x.shape[0]))
    return logits(m, final(m, x))


def test_hot_model_is_layer_zero_everywhere():
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    m = Qwen3.from_config(cfg, "cpu", torch.float32, 0)
    h = hot(m)
    assert h.w["layers.2.qkv"].data_ptr() == m.w["layers.0.qkv"].data_ptr()
    assert h.w["embed"] is m.w["embed"] and h.w["final_norm"] is m.w["final_norm"]
    copied = Qwen3.from_config(cfg, "cpu", torch.float32, 1)
    copied.flat.copy_(m.flat)
    for name in m.w:
        if name.startswith("layers.") and not name.startswith("layers.0."):
            copied.w[name].copy_(m.w["layers.0." + name.split(".", 2)[2]])
    kv = torch.zeros(2, 3, 4, 16, 2, 8)
    ids, pos = torch.tensor([3, 7, 9]), torch.tensor([0, 0, 0], dtype=torch.int32)
    slots = torch.full((3,), -1, dtype=torch.int64)
    got, want = _rest(h, kv, ids, pos, slots), _rest(copied, kv, ids, pos, slots)
    assert torch.equal(got, want)
    assert not torch.equal(want, _rest(m, kv, ids, pos, slots))  # the layers do differ in m
