"""PPO's critic: a scalar value head with a bias on the policy family's trunk (model/scalar_head.py,
the machinery it shares with the reward model), its flat buffers (weights, fp32 gradients) such
that FlatAdamW and checkpoints treat it like the policy.

Flat layout: [trunk (the policy's ParamLayout, the LM head unused) | value head w [H] | bias b].

Values are aligned with the policy's logprobs: for a token i that is not the first of its
sequence, v[i] = V(the prefix before token i) = w . rmsnorm(x[i-1]) + b, the value of the
state in which token i was chosen; v[i] = 0 at each sequence's first token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlcu.model.causal_lm import Qwen3
from rlcu.model.scalar_head import HeadLayout, ScalarHeadModel

HEAD_FILE = "value_head.safetensors"
CriticLayout = HeadLayout  # the name from before the reward model shared it


class Critic(ScalarHeadModel):
    bias = True
    name = "critic"

    @classmethod
    def from_trunk(cls, trunk: Qwen3, head_init_std: float = 0.0, seed: int = 0) -> Critic:
        """A critic whose trunk starts as a copy of `trunk`'s weights (nothing shared)."""
        layout = HeadLayout(trunk.cfg)
        flat = torch.zeros(layout.numel, device=trunk.device, dtype=trunk.dtype)
        flat[: layout.head_offset].copy_(trunk.flat)
        c = cls(trunk.cfg, flat)
        if head_init_std > 0:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            c.head_w.copy_(torch.randn(c.head_w.shape, generator=gen) * head_init_std)
        c.trunk.gradient_checkpointing = trunk.gradient_checkpointing
        return c

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, head_init_std: float = 0.0,
                        seed: int = 0) -> Critic:
        """The trunk from an HF folder; the head from its value_head.safetensors when present."""
        c = cls.from_trunk(Qwen3.from_pretrained(path, device=device, dtype=dtype), head_init_std, seed)
        f = Path(path) / HEAD_FILE
        if f.exists():
            t = load_file(str(f))
            c.head_w.copy_(t["v_head.weight"].view(-1))
            c.head_b.copy_(t["v_head.bias"].view(-1))
        return c

    def save_pretrained(self, path) -> None:
        """An HF folder of the trunk plus value_head.safetensors."""
        self.trunk.save_pretrained(path)
        save_file({"v_head.weight": self.head_w.detach().float().cpu().view(1, -1).clone(),
                   "v_head.bias": self.head_b.detach().float().cpu().clone()}, str(Path(path) / HEAD_FILE))

    # ---------------------------------------------------------------- forward / backward
    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, grad: bool = True) -> torch.Tensor:
        """tokens: [N], cu_seqlens: [S+1] int32 -> values [N] fp32 (0 at each sequence's first token)."""
        N = tokens.numel()
        tgt, rows = self.trunk.head_rows(tokens, cu_seqlens)
        v_r = self._head_fwd(tokens, cu_seqlens, rows, grad)
        if grad:
            self._ctx["tgt"] = tgt
        return torch.zeros(N, device=tokens.device, dtype=torch.float32).index_copy_(0, tgt, v_r)

    def backward(self, dv: torch.Tensor) -> None:
        """Accumulate d(sum(dv * v))/dθ into `grad_flat` for the v of the last forward."""
        if self._ctx is None:
            raise RuntimeError("Critic.backward() needs a preceding forward(..., grad=True)")
        N = self._ctx["N"]
        if dv.shape != (N,):
            raise ValueError(f"dv must have shape [{N}], got {list(dv.shape)}")
        self._head_bwd(dv.float().index_select(0, self._ctx["tgt"]))
