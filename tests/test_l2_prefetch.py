"""ops/l2_prefetch.py on the CPU: its argument checks, that off CUDA it is a no-op, and the ranges
a decode step prefetches (engine/paged_forward.py decode_prefetch): each layer's weights after
its attention and the next layer's before its own, one contiguous range each, every GEMM weight
of the model in exactly one of them; the engine's output the same with it on."""

import pytest
import torch

from rlcu.engine.paged_forward import decode_prefetch
from rlcu.model.config import Qwen3Config
from rlcu.model.qwen3 import Qwen3
from rlcu.ops import l2_prefetch as l2


def _model(layers=3, tied=True):
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    return Qwen3.from_config(cfg, "cpu", torch.float32, 0)


def test_checks_name_the_problem():
    t = torch.zeros(64)
    with pytest.raises(ValueError, match=r"range \[3, 65\) outside a tensor of 64 elements"):
        l2.l2_prefetch(t, 3, 65)
    with pytest.raises(ValueError, match=r"range \[5, 4\)"):
        l2.l2_prefetch(t, 5, 4)
    with pytest.raises(ValueError, match="contiguous"):
        l2.l2_prefetch(torch.zeros(8, 8).t(), 0, 8)


def test_off_cuda_it_changes_nothing():
    t = torch.arange(1024, dtype=torch.float32)
    before = t.clone()
    assert l2.l2_prefetch(t, 0, 1024) is None
    assert torch.equal(t, before)


@pytest.mark.parametrize("tied", [True, False])
def test_decode_ranges_cover_each_gemm_weight_once(tied):
    m = _model(3, tied)
    s, L = m.layout.slots, m.cfg.num_hidden_layers
    ranges = decode_prefetch(m)
    assert len(ranges) == L + 1

    def inside(name, r):
        return r[0] <= s[name].offset and s[name].offset + s[name].numel <= r[1]

    # the step's start: layer 0's input norm and QKV, read before its first attention
    assert inside("layers.0.input_norm", ranges[0]) and inside("layers.0.qkv", ranges[0])
    for i in range(L):  # after layer i's attention: its o, post norm, gate_up, down; the next QKV
        r = ranges[i + 1]
        assert r[0] == s[f"layers.{i}.o"].offset
        for part in ("o", "post_norm", "gate_up", "down"):
            assert inside(f"layers.{i}.{part}", r)
        if i + 1 < L:
            assert inside(f"layers.{i + 1}.input_norm", r) and inside(f"layers.{i + 1}.qkv", r)
    gemms = [f"layers.{i}.{p}" for i in range(L) for p in ("qkv", "o", "gate_up", "down")]
    for name in gemms:
        assert sum(inside(name, r) for r in ranges) == 1, name
    # nothing outside the layers: not the embedding, nor an untied head (the LM head is read once
    # a step, by a GEMM that is not latency-bound)
    assert all(s["embed"].offset + s["embed"].numel <= r[0] for r in ranges)
    if not tied:
        assert all(r[1] <= s["lm_head"].offset for r in ranges)


def test_engine_output_is_the_same_with_it_on(monkeypatch):
    from rlcu.engine import LLM, SamplingParams

    m = _model(2)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 2 * i))} for i in range(4)]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5, logprobs=True)
    outs = []
    for on in (False, True):
        monkeypatch.setitem(l2.CONFIGS, "enabled", on)
        llm = LLM(m, max_num_seqs=8, num_kv_blocks=64)
        outs.append([(o.token_ids, o.logprobs) for r in llm.generate(prompts, sp, use_tqdm=False) for o in r.outputs])
    assert outs[0] == outs[1]
