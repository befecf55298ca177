"""Reward-model training at 2 ranks (gloo, CPU) ends with the weights of one process: each rank
takes a block of every step's pairs by tokens (several micro-batches a step), the loss is the
mean over the step's pairs wherever they ran, the optimizer (ShardedAdamW) reduces the gradient
at the step; the metrics, held-out ones included, are one process's. LoRA likewise (the adapters'
and the head's gradients reduced at their steps). ~20 s on 2 cores, most of it the two spawned
ranks' start-up, which one spawn shares for both runs."""

from __future__ import annotations

import pytest
import torch
from support.parallel_util import ok, run_ranks

from rlcu.data.synthetic import make_tokenizer, sort_preference_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _trainer(out, lora=False):
    from rlcu.train.reward_trainer import RewardTrainer

    tok = make_tokenizer()
    cfg = {"model": {"tiny": dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  max_position_embeddings=64, eos_token_id=tok.eos_token_id)},
           "steps": 3, "batch_pairs": 8, "batch_tokens": 60, "optim": {"lr": 1e-2}, "data": {"eval_size": 6},
           "log": {"out_dir": str(out), "tensorboard": False, "plot": False, "progress": False}}
    if lora:
        cfg["lora"] = {"r": 4, "alpha": 8, "init": "gaussian"}
    return RewardTrainer(cfg, dataset=sort_preference_rows(40), tokenizer=tok)


def _ranks(rank, tmp):
    t = _trainer(tmp / "two")
    t.train()
    lo = _trainer(tmp / "two-lora", lora=True)
    lo.train()
    return {"flat": t.model.flat.clone(), "hist": t.history, "lora": lo.lora.flat.clone(), "head": lo.head.flat.clone()}


def test_reward_model_two_ranks_equal_one_process(tmp_path):
    d, _ = run_ranks(_ranks, 2, tmp_path, tmp_path, timeout=240)
    r0, r1 = ok(d)
    one = _trainer(tmp_path / "one")
    start = one.model.flat.clone()
    one.train()
    assert torch.equal(r0["flat"], r1["flat"])
    assert float((one.model.flat - start).norm() / start.norm()) > 1e-3
    # the same sums in another order (micro-batches packed per rank): fp32 rounding apart
    assert float((r0["flat"] - one.model.flat).norm() / one.model.flat.norm()) < 5e-5
    assert len(r0["hist"]) == len(one.history) == 4  # the baseline evaluation and 3 steps
    for a, b in zip(r0["hist"], one.history):
        for k in ("loss", "accuracy", "margin", "eval/loss", "eval/accuracy", "eval/margin", "pairs"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert (tmp_path / "two" / "reward_model" / "config.json").is_file()
    lo = _trainer(tmp_path / "one-lora", lora=True)
    start = lo.lora.flat.clone()
    lo.train()
    assert torch.equal(r0["lora"], r1["lora"]) and torch.equal(r0["head"], r1["head"])
    assert float((lo.lora.flat - start).norm() / start.norm()) > 1e-3
    for mine, one in ((r0["lora"], lo.lora.flat), (r0["head"], lo.head.flat)):
        assert float((mine - one).norm() / one.norm()) < 5e-5
