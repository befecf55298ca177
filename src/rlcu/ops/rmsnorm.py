"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, over the last dimension.

Used for the hidden-state norms ([T, D]) and for Qwen3's per-head q/k norms ([T*H, D]).
Statistics are fp32 whatever the input dtype; `rstd` is saved for the backward.

Backward, with xhat = x * rstd and g = dy * w:
    dx = rstd * (g - xhat * mean(g * xhat))
    dw = sum_rows(dy * xhat)
"""

from __future__ import annotations

import torch


def rmsnorm_fwd_ref(x: torch.Tensor, w: torch.Tensor, eps: float):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)  # [N]
    y = (xf * rstd[:, None]).to(x.dtype) * w
    return y.to(x.dtype), rstd


def rmsnorm_bwd_ref(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor):
    xhat = x.float() * rstd[:, None]
    g = dy.float() * w.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).sum(0)
    return dx.to(x.dtype), dw


def rmsnorm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float):
    """x: [N, D], w: [D] -> (y [N, D] in x.dtype, rstd [N] fp32)."""
    return rmsnorm_fwd_ref(x, w, eps)


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor):
    """dy, x: [N, D], w: [D], rstd: [N] -> (dx [N, D] in x.dtype, dw [D] fp32)."""
    return rmsnorm_bwd_ref(dy, x, w, rstd)
