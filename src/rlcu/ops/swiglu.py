"""SwiGLU on the fused gate_up projection: a = silu(g) * u, with [g | u] = gu.

With s = sigmoid(g):  d silu(g)/dg = s * (1 + g * (1 - s)), so
    dg = da * u * s * (1 + g (1 - s)),   du = da * g * s.

Both kernels are one pass over [BN, BI] tiles, math in fp32; the backward writes dg and du
straight into the two halves of dgu, which is what the gate_up weight gradient reads.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton

_TILE = 4096  # elements of `a` a program handles: BN rows of BI columns
_MAX_BI = 1024
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["N"])
def _swiglu_fwd_kernel(GU, A, N, I, stride_gu, stride_a, BN: tl.constexpr, BI: tl.constexpr):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_i = tl.program_id(1).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_i * BI + tl.arange(0, BI)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    gu = GU + rows[:, None] * stride_gu + cols[None, :]  # [BN, BI] pointers into the gate half
    g = tl.load(gu, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + I, mask=mask, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    tl.store(A + rows[:, None] * stride_a + cols[None, :], a.to(A.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _swiglu_bwd_kernel(DA, GU, DGU, N, I, stride_da, stride_gu, stride_dgu,
                       BN: tl.constexpr, BI: tl.constexpr):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_i = tl.program_id(1).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_i * BI + tl.arange(0, BI)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    gu = GU + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gu, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + I, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(DA + rows[:, None] * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = da * u * s * (1 + g * (1 - s))
    du = da * g * s
    dgu = DGU + rows[:, None] * stride_dgu + cols[None, :]
    tl.store(dgu, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(dgu + I, du.to(DGU.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2:
        raise ValueError(f"swiglu: {name} must be 2-D, got shape {list(t.shape)}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"swiglu: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    return t if (t.stride(1) == 1 or t.shape[1] <= 1) else t.contiguous()


def _grid(N: int, I: int):
    BI = min(triton.next_power_of_2(I), _MAX_BI)
    BN = max(1, _TILE // BI)
    num_warps = 4 if BN * BI <= 2048 else 8
    return (triton.cdiv(N, BN), triton.cdiv(I, BI)), BN, BI, num_warps


def _check_gu(gu: torch.Tensor) -> int:
    if gu.shape[1] % 2:
        raise ValueError(f"swiglu: gu must be [N, 2I] (gate | up), got odd width {gu.shape[1]}")
    return gu.shape[1] // 2


def swiglu_fwd_triton(gu: torch.Tensor, exact: bool = False):  # one kernel in both modes (elementwise)
    gu = _rows(gu, "gu")
    N, I = gu.shape[0], _check_gu(gu)
    a = torch.empty(N, I, device=gu.device, dtype=gu.dtype)
    if a.numel() == 0:
        return a
    grid, BN, BI, num_warps = _grid(N, I)
    _swiglu_fwd_kernel[grid](gu, a, N, I, gu.stride(0), a.stride(0), BN=BN, BI=BI, num_warps=num_warps)
    return a


def swiglu_bwd_triton(da: torch.Tensor, gu: torch.Tensor):
    gu, da = _rows(gu, "gu"), _rows(da, "da")
    N, I = gu.shape[0], _check_gu(gu)
    if da.shape != (N, I):
        raise ValueError(f"swiglu: da must have shape [{N}, {I}], got {list(da.shape)}")
    if da.device != gu.device:
        raise ValueError(f"swiglu: da is on {da.device}, gu on {gu.device}")
    dgu = torch.empty(N, 2 * I, device=gu.device, dtype=gu.dtype)
    if dgu.numel() == 0:
        return dgu
    grid, BN, BI, num_warps = _grid(N, I)
    _swiglu_bwd_kernel[grid](da, gu, dgu, N, I, da.stride(0), gu.stride(0), dgu.stride(0),
                             BN=BN, BI=BI, num_warps=num_warps)
    return dgu


def swiglu_fwd_ref(gu: torch.Tensor, exact: bool = False):
    I = gu.shape[-1] // 2
    g, u = gu[:, :I].float(), gu[:, I:].float()
    if exact:  # torch's CPU sigmoid rounds a tail element other than a vector lane
        return (g / (1.0 + torch.exp(-g)) * u).to(gu.dtype)
    return (g * torch.sigmoid(g) * u).to(gu.dtype)


def swiglu_bwd_ref(da: torch.Tensor, gu: torch.Tensor):
    I = gu.shape[-1] // 2
    g, u, da = gu[:, :I].float(), gu[:, I:].float(), da.float()
    s = torch.sigmoid(g)
    dg = da * u * s * (1 + g * (1 - s))
    du = da * g * s
    return torch.cat([dg, du], -1).to(gu.dtype)


@dispatch(swiglu_fwd_triton, swiglu_fwd_ref, on="gu")
def swiglu_fwd(gu: torch.Tensor, exact: bool = False):
    """gu: [N, 2I] -> a [N, I]. exact: exact mode's twin (the kernel is the same in both modes)."""


@dispatch(swiglu_bwd_triton, swiglu_bwd_ref, on="gu")
def swiglu_bwd(da: torch.Tensor, gu: torch.Tensor):
    """da: [N, I], gu: [N, 2I] -> dgu [N, 2I]."""
