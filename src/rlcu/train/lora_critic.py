"""PPO's critic with LoRA: a value head on the policy's own frozen base plus an adapter of its own.

With `lora:` set, the policy trains adapters over a frozen base; a full critic (train/critic.py)
would copy that base and train it whole, doubling the weights and adding a full optimizer state,
which is what LoRA is for avoiding. `LoraCritic` instead runs its trunk over the SAME base buffer
(a `Qwen3` view of the policy's flat buffer, no copy) with an adapter set of its own attached,
and trains that adapter and the value head:

    flat = [the critic's adapters (LoraLayout) | value head w [H] | bias b]    (the optimizer's)

The adapter follows the run's `lora:` section (r, alpha, rslora, target_modules, dropout, init;
a `lora.path` policy's adapter config) with its A drawn from seed lora.seed + 1, so it is not the
policy's; B starts at zero, so the critic's trunk starts as the base (as a full critic starts as
a copy of the policy). Forward and backward are Critic's (the trunk's hidden_forward /
hidden_backward, which with an adapter attached accumulate dA and dB into the adapter's gradient:
here a view of the critic's `grad_flat`), so FlatAdamW, checkpoints (`state_dict`: the adapters
and the head only) and the release of gradients between steps treat it as any critic.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlcu.model.causal_lm import Qwen3
from rlcu.model.layout import ALIGN
from rlcu.model.lora import LoraAdapters, LoraConfig, LoraLayout
from rlcu.model.lora_peft import save_adapter
from rlcu.train.critic import HEAD_FILE, Critic


class LoraCriticLayout:
    """The critic's adapters, then two slots for the head: `numel`, `adapters`, `head_offset`."""

    def __init__(self, model_cfg, lora_cfg: LoraConfig):
        self.adapters = LoraLayout(model_cfg, lora_cfg)
        self.head_offset = self.adapters.numel
        self.numel = self.head_offset + -(-(model_cfg.hidden_size + 1) // ALIGN) * ALIGN


class LoraCritic(Critic):
    """A critic over `base` (the policy's Qwen3: its flat buffer is read, never written or copied)
    with adapters of `lora_cfg`; see the module docstring."""

    def __init__(self, base: Qwen3, lora_cfg: LoraConfig, head_init_std: float = 0.0, seed: int = 0):
        self.cfg = base.cfg
        self.layout = LoraCriticLayout(base.cfg, lora_cfg)
        o, H = self.layout.head_offset, base.cfg.hidden_size
        fresh = LoraAdapters.create(base.cfg, lora_cfg, base.device, base.dtype)
        self.flat = torch.zeros(self.layout.numel, device=base.device, dtype=base.dtype)
        self.flat[:o].copy_(fresh.flat)
        self.trunk = Qwen3(base.cfg, base.flat, base.exact)
        self.trunk.gradient_checkpointing = base.gradient_checkpointing
        self.ad = LoraAdapters(base.cfg, lora_cfg, self.flat[:o]).attach(self.trunk)
        self.head_w = self.flat[o : o + H]
        self.head_b = self.flat[o + H : o + H + 1]
        if head_init_std > 0:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            self.head_w.copy_(torch.randn(self.head_w.shape, generator=gen) * head_init_std)
        self.grad_flat: torch.Tensor | None = None
        self.grad_dtype = torch.float32
        self._ctx: dict | None = None

    @classmethod
    def for_policy(cls, policy: Qwen3, head_init_std: float = 0.0, seed: int = 0) -> LoraCritic:
        """The critic of a LoRA policy (adapters attached): its adapter config with seed + 1."""
        if policy.lora is None:
            raise ValueError("a LoRA critic needs a policy with adapters attached (lora: set)")
        cfg = dataclasses.replace(policy.lora.cfg, seed=policy.lora.cfg.seed + 1)
        return cls(policy, cfg, head_init_std, seed)

    # ---------------------------------------------------------------- gradients
    def _ensure_grads(self) -> None:
        if self.grad_flat is None:
            self.grad_flat = torch.zeros(self.layout.numel, device=self.device, dtype=self.grad_dtype)
            o, H = self.layout.head_offset, self.cfg.hidden_size
            self.ad.grad_flat = self.grad_flat[:o]  # where the trunk's backward accumulates dA, dB
            self.ad.g = self.ad.layout.views(self.ad.grad_flat)
            self.dhead_w = self.grad_flat[o : o + H]
            self.dhead_b = self.grad_flat[o + H : o + H + 1]

    def release_grads(self) -> None:
        self.grad_flat = self.dhead_w = self.dhead_b = None
        self.ad.release_grads()

    # ---------------------------------------------------------------- I/O
    @classmethod
    def from_trunk(cls, trunk, head_init_std: float = 0.0, seed: int = 0):
        raise TypeError("a LoRA critic is made over its policy's base: LoraCritic.for_policy(policy)")

    def save_pretrained(self, path) -> None:
        """A PEFT adapter folder of the critic's adapters (over the policy's base) plus
        value_head.safetensors; the base is not written."""
        path = Path(path)
        save_adapter(self.ad, path)
        save_file({"v_head.weight": self.head_w.detach().float().cpu().view(1, -1).clone(),
                   "v_head.bias": self.head_b.detach().float().cpu().clone()}, str(path / HEAD_FILE))
