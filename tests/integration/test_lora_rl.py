"""GRPO and PPO with LoRA (issue 35): the base frozen (its bits unchanged, no gradient, no
optimizer state), the adapters trained, the KL reference the base itself (the same buffer with
the adapters off, no copy), the engine sampling from base + adapters, PPO's critic an adapter on the same base,
and the memory model counting the adapters and no reference copy. Rollouts go through
support.lora_engine (the merged stand-in, and the engine's own adapters once it applies them)."""

import math

import pytest
import torch
from support.lora_engine import lora_engine  # noqa: F401 (the fixture)
from support.trainers import first_is_even, grpo_trainer, ppo_trainer

from rlcu.config import ConfigError
from rlcu.memory import job_memory

LORA = dict(r=4, alpha=8)  # no dropout: the first update's forward is then the engine's function


def test_grpo_with_lora_steps_end_to_end(tmp_path, lora_engine):  # noqa: F811
    tr = grpo_trainer(tmp_path, rewards=[first_is_even], steps=2, kl_coef=0.1, lora=LORA, optim=dict(lr=3e-2),
                      checkpoint=dict(save_at_end=True))
    model, ad = tr.model, tr.model.lora
    base = model.flat.clone()
    assert tr.opt.model is ad and tr.opt.m.numel() == ad.flat.numel()
    assert tr.ref.flat.data_ptr() == model.flat.data_ptr() and tr.ref.lora is None  # the base, no copy
    a0 = ad.flat.clone()
    hist = tr.train()
    assert len(hist) == 2
    for h in hist:
        for k in ("loss", "grad_norm", "kl", "reward"):
            assert k in h and math.isfinite(h[k]), (k, h.get(k))
    assert torch.equal(model.flat, base) and model.grad_flat is None
    assert not torch.equal(ad.flat, a0)
    assert ad.grad_flat is None  # released after the step's updates (optim.release_grads)
    # the second step's engine sampled from base + the first update's adapters: its logprobs
    # are the trainer's, up to the float sums (the base alone would be far off: B moved from 0)
    assert hist[1]["mismatch/abs_max"] < 1e-4, hist[1]
    # the reference is the base: its logprobs of a batch are the policy's with the adapters off
    from rlcu.train import rollout as ro

    samples = tr._engine_phase(lambda: tr.rollout(tr.rows[:2], 2, seed=3))
    batch = ro.pack(samples, device=tr.device)
    ref_lp = ro.batch_logprobs(tr.ref, batch, 1.0, 64)
    model.lora = None
    try:
        base_lp = ro.batch_logprobs(model, batch, 1.0, 64)
    finally:
        model.lora = ad
    assert torch.equal(ref_lp, base_lp)
    assert not torch.equal(ro.batch_logprobs(model, batch, 1.0, 64), base_lp)
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    ck = tr.last_checkpoint
    assert not (ck / "ref_model.pt").exists() and not (ck / "model" / "model.safetensors").exists()


def test_grpo_lora_memory_counts_adapters_and_no_reference(tmp_path, lora_engine):  # noqa: F811
    tr = grpo_trainer(tmp_path, steps=1, kl_coef=0.1, lora=dict(r=4))
    mem = job_memory(tr._memory_shape())
    assert mem.shape.adapter is not None and mem.shape.adapter.r == 4
    assert mem.reference == 0 and mem.gradients == 0 and mem.optimizer_state == 0
    assert mem.adapters > 0 and mem.adapter_gradients > 0
    full = job_memory(tr._memory_shape().with_(adapter=None, reference=True))
    assert full.reference > 0 and full.optimizer_state > mem.adapters


def test_ppo_with_lora_one_step(tmp_path, lora_engine):  # noqa: F811
    """PPO with lora: the critic is an adapter of its own (the lora section's shape, another seed)
    and the value head over the policy's base buffer: one base in memory and in the memory
    model, whose critic is the adapters and the head (its state a LoRA critic's, not a trunk's);
    a checkpoint's critic state is the adapters and the head."""
    from rlcu.memory import parts
    from rlcu.train.lora_critic import LoraCritic

    kw = dict(steps=1, lora=dict(r=4, alpha=8, dropout=0.1), critic=dict(optim=dict(lr=3e-3), head_init_std=0.1))
    tr = ppo_trainer(tmp_path, checkpoint=dict(save_at_end=True), **kw)
    model, ad, critic = tr.model, tr.model.lora, tr.critic
    base, c0 = model.flat.clone(), critic.flat.clone()
    assert isinstance(critic, LoraCritic) and critic.trunk.flat.data_ptr() == model.flat.data_ptr()  # one base
    assert critic.ad is not ad and critic.ad.cfg.r == 4 and critic.flat.numel() < model.flat.numel() // 4
    assert tr.critic_opt.m.numel() == critic.flat.numel()  # the critic's optimizer state: adapters and head
    hist = tr.train()
    h = hist[0]
    for k in ("reward", "vf_loss", "loss", "kl_penalty"):
        assert k in h and math.isfinite(h[k]), (k, h.get(k))
    assert torch.equal(model.flat, base)
    assert bool(ad.flat.abs().sum() > 0) and not torch.equal(critic.flat, c0)
    o = critic.layout.head_offset
    assert not torch.equal(critic.flat[:o], c0[:o]) and not torch.equal(critic.flat[o:], c0[o:])  # adapter, head
    mem = job_memory(tr._memory_shape())
    s = mem.shape
    assert s.critic and mem.critic == parts.critic(s) and mem.critic < parts.params(s.cfg) * s.weight_bytes  # no base
    full = job_memory(s.with_(adapter=None))
    assert full.critic > parts.params(s.cfg) * s.weight_bytes > mem.critic
    saved = torch.load(tr.last_checkpoint / "critic.pt")["flat"]
    assert torch.equal(saved, critic.flat)  # the checkpoint's critic: the adapters and the head, no base
    with pytest.raises(ConfigError, match="critic.path is set with lora:"):
        ppo_trainer(tmp_path / "p", **{**kw, "critic": dict(path=str(tmp_path))})


def test_the_scheduler_sizes_a_lora_job_from_its_config(tmp_path):
    from support.trainers import grpo_config

    from rlcu.train.sizing import config_shape

    cfg, _ = grpo_config(tmp_path, kl_coef=0.1, lora=dict(r=8, target_modules=["q_proj", "v_proj"], dropout=0.1))
    s = config_shape(cfg)
    assert s.adapter is not None and (s.adapter.r, s.adapter.target_modules, s.adapter.dropout) == (
        8, ("q_proj", "v_proj"), True)
    mem, full = job_memory(s), job_memory(config_shape(grpo_config(tmp_path, kl_coef=0.1)[0]))
    assert mem.reference == 0 and full.reference > 0 and mem.peak < full.peak
