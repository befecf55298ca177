"""Token embedding lookup; the backward scatter-adds rows into the (flat) gradient buffer.

Forward: x[i] = W[ids[i]], a row gather. Backward: dW[ids[i]] += dx[i]. A token id can repeat
within a batch, so the kernel adds with fp32 atomics (relaxed order: only the sum matters);
the Triton kernel therefore adds into an fp32 dW (a bf16 gradient buffer goes through an
fp32 scratch of its touched rows, see `embedding_bwd`), and repeated ids make the last bits
of dW depend on the order the adds land in.

Backward traffic: dx once (N * D bf16) and each touched row of dW read and written in fp32
(2 * U * D * 4 bytes for U distinct ids): 309 MB at [32768, 1024] into [151936, 1024], where
this kernel (16-byte red.global.add.v4.f32 a thread, fire-and-forget) runs at 65% of copy
bandwidth, as torch.compile's atomic scatter does. Handing each row to the TMA unit instead
(one bulk tensor reduction of the whole fp32 row, cp.reduce.async.bulk.tensor) measured the
same on the H200 (0.1125 vs 0.1116 ms), so the limit is not the atomic requests but the
memory system on a random read-modify-write of 4 KB rows (a random 2 KB bf16 row gather,
the forward, reaches 79%); it was not kept.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton

_TILE = 4096  # elements a program handles: BN rows of BD columns
_MAX_BD = 1024
_INTS = (torch.int32, torch.int64)


@triton.jit(do_not_specialize=["N"])
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


@triton.jit(do_not_specialize=["N"])
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
    grid, BN, BD, num_warps = _grid(N, D)
    _embedding_bwd_kernel[grid](dx, ids, dW, N, D, dx.stride(0), dW.stride(0), BN=BN, BD=BD,
                                num_warps=num_warps)


def embedding_fwd_ref(ids: torch.Tensor, W: torch.Tensor):
    return W.index_select(0, ids.long())


def embedding_bwd_ref(dx: torch.Tensor, ids: torch.Tensor, dW: torch.Tensor):
    dW.index_add_(0, ids.long(), dx.to(dW.dtype))


@dispatch(embedding_fwd_triton, embedding_fwd_ref, on="W")
def embedding_fwd(ids: torch.Tensor, W: torch.Tensor):
    """ids: [N] int, W: [V, D] -> x [N, D]."""


@dispatch(embedding_bwd_triton, embedding_bwd_ref, on="dW")
def _embedding_bwd_fp32(dx: torch.Tensor, ids: torch.Tensor, dW: torch.Tensor):
    """dW (fp32) [ids[i]] += dx[i], in place."""


def embedding_bwd(dx: torch.Tensor, ids: torch.Tensor, dW: torch.Tensor):
    """dW[ids[i]] += dx[i], in place. dx: [N, D], dW: [V, D].

    A low-precision dW (a bf16 gradient buffer) is not added to row by row: the rows of each
    distinct id are summed in fp32 first (a [U, D] scratch for U distinct ids), then each
    touched row of dW gets its sum with one rounding, so a frequent token's gradient does not
    lose the bits of many bf16 additions."""
    if dW.dtype == torch.float32:
        _embedding_bwd_fp32(dx, ids, dW)
        return
    _check(ids, dW, "dW")
    uniq, inv = torch.unique(ids, return_inverse=True)
    acc = torch.zeros(uniq.numel(), dW.shape[1], device=dW.device, dtype=torch.float32)
    _embedding_bwd_fp32(dx, inv, acc)
    dW.index_copy_(0, uniq, (dW.index_select(0, uniq).float() + acc).to(dW.dtype))
