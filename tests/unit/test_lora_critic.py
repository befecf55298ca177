"""PPO's LoRA critic (rlcu.train.lora_critic) against PEFT on transformers (the autograd oracle),
fp32 on the CPU: its values and the gradients of its adapter's A and B and of the value head,
through both checkpointing modes; its trunk reads the policy's base buffer (no copy), which stays
frozen, and the policy's adapters get no gradient from it."""

import pytest
import torch
from support.hf_util import rel_err
from support.lora_util import adapter_grads, base_pair, peft_grads, peft_twin, random_adapter, rlcu_model

from rlcu.model.lora import LoraConfig
from rlcu.train.lora_critic import LoraCritic

pytest.importorskip("peft")


def test_lora_critic_values_and_grads_match_peft(tmp_path):
    hf, folder = base_pair(tmp_path, "qwen3")
    policy = rlcu_model(folder)
    pol_ad = random_adapter(policy, LoraConfig(r=3, alpha=5, target_modules=["q_proj", "v_proj", "down_proj"]))
    base0 = policy.flat.clone()
    critic = LoraCritic.for_policy(policy, head_init_std=0.1, seed=1)
    assert critic.trunk.flat.data_ptr() == policy.flat.data_ptr()  # one base
    assert critic.ad.cfg.seed == pol_ad.cfg.seed + 1 and critic.ad.cfg.r == 3
    assert critic.flat.numel() == critic.ad.flat.numel() + 128  # adapters | head (H + 1 = 97 -> 128)
    assert float(critic.flat[: critic.layout.head_offset].abs().sum()) > 0  # A drawn, B zero
    g = torch.Generator().manual_seed(2)
    critic.ad.flat.copy_(torch.randn(critic.ad.flat.shape, generator=g) * 0.1)  # B too: the adapter matters
    pm = peft_twin(hf, critic.ad, tmp_path / "critic_adapter")
    lens = [7, 11, 5]
    tokens = torch.randint(0, 333, (sum(lens),), generator=g)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    dv = torch.randn(sum(lens), generator=g)
    w = critic.head_w.detach().clone().requires_grad_(True)
    b = critic.head_b.detach().clone().requires_grad_(True)
    vs = []
    for i in range(len(lens)):
        ids = tokens[cu[i] : cu[i + 1]][None]
        h = pm.base_model.model.model(input_ids=ids).last_hidden_state[0]
        vs.append(torch.cat([torch.zeros(1), h[:-1] @ w + b]))
    v_ref = torch.cat(vs)
    (v_ref * dv).sum().backward()
    want = peft_grads(pm)
    for ckpt in (True, False):
        critic.gradient_checkpointing = ckpt
        critic.zero_grad()
        v = critic.forward(tokens, cu)
        critic.backward(dv)
        assert rel_err(v, v_ref.detach()) < 1e-5, ckpt
        assert rel_err(critic.dhead_w, w.grad) < 1e-5 and rel_err(critic.dhead_b, b.grad) < 1e-5, ckpt
        got = adapter_grads(critic.ad)
        assert sorted(got) == sorted(want)
        for k, (dA, dB) in want.items():
            assert rel_err(got[k][0], dA) < 1e-4 and rel_err(got[k][1], dB) < 1e-4, (ckpt, k)
        assert critic.ad.grad_flat.data_ptr() == critic.grad_flat.data_ptr()  # the optimizer's one buffer
    assert torch.equal(policy.flat, base0) and policy.grad_flat is None and critic.trunk.grad_flat is None
    assert pol_ad.grad_flat is None  # the policy's adapters untouched
    critic.release_grads()
    assert critic.grad_flat is None and critic.ad.grad_flat is None
