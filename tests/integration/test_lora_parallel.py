"""LoRA at 2 ranks (gloo, CPU) equals one process (issue 35): the adapters' gradient reduced over
the ranks at the step and their optimizer state in 1/N shards (ShardedAdamW over the adapters'
flat buffer), the base frozen on every rank; SFT with a sharded checkpoint resumed in one
process, GRPO (its rollouts through the merged stand-in engine, support.lora_engine), and PPO's
LoRA critic (its adapter and head reduced and sharded as the policy's adapters)."""

from __future__ import annotations

import pytest
import torch
from support.parallel_util import ok, run_ranks
from support.trainers import first_is_even, grpo_config, sft_config, tiny, token_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SFT_SETS = ("optim.lr=3e-2", "optim.max_grad_norm=0.5", "grad_accum=4", "batch_tokens=24", "steps=4",
            "checkpoint.every=2", "checkpoint.keep_last=0", "lora.r=4", "lora.alpha=8",
            "lora.target_modules=[q_proj,v_proj,o_proj,down_proj]")
GRPO_KW = dict(steps=2, kl_coef=0.05, micro_batch_tokens=24, optim=dict(lr=3e-2), lora=dict(r=4, alpha=8))
TOL = 5e-5  # fp32 sums in another order (the ranks' micro-batches), carried by Adam over 4 steps


def _sft(out, *sets):
    from rlcu.train.sft import SFTTrainer

    tr = SFTTrainer(sft_config(out, *SFT_SETS, *sets), token_rows(24), model=tiny())
    tr.train()
    return tr


def _grpo(out):
    from support.lora_engine import MergedLoraLLM, real_engine_lora

    from rlcu.data import synthetic as syn
    from rlcu.train import rl_trainer
    from rlcu.train.grpo import GRPOTrainer

    if not real_engine_lora():
        rl_trainer.LLM = MergedLoraLLM  # (a spawned rank's own module: nothing to restore)
    cfg, tok = grpo_config(out, **GRPO_KW)
    tr = GRPOTrainer(cfg, syn.sort_rows(64, "train", min_len=2, max_len=3), [first_is_even], tokenizer=tok)
    return tr, tr.train()


def _ppo(out):
    """One PPO step with LoRA: the critic an adapter and head on the policy's base (train/lora_critic.py)."""
    from support.trainers import ppo_trainer

    tr = ppo_trainer(out, steps=1, lora=dict(r=4, alpha=8), critic=dict(optim=dict(lr=3e-3), head_init_std=0.1))
    tr.train()
    return tr


def _ranks(rank, tmp):
    a = _sft(tmp / "sft2")
    g, hist = _grpo(tmp / "grpo2")
    p = _ppo(tmp / "ppo2")
    return {"sft": a.model.lora.flat.clone(), "base": a.model.flat.clone(), "opt": type(a.optimizer).__name__,
            "grpo": g.model.lora.flat.clone(), "grpo_hist": hist, "critic": p.critic.flat.clone(),
            "critic_opt": type(p.critic_opt).__name__}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_lora_two_ranks_equal_one_process(tmp_path, monkeypatch):
    d, _ = run_ranks(_ranks, 2, tmp_path, tmp_path, timeout=240)
    r0, r1 = ok(d)
    assert r0["opt"] == "ShardedAdamW"
    for k in ("sft", "grpo", "base"):
        assert torch.equal(r0[k], r1[k]), k
    assert torch.equal(r0["base"], tiny().flat)  # the base frozen on every rank
    ref = _sft(tmp_path / "ref")
    assert ref.model.lora.flat.abs().max() > 1e-2  # B moved from zero
    assert _rel(r0["sft"], ref.model.lora.flat) < TOL
    # the 2-rank run's step-2 checkpoint (sharded adapter state) continued in one process
    ck = tmp_path / "sft2" / "checkpoints"
    assert sorted(p.name for p in (ck / "step-000002" / "optim").iterdir()) == [
        "rank-00000-of-00002.pt", "rank-00001-of-00002.pt"]
    import shutil

    shutil.rmtree(ck / "step-000004")
    c = _sft(tmp_path / "sft2", "checkpoint.resume=auto")
    assert _rel(c.model.lora.flat, ref.model.lora.flat) < TOL
    from support.lora_engine import MergedLoraLLM, real_engine_lora

    from rlcu.train import rl_trainer

    if not real_engine_lora():
        monkeypatch.setattr(rl_trainer, "LLM", MergedLoraLLM)
    g, hist = _grpo(tmp_path / "grpo1")
    assert _rel(r0["grpo"], g.model.lora.flat) < 1e-5, _rel(r0["grpo"], g.model.lora.flat)
    for a, b in zip(r0["grpo_hist"], hist):  # the same samples, rewards and global statistics
        assert a["reward"] == b["reward"] and a["completion_len"] == b["completion_len"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # PPO's LoRA critic across ranks: its adapter and head's gradient reduced, its state sharded
    assert r0["critic_opt"] == "ShardedAdamW" and torch.equal(r0["critic"], r1["critic"])
    assert _rel(r0["critic"], _ppo(tmp_path / "ppo1").critic.flat) < TOL
