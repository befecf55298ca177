"""Full fine-tuning that does not fit the device is refused at setup (rlcu.train.sizing.refuse_unfit),
with the memory model's estimate against the device's memory and a pointer to `lora:`; what fits,
a LoRA run, and a CPU run (no device budget) are never refused. A fake small budget stands in for
the GPU."""

from __future__ import annotations

import re

import pytest
from support.trainers import grpo_config, grpo_trainer, sft_config, token_rows

from rlcu.config import GRPOConfig, _build
from rlcu.errors import SetupError
from rlcu.memory import GiB, job_memory
from rlcu.train import sizing

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Qwen3-30B-A3B (its published config.json)
A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
           num_key_value_heads=4, head_dim=128, tie_word_embeddings=False, family="qwen3_moe", num_experts=128,
           num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
H200 = 141 * 10**9


def _cfg(tmp_path, model, **kw):
    d = dict(model=model, prompts_per_step=32, group_size=8, max_new_tokens=256, micro_batch_tokens=8192,
             rewards=[{"fn": "rlcu.data.synthetic:exact_match_reward"}], log=dict(out_dir=str(tmp_path / "run")))
    return _build(GRPOConfig, dict(d, **kw))


def test_the_refusal_holds_the_estimate_to_the_budget(tmp_path):
    """At the boundary: the estimate's device bytes fit, one byte less does not; the message gives
    both numbers and names lora:."""
    cfg, _ = grpo_config(tmp_path)
    mem = job_memory(sizing.train_shape(cfg))
    need = mem.device_bytes(mem.peak)
    sizing.refuse_unfit(cfg, budget=need)
    with pytest.raises(SetupError, match="lora: {r: 16}") as e:
        sizing.refuse_unfit(cfg, budget=need - 1)
    got = re.search(r"does not fit: estimated (\d+\.\d\d) GiB a rank .* against (\d+\.\d\d) GiB", str(e.value))
    assert got.groups() == (f"{need / GiB:.2f}", f"{(need - 1) / GiB:.2f}")
    sizing.refuse_unfit(cfg)  # the CPU: no budget, nothing refused


def test_qwen3_30b_a3b_is_refused_full_and_taken_with_lora(tmp_path):
    """On one H200: the 30B-A3B's full fine-tuning (bf16 weights, fp32 master and moments) is
    refused, its LoRA run and the 0.6B's full one are not."""
    bf16 = dict(dtype="bfloat16", path=None, gradient_checkpointing="auto")
    with pytest.raises(SetupError, match=r"30,5\d\d,\d{3},\d{3} parameters, 1 rank\) does not fit: estimated"):
        sizing.refuse_unfit(_cfg(tmp_path, dict(bf16, tiny=A3B)), budget=H200)
    sizing.refuse_unfit(_cfg(tmp_path, dict(bf16, tiny=A3B), lora=dict(r=16, target_modules="all-linear")),
                        budget=H200)
    sizing.refuse_unfit(_cfg(tmp_path, bf16), budget=H200)  # the default 0.6B shape


def test_the_trainers_refuse_before_building(tmp_path, monkeypatch):
    """A trainer asks before it builds the model (a 30B model would fill the device first); with
    lora: the same budget is not asked."""
    monkeypatch.setattr(sizing, "device_memory", lambda device: 1 << 20)
    with pytest.raises(SetupError, match=r"full fine-tuning of this model .* against 0\.00 GiB"):
        grpo_trainer(tmp_path)
    from rlcu.train.sft import SFTTrainer

    with pytest.raises(SetupError, match="full fine-tuning"):
        SFTTrainer(sft_config(tmp_path / "sft", "model.tiny={vocab_size: 61, hidden_size: 64, "
                              "intermediate_size: 96, num_hidden_layers: 2, num_attention_heads: 4, "
                              "num_key_value_heads: 2, head_dim: 16}"), token_rows())
    tr = grpo_trainer(tmp_path, lora=dict(r=4))
    assert tr.model.lora is not None
