"""Token embedding lookup; the backward scatter-adds rows into the (flat) gradient buffer.

Forward: x[i] = W[ids[i]], a row gather. Backward: dW[ids[i]] += dx[i]. A token id can repeat
within a batch, and atomics would make the last bits of dW depend on the order their adds land
in -- between two runs of the same step (a CUDA-graph replay against the same step run op by
op, train/step_graph.py, or any two runs): with a tied LM head dW already holds the head's
gradient, so even two rows of one id, (dW + a) + b against (dW + b) + a, round differently.
So the backward is deterministic, with no atomics: the ids are sorted (stably: rows of one id
keep their order), and in sorted order one program per tile of BN rows (x BD columns) sums each
run of equal ids by a segmented scan (a fixed tree). A run wholly inside a tile and not at its
ends belongs to that tile alone, which adds it to its dW row (the only writer); the first and
last run of each tile may go on in the neighbouring tiles, so their partial sums go to a
scratch of 2 rows a tile, itself sorted by id, which the same kernel reduces again (BN / 2
times fewer rows each round) until one tile holds them all and writes every run. Each dW row
thus gets one add, dW + (a fixed tree of its rows), whatever the schedule. A bf16 dW goes
through an fp32 scratch of its touched rows (see `embedding_bwd`).

Backward traffic: dx once (N * D bf16, gathered in sorted order), each touched row of dW read
and written once in fp32, plus the sort of the N ids and 2 / BN of dx's rows in fp32 for the
next round (3 rounds at N = 32768). An earlier version added with fp32 atomics (16-byte
red.global.add.v4.f32 a thread); it was replaced for the determinism (bench/kernel_bench.py
measures the kernel).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton

_TILE = 4096  # elements a program handles: BN rows of BD columns
_MAX_BD = 1024
_BWD_BN = 64  # rows of a backward tile (sorted order): each round leaves 2 / 64 of them
_BWD_BD = 64  # its columns
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


@triton.jit
def _seg_add(av, af, bv, bf):
    # segmented sum: a flag marks the first row of a run, where the running sum restarts
    return tl.where(bf != 0, bv, av + bv), af | bf


@triton.jit(do_not_specialize=["N"])
def _embedding_bwd_kernel(X, ORDER, SID, DW, B, BID, N, V, D, stride_x, stride_dw, GATHER: tl.constexpr,
                          FINAL: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    # rows in sorted order: row i is X[ORDER[i]] (GATHER) or X[i], its id SID[i] (V: a padding row
    # of the scratch, never written); B [2 * tiles, D] fp32 / BID [2 * tiles]: this tile's first
    # and last run, for the next round (unless FINAL, the one tile, which writes every run)
    pid_n = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    t0 = pid_n * BN
    rows = t0 + tl.arange(0, BN)
    cols = pid_d * BD + tl.arange(0, BD)
    rmask = rows < N
    cmask = cols < D
    sid = tl.load(SID + rows, mask=rmask, other=V).to(tl.int64)
    prev = tl.load(SID + rows - 1, mask=rmask & (rows > t0), other=-1).to(tl.int64)
    nxt = tl.load(SID + rows + 1, mask=(rows + 1 < N) & (rows + 1 < t0 + BN), other=-1).to(tl.int64)
    src = tl.load(ORDER + rows, mask=rmask, other=0).to(tl.int64) if GATHER else rows
    x = tl.load(X + src[:, None] * stride_x + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    start = tl.broadcast_to(((rows == t0) | (sid != prev)).to(tl.int32)[:, None], (BN, BD))
    s, _ = tl.associative_scan((x, start), 0, _seg_add)  # at a run's last row: the run's sum here
    end = (sid != nxt) & (sid < V)  # the last row of a run (in this tile), a real id
    if FINAL:
        own = end
    else:
        id0 = tl.load(SID + t0).to(tl.int64)
        idl = tl.load(SID + t0 + BN - 1, mask=t0 + BN - 1 < N, other=V).to(tl.int64)
        first, last = sid == id0, sid == idl
        own = end & ~first & ~last
        b = B + (2 * pid_n) * D + cols[None, :]
        tl.store(b + 0 * rows[:, None], s, mask=(end & first)[:, None] & cmask[None, :])
        tl.store(b + D + 0 * rows[:, None], s, mask=(end & last & ~first)[:, None] & cmask[None, :])
        if pid_d == 0:
            tl.store(BID + 2 * pid_n, id0)
            tl.store(BID + 2 * pid_n + 1, idl)
    dw = DW + sid[:, None] * stride_dw + cols[None, :]
    m = own[:, None] & cmask[None, :]
    tl.store(dw, tl.load(dw, mask=m, other=0.0) + s, mask=m)


def _grid(N: int, D: int):
    BD = min(triton.next_power_of_2(D), _MAX_BD)
    BN = max(1, _TILE // BD)
    num_warps = 4 if BN * BD <= 2048 else 8
    return (triton.cdiv(N, BN), triton.cdiv(D, BD)), BN, BD, num_warps


def _bwd_tiles(D: int):
    BD = min(triton.next_power_of_2(D), _BWD_BD)
    return _BWD_BN, BD


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
    sid, order = torch.sort(ids.contiguous(), stable=True)  # no host sync: capturable
    V = dW.shape[0]
    BN, BD = _bwd_tiles(D)
    x, n, stride, gather = dx, N, dx.stride(0), True
    while True:
        tiles, final = triton.cdiv(n, BN), n <= BN
        b = sid if final else torch.zeros(2 * tiles, D, device=dW.device, dtype=torch.float32)
        bid = sid if final else torch.empty(2 * tiles, device=dW.device, dtype=sid.dtype)
        _embedding_bwd_kernel[(tiles, triton.cdiv(D, BD))](x, order, sid, dW, b, bid, n, V, D, stride, dW.stride(0),
                                                           GATHER=gather, FINAL=final, BN=BN, BD=BD, num_warps=4)
        if final:
            return
        x, sid, n, stride, gather = b, bid, 2 * tiles, D, False


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
