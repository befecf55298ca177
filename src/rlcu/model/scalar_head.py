"""A scalar head on a causal-LM trunk, in one flat buffer: what PPO's critic (train/critic.py) and
the reward model (model/reward_model.py) share. They differ only in which hidden rows the head
reads (the critic: every token's previous row; the reward model: each sequence's last row) and
whether the head has a bias (the critic's value head does, HF's `score` does not).

Flat layout: [trunk (ParamLayout of `cfg`) | head w [H] | bias b], so FlatAdamW and checkpoints
treat it as a policy. The trunk is a CausalLM whose flat buffer (and, in training, gradient buffer)
is a view of this one, so every trunk op and its gradient checkpointing is the policy's own code
(`hidden_forward` / `hidden_backward`). With LoRA adapters on the trunk (`trunk.lora`), the trunk's
gradient goes to the adapters and `grad_flat` holds the head's slots alone.

For the rows r read and an upstream gradient dv on their scores v_r = w . h_r + b:
    dw = sum_r dv_r h_r,  db = sum_r dv_r (bias only),  dh_r = dv_r w,  then the trunk's backward.
"""

from __future__ import annotations

import torch

from rlcu.model.causal_lm import CausalLM
from rlcu.model.config import CausalLMConfig
from rlcu.model.layout import ALIGN, ParamLayout


class HeadLayout:
    """The trunk's layout plus two slots for the head: `numel`, `trunk`, `head_offset`."""

    def __init__(self, cfg: CausalLMConfig):
        self.cfg = cfg
        self.trunk = ParamLayout(cfg)
        self.head_offset = self.trunk.numel
        self.numel = self.head_offset + -(-(cfg.hidden_size + 1) // ALIGN) * ALIGN


class ScalarHeadModel:
    """Trunk + scalar head over one flat buffer; subclasses choose the rows (`_head_fwd`'s)."""

    bias = True  # the head's bias is trained (False: it stays 0)
    name = "scalar-head model"

    def __init__(self, cfg: CausalLMConfig, flat: torch.Tensor):
        self.cfg = cfg
        self.layout = HeadLayout(cfg)
        if flat.numel() != self.layout.numel:
            raise ValueError(f"{self.name} flat buffer has {flat.numel()} elements, layout needs {self.layout.numel}")
        self.flat = flat
        o, H = self.layout.head_offset, cfg.hidden_size
        self.trunk = CausalLM(cfg, flat[:o])
        self.head_w = flat[o : o + H]
        self.head_b = flat[o + H : o + H + 1]
        self.grad_flat: torch.Tensor | None = None
        self.dhead_w = self.dhead_b = None
        self.grad_dtype = torch.float32  # bf16 halves the buffer (optim.grad_dtype)
        self._ctx: dict | None = None

    # ---------------------------------------------------------------- construction / state
    @property
    def device(self) -> torch.device:
        return self.flat.device

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def gradient_checkpointing(self):
        return self.trunk.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on) -> None:
        self.trunk.gradient_checkpointing = on

    @classmethod
    def _with_trunk(cls, cfg: CausalLMConfig, params: dict[str, torch.Tensor], device, dtype,
                    head_init_std: float, seed: int):
        """A model of `cfg` whose trunk is a copy of `params` (HF name -> tensor; names the layout
        lacks, an unused LM head, ignored) and whose head is N(0, head_init_std) from `seed`."""
        flat = torch.zeros(HeadLayout(cfg).numel, device=device, dtype=dtype)
        m = cls(cfg, flat)
        for name, v in m.trunk.params.items():
            v.copy_(params[name])
        if head_init_std > 0:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            m.head_w.copy_(torch.randn(m.head_w.shape, generator=gen) * head_init_std)
        return m

    def state_dict(self) -> dict:
        return {"flat": self.flat.detach().cpu().clone()}

    def load_state_dict(self, d: dict) -> None:
        if d["flat"].shape != self.flat.shape:
            raise ValueError(f"{self.name} state has {d['flat'].numel()} elements, this one {self.flat.numel()}")
        self.flat.copy_(d["flat"])

    # ---------------------------------------------------------------- gradients
    def _ensure_grads(self) -> None:
        """`grad_flat`: the whole layout's gradient, or with adapters on the trunk (whose gradient is
        theirs) the head's slots alone, [numel - head_offset]."""
        if self.grad_flat is None:
            o, H, t = self.layout.head_offset, self.cfg.hidden_size, self.trunk
            if t.lora is None:
                self.grad_flat = torch.zeros(self.layout.numel, device=self.device, dtype=self.grad_dtype)
                t.grad_flat = self.grad_flat[:o]
                t._g = t.layout.views(t.grad_flat)
                t.grads = t.layout.hf_views(t.grad_flat)
                head = self.grad_flat[o:]
            else:
                head = self.grad_flat = torch.zeros(self.layout.numel - o, device=self.device, dtype=self.grad_dtype)
            self.dhead_w = head[:H]
            self.dhead_b = head[H : H + 1]

    def zero_grad(self) -> None:
        self._ensure_grads()
        self.grad_flat.zero_()
        if self.trunk.lora is not None:
            self.trunk.lora.zero_grad()

    def release_grads(self) -> None:
        """Free the gradient buffer (the trunk's is a view of it); the next zero_grad or
        backward allocates a zeroed one."""
        self.grad_flat = self.dhead_w = self.dhead_b = None
        self.trunk.release_grads()

    # ---------------------------------------------------------------- the head
    def _head_fwd(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, rows: torch.Tensor, grad: bool
                  ) -> torch.Tensor:
        """The trunk over the packed batch, then the head at `rows` -> fp32 scores [R]."""
        h = self.trunk.hidden_forward(tokens, cu_seqlens, grad=grad)  # [N, H], final-normed
        hs = h.index_select(0, rows).float()  # [R, H]
        v = hs @ self.head_w.float()
        if self.bias:
            v = v + self.head_b.float()
        self._ctx = dict(N=tokens.numel(), hs=hs, rows=rows, dtype=h.dtype) if grad else None
        return v

    def _head_bwd(self, dv_r: torch.Tensor) -> None:
        """Accumulate the gradient of sum(dv_r * v_r) for the scores of the last `_head_fwd`."""
        if self._ctx is None:
            raise RuntimeError(f"{type(self).__name__}.backward() needs a preceding forward(..., grad=True)")
        s, self._ctx = self._ctx, None
        self._ensure_grads()
        dv_r = dv_r.float()
        self.dhead_w += dv_r @ s["hs"]
        if self.bias:
            self.dhead_b += dv_r.sum()
        dhs = dv_r[:, None] * self.head_w.float()[None, :]
        dh = torch.zeros(s["N"], self.cfg.hidden_size, device=dv_r.device, dtype=s["dtype"])
        dh.index_copy_(0, s["rows"], dhs.to(dh.dtype))
        self.trunk.hidden_backward(dh)
