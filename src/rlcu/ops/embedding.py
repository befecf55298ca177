"""Token embedding lookup; the backward scatter-adds rows into the (flat) gradient buffer.

Forward: x[i] = W[ids[i]], a row gather. Backward: dW[ids[i]] += dx[i]. A token id can repeat
within a batch, so the kernel adds with fp32 atomics (relaxed order: only the sum matters);
the Triton backward therefore needs an fp32 dW (the flat gradient buffer is fp32), and
repeated ids make the last bits of dW depend on the order the adds land in.

Backward traffic: dx once (N * D bf16), and each touched row of dW read and written in fp32
by the L2's atomic units (2 * U * D * 4 bytes for U distinct ids): 309 MB at [32768, 1024]
into [151936, 1024]. With per-thread 16-byte atomics (red.global.add.v4.f32, what
tl.atomic_add emits) the kernel reached 65% of copy bandwidth, the same as torch.compile's
atomic scatter, with the SM side nearly idle (fire-and-forget reds, full occupancy, ~15 us of
issue for 112 us): the likely limit is the rate at which the L2 slices take 16-byte
reductions (8.4 M of them). On Hopper the backward therefore hands each row to the TMA unit
instead: one bulk tensor reduction (cp.reduce.async.bulk.tensor, `desc.atomic_add`) of the
whole fp32 row (a [1, D/256, 256] box of dW seen as [V, D/256, 256]), which reaches L2 as
128-byte lines instead of 16-byte pieces. Expected if that is the limit: HBM-bound, ~80% of
copy (0.112 -> ~0.09 ms); `CONFIGS["bwd_tma"] = False` restores the per-thread atomics, and
bench/kernel_suites/elementwise.py times both, so one run on the GPU decides. The
interpreter, pre-Hopper GPUs and rows whose width or alignment TMA cannot take (D % 256, a
16-byte aligned dW and row stride) use the atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlcu.ops._backend import interpreting, use_triton

_TILE = 4096  # elements a program handles: BN rows of BD columns
_MAX_BD = 1024
_INTS = (torch.int32, torch.int64)
_TMA_BD = 256  # columns of a TMA box row (a box dimension holds at most 256 elements)
CONFIGS = {"bwd_tma": True, "bwd_tma_rows": 4}  # TMA backward; token rows a program
_SM90: dict = {}  # device index -> compute capability >= 9


@triton.jit
def _embedding_fwd_kernel(IDS, W, X, N, D, stride_w, stride_x, BN: tl.constexpr, BD: tl.constexpr):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_d * BD + tl.arange(0, BD)
    rmask = rows < N
    mask = rmask[:, None] & (cols < D)[None, :]
    ids = tl.load(IDS + rows, mask=rmask, other=0).to(tl.int64)  # [BN]
    x = tl.load(W + ids[:, None] * stride_w + cols[None, :], mask=mask, other=0.0)
    tl.store(X + rows[:, None] * stride_x + cols[None, :], x, mask=mask)


@triton.jit
def _embedding_bwd_kernel(DX, IDS, DW, N, D, stride_dx, stride_dw, BN: tl.constexpr, BD: tl.constexpr):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_d * BD + tl.arange(0, BD)
    rmask = rows < N
    mask = rmask[:, None] & (cols < D)[None, :]
    ids = tl.load(IDS + rows, mask=rmask, other=0).to(tl.int64)
    dx = tl.load(DX + rows[:, None] * stride_dx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(DW + ids[:, None] * stride_dw + cols[None, :], dx, mask=mask, sem="relaxed")


@triton.jit
def _embedding_bwd_tma_kernel(DX, IDS, DW_DESC, N, D, stride_dx, BR: tl.constexpr,
                              NB: tl.constexpr, BD: tl.constexpr):
    # dW seen as [V, D / BD, BD]: token i's row is one [1, NB, BD] box at (ids[i], 0, 0), the
    # boxes past D / BD are dropped by the TMA unit
    pid = tl.program_id(0).to(tl.int64)
    cols = (tl.arange(0, NB)[:, None] * BD + tl.arange(0, BD)[None, :])[None, :, :]  # [1, NB, BD]
    for r in range(BR):
        i = pid * BR + r
        if i < N:
            row = tl.load(IDS + i).to(tl.int32)
            dx = tl.load(DX + i * stride_dx + cols, mask=cols < D, other=0.0).to(tl.float32)
            DW_DESC.atomic_add([row, 0, 0], dx)


def _use_tma(dW: torch.Tensor) -> bool:
    D = dW.shape[1]
    if not (CONFIGS["bwd_tma"] and dW.is_cuda and not interpreting()):
        return False
    if D % _TMA_BD or dW.data_ptr() % 16 or (dW.stride(0) * dW.element_size()) % 16:
        return False
    idx = dW.device.index if dW.device.index is not None else torch.cuda.current_device()
    if idx not in _SM90:
        _SM90[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _SM90[idx]


def _grid(N: int, D: int):
    BD = min(triton.next_power_of_2(D), _MAX_BD)
    BN = max(1, _TILE // BD)
    num_warps = 4 if BN * BD <= 2048 else 8
    return (triton.cdiv(N, BN), triton.cdiv(D, BD)), BN, BD, num_warps


def _check(ids: torch.Tensor, M: torch.Tensor, name: str):
    if ids.dim() != 1 or ids.dtype not in _INTS:
        raise ValueError(f"embedding: ids must be a 1-D int32/int64 tensor, got {ids.dtype} "
                         f"{list(ids.shape)}")
    if M.dim() != 2:
        raise ValueError(f"embedding: {name} must be [V, D], got shape {list(M.shape)}")
    if M.stride(1) != 1:
        raise ValueError(f"embedding: {name} must have unit column stride, got strides {M.stride()}")
    if ids.device != M.device:
        raise ValueError(f"embedding: ids is on {ids.device}, {name} on {M.device}")


def embedding_fwd_triton(ids: torch.Tensor, W: torch.Tensor):
    _check(ids, W, "W")
    ids = ids.contiguous()
    N, D = ids.shape[0], W.shape[1]
    x = torch.empty(N, D, device=W.device, dtype=W.dtype)
    if x.numel() == 0:
        return x
    grid, BN, BD, num_warps = _grid(N, D)
    _embedding_fwd_kernel[grid](ids, W, x, N, D, W.stride(0), x.stride(0), BN=BN, BD=BD,
                                num_warps=num_warps)
    return x


def embedding_bwd_triton(dx: torch.Tensor, ids: torch.Tensor, dW: torch.Tensor):
    _check(ids, dW, "dW")
    if dW.dtype != torch.float32:
        raise TypeError(f"embedding: the Triton backward accumulates in fp32; dW is {dW.dtype}")
    N, D = ids.shape[0], dW.shape[1]
    if dx.shape != (N, D):
        raise ValueError(f"embedding: dx must have shape [{N}, {D}], got {list(dx.shape)}")
    if dx.device != dW.device:
        raise ValueError(f"embedding: dx is on {dx.device}, dW on {dW.device}")
    if dx.numel() == 0:
        return
    dx = dx if dx.stride(1) == 1 else dx.contiguous()
    ids = ids.contiguous()
    if _use_tma(dW):
        from triton.tools.tensor_descriptor import TensorDescriptor

        NB = D // _TMA_BD
        desc = TensorDescriptor(dW, [dW.shape[0], NB, _TMA_BD], [dW.stride(0), _TMA_BD, 1],
                                [1, triton.next_power_of_2(NB), _TMA_BD])
        BR = CONFIGS["bwd_tma_rows"]
        _embedding_bwd_tma_kernel[(triton.cdiv(N, BR),)](dx, ids, desc, N, D, dx.stride(0), BR=BR,
                                                          NB=triton.next_power_of_2(NB),
                                                          BD=_TMA_BD, num_warps=4)
        return
    grid, BN, BD, num_warps = _grid(N, D)
    _embedding_bwd_kernel[grid](dx, ids, dW, N, D, dx.stride(0), dW.stride(0), BN=BN, BD=BD,
                                num_warps=num_warps)


def embedding_fwd_ref(ids: torch.Tensor, W: torch.Tensor):
    return W.index_select(0, ids.long())


def embedding_bwd_ref(dx: torch.Tensor, ids: torch.Tensor, dW: torch.Tensor):
    dW.index_add_(0, ids.long(), dx.to(dW.dtype))


def embedding_fwd(ids: torch.Tensor, W: torch.Tensor):
    """ids: [N] int, W: [V, D] -> x [N, D]."""
    if use_triton(W):
        return embedding_fwd_triton(ids, W)
    return embedding_fwd_ref(ids, W)


def embedding_bwd(dx: torch.Tensor, ids: torch.Tensor, dW: torch.Tensor):
    """dW[ids[i]] += dx[i], in place. dx: [N, D], dW: [V, D]."""
    if use_triton(dW) and dW.dtype == torch.float32:
        embedding_bwd_triton(dx, ids, dW)
    else:
        embedding_bwd_ref(dx, ids, dW)
