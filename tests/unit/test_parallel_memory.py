"""The per-rank memory estimate: against the measured one-H200 peaks (BENCHMARKS.md section
6), the 8-H200 targets, and the buffers the optimizers really allocate."""

from __future__ import annotations

import pytest
import torch

import rlcu
from rlcu.config import OptimConfig
from rlcu.model.config import Qwen3Config
from rlcu.parallel.memory import GiB, H200_GiB, estimate, summary

SHAPES = {  # the published Qwen3 shapes (head_dim 128, vocab 151936)
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=9728, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=17408, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=25600, tie_word_embeddings=False),
}
BF16 = dict(master_weights=False, state_bytes=2, grad_bytes=2)  # the bf16 memory mode
GRPO_KV = 32 * 8 * (128 + 256 + 16)  # a step's sequences (32 prompts x 8, 128 + 256 tokens)


@pytest.mark.parametrize("shape,kw,measured", [
    ("4b", dict(micro_batch_tokens=8 * 2048), 41.5),  # train step 8 x 2048, bf16 memory mode
    ("8b", dict(micro_batch_tokens=8 * 2048), 75.0),
    ("4b", dict(micro_batch_tokens=8192, kv_tokens=GRPO_KV), 37.0),  # GRPO step 32 x 8, 128 + 256
    ("8b", dict(micro_batch_tokens=8192, kv_tokens=GRPO_KV), 71.0),
])
def test_one_gpu_estimate_matches_measured_peaks(shape, kw, measured):
    est = estimate(Qwen3Config(**SHAPES[shape]), 1, **BF16, **kw)["peak"] / GiB
    assert abs(est - measured) / measured < 0.15, (shape, est, measured)


def test_eight_h200_targets():
    kv = GRPO_KV // 8
    e14 = estimate(Qwen3Config(**SHAPES["14b"]), 8, micro_batch_tokens=16384, kv_tokens=kv)  # default precision
    e32 = estimate(Qwen3Config(**SHAPES["32b"]), 8, micro_batch_tokens=8192, kv_tokens=kv, **BF16)
    print(summary(e14))
    print(summary(e32))
    assert e14["peak"] / GiB < H200_GiB and e32["peak"] / GiB < H200_GiB
    # and what makes them fit: one GPU holds neither, nor 8 without the overlapped buckets for 32B
    assert estimate(Qwen3Config(**SHAPES["14b"]), 1, micro_batch_tokens=16384, kv_tokens=kv)["peak"] / GiB > H200_GiB
    assert estimate(Qwen3Config(**SHAPES["32b"]), 1, micro_batch_tokens=8192, **BF16)["peak"] / GiB > H200_GiB
    no_overlap = estimate(Qwen3Config(**SHAPES["32b"]), 8, micro_batch_tokens=8192, kv_tokens=kv, overlap=False, **BF16)
    assert no_overlap["peak"] > e32["peak"] + 50 * GiB  # a full gradient buffer per rank
    persistent = e32["weights"] + e32["reference"] + e32["optimizer"]
    assert e32["peak"] == int((persistent + max(e32["train_phase"], e32["rollout_phase"])) * 1.05) + int(1.5 * GiB)


@pytest.mark.parametrize("mode", [dict(), dict(master_weights=False, state_dtype="bfloat16", grad_dtype="bfloat16")])
def test_estimate_counts_the_buffers_the_optimizers_allocate(mode):
    from rlcu.optim import FlatAdamW
    from rlcu.parallel.comm import World
    from rlcu.parallel.memory import estimate_for
    from rlcu.parallel.zero import ShardedAdamW

    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    oc = OptimConfig(**mode)
    m1 = rlcu.Qwen3.from_config(cfg, dtype=torch.bfloat16)
    o1 = FlatAdamW(m1, oc)
    e1 = estimate_for(m1, o1, 1, 64)
    assert e1["optimizer"] == sum(o1.state_bytes().values())
    m1.zero_grad()
    assert e1["gradient_shard"] == m1.grad_flat.numel() * m1.grad_flat.element_size()
    for rank in range(3):  # no process group is needed to build the shards
        m = rlcu.Qwen3.from_config(cfg, dtype=torch.bfloat16)
        o = ShardedAdamW(m, oc, World(rank=rank, size=3, backend="gloo"))
        e = estimate_for(m, o, 3, 64)
        assert e["optimizer"] == sum(o.state_bytes().values())
        m.zero_grad()
        assert e["gradient_shard"] == o.sink.shard.numel() * o.sink.shard.element_size()
        assert m.grad_flat is None  # no full-size gradient buffer in the overlapped mode
        assert 2.9 * e["optimizer"] < e1["optimizer"] < 3.1 * e["optimizer"]
