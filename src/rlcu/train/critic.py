"""PPO's critic: a scalar value head on a Qwen3 trunk, with its own flat buffers (weights,
fp32 gradients) so that FlatAdamW and checkpoints treat it like the policy.

Flat layout: [trunk (Qwen3's ParamLayout, the LM head unused) | value head w [H] | bias b].
The trunk is a Qwen3 whose flat buffer is a view of the critic's, so every trunk op (and
its gradient checkpointing) is the policy's own code: `Qwen3.hidden_forward` /
`Qwen3.hidden_backward`.

Values are aligned with the policy's logprobs: for a token i that is not the first of its
sequence, v[i] = V(the prefix before token i) = w . rmsnorm(x[i-1]) + b, the value of the
state in which token i was chosen; v[i] = 0 at each sequence's first token. Backward, for dv:
    dw = sum_i dv_i h_i,  db = sum_i dv_i,  dh_i = dv_i w,  then the trunk's backward from dh.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlcu.model.causal_lm import Qwen3
from rlcu.model.config import Qwen3Config
from rlcu.model.layout import ALIGN, ParamLayout

HEAD_FILE = "value_head.safetensors"


class CriticLayout:
    """The trunk's layout plus two slots for the head: `numel`, `trunk`, `head_offset`."""

    def __init__(self, cfg: Qwen3Config):
        self.cfg = cfg
        self.trunk = ParamLayout(cfg)
        self.head_offset = self.trunk.numel
        self.numel = self.head_offset + -(-(cfg.hidden_size + 1) // ALIGN) * ALIGN


class Critic:
    def __init__(self, cfg: Qwen3Config, flat: torch.Tensor):
        self.cfg = cfg
        self.layout = CriticLayout(cfg)
        if flat.numel() != self.layout.numel:
            raise ValueError(f"critic flat buffer has {flat.numel()} elements, layout needs {self.layout.numel}")
        self.flat = flat
        o, H = self.layout.head_offset, cfg.hidden_size
        self.trunk = Qwen3(cfg, flat[:o])
        self.head_w = flat[o : o + H]
        self.head_b = flat[o + H : o + H + 1]
        self.grad_flat: torch.Tensor | None = None
        self.grad_dtype = torch.float32  # bf16 halves the buffer (optim.grad_dtype)
        self._ctx: dict | None = None

    # ---------------------------------------------------------------- construction / I/O
    @property
    def device(self) -> torch.device:
        return self.flat.device

    @property
    def gradient_checkpointing(self):
        return self.trunk.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on) -> None:
        self.trunk.gradient_checkpointing = on

    @classmethod
    def from_trunk(cls, trunk: Qwen3, head_init_std: float = 0.0, seed: int = 0) -> Critic:
        """A critic whose trunk starts as a copy of `trunk`'s weights (nothing shared)."""
        layout = CriticLayout(trunk.cfg)
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

    def state_dict(self) -> dict:
        return {"flat": self.flat.detach().cpu().clone()}

    def load_state_dict(self, d: dict) -> None:
        if d["flat"].shape != self.flat.shape:
            raise ValueError(f"critic state has {d['flat'].numel()} elements, this critic {self.flat.numel()}")
        self.flat.copy_(d["flat"])

    # ---------------------------------------------------------------- gradients
    def _ensure_grads(self) -> None:
        if self.grad_flat is None:
            self.grad_flat = torch.zeros(self.layout.numel, device=self.device, dtype=self.grad_dtype)
            o, H = self.layout.head_offset, self.cfg.hidden_size
            t = self.trunk
            t.grad_flat = self.grad_flat[:o]
            t._g = t.layout.views(t.grad_flat)
            t.grads = t.layout.hf_views(t.grad_flat)
            self.dhead_w = self.grad_flat[o : o + H]
            self.dhead_b = self.grad_flat[o + H : o + H + 1]

    def zero_grad(self) -> None:
        self._ensure_grads()
        self.grad_flat.zero_()

    def release_grads(self) -> None:
        """Free the gradient buffer (the trunk's is a view of it); the next zero_grad or
        backward allocates a zeroed one."""
        self.grad_flat = self.dhead_w = self.dhead_b = None
        self.trunk.release_grads()

    # ---------------------------------------------------------------- forward / backward
    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, grad: bool = True) -> torch.Tensor:
        """tokens: [N], cu_seqlens: [S+1] int32 -> values [N] fp32 (0 at each sequence's first token)."""
        h = self.trunk.hidden_forward(tokens, cu_seqlens, grad=grad)  # [N, H], final-normed
        N = tokens.numel()
        tgt, rows = self.trunk.head_rows(tokens, cu_seqlens)
        hs = h.index_select(0, rows).float()  # [n, H]
        v_r = hs @ self.head_w.float() + self.head_b.float()
        v = torch.zeros(N, device=tokens.device, dtype=torch.float32).index_copy_(0, tgt, v_r)
        self._ctx = dict(N=N, hs=hs, rows=rows, tgt=tgt, dtype=h.dtype) if grad else None
        return v

    def backward(self, dv: torch.Tensor) -> None:
        """Accumulate d(sum(dv * v))/dθ into `grad_flat` for the v of the last forward."""
        if self._ctx is None:
            raise RuntimeError("Critic.backward() needs a preceding forward(..., grad=True)")
        s, self._ctx = self._ctx, None
        N = s["N"]
        if dv.shape != (N,):
            raise ValueError(f"dv must have shape [{N}], got {list(dv.shape)}")
        self._ensure_grads()
        dv_r = dv.float().index_select(0, s["tgt"])  # [n]
        self.dhead_w += dv_r @ s["hs"]
        self.dhead_b += dv_r.sum()
        dhs = dv_r[:, None] * self.head_w.float()[None, :]
        dh = torch.zeros(N, self.cfg.hidden_size, device=dv.device, dtype=s["dtype"])
        dh.index_copy_(0, s["rows"], dhs.to(dh.dtype))
        self.trunk.hidden_backward(dh)
