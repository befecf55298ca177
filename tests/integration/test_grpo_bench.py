"""bench/grpo.py's LoRA rows (--lora, issue 35) on the CPU at a shape smaller than --tiny's: rlcu's
`lora:` section and TRL's GRPOTrainer with a PEFT LoraConfig train the same adapters. The sides
take ~4 s; importing trl, peft and datasets cold adds ~9 s (shared with the other TRL bench tests)."""

import pytest

from bench import grpo

PROTO = dict(prompts=2, group=2, prompt_len=8, completion_len=4)


def _adapter_params(r: int) -> int:
    """r (in + out) summed over a tiny layer's seven linears, times its layers (the LM head frozen)."""
    t = grpo.TINY
    H, inter, q = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"] * t["head_dim"]
    kv = t["num_key_value_heads"] * t["head_dim"]
    per_layer = (H + q) + 2 * (H + kv) + (q + H) + 2 * (H + inter) + (inter + H)
    return r * per_layer * t["num_hidden_layers"]


def test_lora_rows_train_the_same_adapters_on_both_sides():
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    r = 2
    ours = grpo.bench_rlcu(PROTO, 1, 0, True, 16384, lora=r)
    assert ours["trained_params"] == _adapter_params(r)
    # the optimizer's moments are the adapters' (fp32), not the frozen base's
    assert ours["buffers_GiB"]["adam_m"] * 2**30 == pytest.approx(4 * _adapter_params(r))
    assert ours["s_per_step"] > 0 and ours["phases_s"]["train"] > 0
    peer = grpo.bench_trl(PROTO, 1, 0, True, lora=r)
    assert "error" not in peer, peer.get("error")
    assert peer["trained_params"] == ours["trained_params"]
    assert 0 < peer["phases_s"]["generate"] < peer["s_per_step"] and peer["phases_s"]["train"] > 0
