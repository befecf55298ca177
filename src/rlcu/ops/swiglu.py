"""SwiGLU on the fused gate_up projection: a = silu(g) * u, with [g | u] = gu.

With s = sigmoid(g):  d silu(g)/dg = s * (1 + g * (1 - s)), so
    dg = da * u * s * (1 + g (1 - s)),   du = da * g * s.
"""

from __future__ import annotations

import torch


def swiglu_fwd_ref(gu: torch.Tensor):
    I = gu.shape[-1] // 2
    g, u = gu[:, :I].float(), gu[:, I:].float()
    return (g * torch.sigmoid(g) * u).to(gu.dtype)


def swiglu_bwd_ref(da: torch.Tensor, gu: torch.Tensor):
    I = gu.shape[-1] // 2
    g, u, da = gu[:, :I].float(), gu[:, I:].float(), da.float()
    s = torch.sigmoid(g)
    dg = da * u * s * (1 + g * (1 - s))
    du = da * g * s
    return torch.cat([dg, du], -1).to(gu.dtype)


def swiglu_fwd(gu: torch.Tensor):
    """gu: [N, 2I] -> a [N, I]."""
    return swiglu_fwd_ref(gu)


def swiglu_bwd(da: torch.Tensor, gu: torch.Tensor):
    """da: [N, I], gu: [N, 2I] -> dgu [N, 2I]."""
    return swiglu_bwd_ref(da, gu)
