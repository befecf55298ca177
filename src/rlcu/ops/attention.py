"""Causal self-attention over packed variable-length sequences, with GQA (FlashAttention-2).

Tokens of all sequences are concatenated ([N, H, D]); `cu_seqlens` ([S+1] int32, starting
at 0) marks the boundaries and a token attends to the earlier tokens of its own sequence
only. Query head h reads KV head h // G, G = Hq / Hk. Rows past cu_seqlens[S] (a padded token
budget) belong to no sequence: their outputs and gradients are zero.

Forward, per query tile, streaming over key tiles with an online softmax in base 2
(log2(e) is folded into the scale, so exp2 is the only transcendental):
    s = q k^T * scale * log2(e),  m' = max(m, rowmax(s)),  l' = l 2^(m - m') + rowsum(2^(s - m'))
    acc' = acc 2^(m - m') + 2^(s - m') v,   o = acc / l,   lse = (m + log2 l) ln 2
The log-sum-exp (fp32, [Hq, N], natural log) is saved so the backward recomputes
P = exp(S - lse) instead of storing it. With delta = rowsum(dO * O):
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = dS K * scale,  dK = dS^T Q * scale
(dK, dV summed over the G query heads that share a KV head).

Kernels: the forward runs one program per (query tile, head, sequence); the backward runs
a row-sum kernel for delta, one program per (KV tile, KV head, sequence) that owns its dK, dV
and loops over the G query heads and every query tile at or below the diagonal, and one
program per (query tile, head, sequence) for dQ. No atomics: the backward is deterministic.
Tiles above the diagonal are never visited; only tiles that cross it are masked. The grid
covers max_seqlen, so shorter sequences' surplus programs exit at once; the heaviest tiles
(last query tiles, first KV tiles) are scheduled first.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, interpreting, tl, triton

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernels' copies
_LN2 = tl.constexpr(0.6931471805599453)

# (rows, cols, num_warps, num_stages) per kernel, keyed by the bytes of a row in bf16 units
# (the padded head dim BD; twice that for fp32), for sm_90 (H200). fwd and dq: (BM query rows,
# BN key rows per step); dkdv: (BN key rows, BM query rows per step). Chosen among the configs
# that compile for sm_90 within shared memory and without register spills (dkdv holds two
# [BN, BD] fp32 accumulators); `python bench/kernel_suites/attention.py --sweep` times them.
CONFIGS = {
    "fwd": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 64, 8, 2), 512: (64, 32, 4, 2)},
    "dkdv": {64: (128, 32, 8, 2), 128: (128, 32, 8, 2), 256: (64, 16, 8, 2), 512: (64, 16, 8, 1)},
    "dq": {64: (128, 64, 8, 2), 128: (128, 64, 8, 2), 256: (64, 32, 8, 2), 512: (64, 32, 8, 1)},
}
_INTERPRET_CONFIG = (32, 16, 4, 1)  # small tiles: several per sequence even at T=63
_BT_DELTA = 64  # rows per program of the delta kernel
MAX_D = 256


@triton.jit
def _zero_tail(X, stride_t, start, N, i_b, n_b, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    # rows [start, N) belong to no sequence: programs i_b of n_b zero them, BT rows at a time
    offs_d = tl.arange(0, BD)
    for t0 in range(start + i_b * BT, N, n_b * BT):
        offs_t = (t0 + tl.arange(0, BT)).to(tl.int64)
        mask = (offs_t[:, None] < N) & (offs_d[None, :] < D)
        tl.store(X + offs_t[:, None] * stride_t + offs_d[None, :],
                 tl.zeros([BT, BD], X.dtype.element_ty), mask=mask)


@triton.jit
def _attn_fwd_tiles(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_m, lo, hi, qk_scale,
                    D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    for start_n in range(lo, hi, BN):
        cols = start_n + offs_n
        # tiles left of the diagonal hold keys < start_m <= T: no row mask is needed there
        if CAUSAL_MASK:
            mask_n = cols < hi
            kt = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None],
                         mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BD, BN]
            v = tl.load(V + cols[:, None] * stride_vt + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BN, BD]
        else:
            kt = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None], mask=mask_d[:, None], other=0.0)
            v = tl.load(V + cols[:, None] * stride_vt + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        s = tl.dot(q, kt) * qk_scale  # [BM, BN], base-2 logits
        if CAUSAL_MASK:
            s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N", "S"])
def _attn_fwd_kernel(Q, K, V, O, LSE, CU, N, S, qk_scale,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                     G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    i_h = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    n_m = tl.num_programs(2)
    i_m = n_m - 1 - tl.program_id(2)  # the longest rows first
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    if i_s == S:  # the padding tail
        bos = tl.load(CU + S)
        _zero_tail(O + i_h * stride_oh, stride_ot, bos, N, i_m, n_m, D, BM, BD)
        for t0 in range(bos + i_m * BM, N, n_m * BM):
            offs_t = (t0 + tl.arange(0, BM)).to(tl.int64)
            tl.store(LSE + i_h * N + offs_t, tl.zeros([BM], tl.float32), mask=offs_t < N)
        return
    bos = tl.load(CU + i_s)
    T = tl.load(CU + i_s + 1) - bos
    start_m = i_m * BM
    if start_m >= T:
        return
    bos = bos.to(tl.int64)
    Q += bos * stride_qt + i_h * stride_qh
    K += bos * stride_kt + (i_h // G) * stride_kh
    V += bos * stride_vt + (i_h // G) * stride_vh
    O += bos * stride_ot + i_h * stride_oh
    offs_m = start_m + tl.arange(0, BM)
    mask_m = offs_m < T
    q = tl.load(Q + offs_m[:, None] * stride_qt + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    acc = tl.zeros([BM, BD], tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    # keys [0, start_m) are visible to every row of the tile; [start_m, start_m + BM) cross the
    # diagonal; keys past the tile are never visible
    acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_m, 0, start_m,
                                    qk_scale, D, BN, BD, False)
    acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_m, start_m,
                                    tl.minimum(start_m + BM, T), qk_scale, D, BN, BD, True)
    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * _LN2
    tl.store(O + offs_m[:, None] * stride_ot + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])
    tl.store(LSE + i_h * N + bos + offs_m, lse, mask=mask_m)


@triton.jit(do_not_specialize=["N"])
def _attn_bwd_delta_kernel(O, DO, DELTA, N, stride_ot, stride_oh, stride_dot, stride_doh,
                           D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    offs_t = i_t * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    mask = (offs_t[:, None] < N) & (offs_d[None, :] < D)
    o = tl.load(O + i_h * stride_oh + offs_t[:, None] * stride_ot + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + i_h * stride_doh + offs_t[:, None] * stride_dot + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BT]
    tl.store(DELTA + i_h * N + offs_t, delta, mask=offs_t < N)


@triton.jit
def _attn_bwd_dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_dot, offs_n, lo, hi, T,
                         qk_scale, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                         CAUSAL_MASK: tl.constexpr):
    # transposed tiles ([BN keys, BM queries]) so that dK, dV accumulate as [BN, BD]. Query
    # rows >= T load as zeros with lse = delta = 0: their P = 1 meets dO = 0 and Q = 0, so they
    # add nothing to dK and dV without a mask.
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    for start_m in range(lo, hi, BM):
        offs_m = start_m + tl.arange(0, BM)
        mask_m = offs_m < T
        qt = tl.load(Q + offs_m[None, :] * stride_qt + offs_d[:, None],
                     mask=mask_d[:, None] & mask_m[None, :], other=0.0)  # [BD, BM]
        do = tl.load(DO + offs_m[:, None] * stride_dot + offs_d[None, :],
                     mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BM, BD]
        lse = tl.load(LSE + offs_m, mask=mask_m, other=0.0) * _LOG2E
        delta = tl.load(DELTA + offs_m, mask=mask_m, other=0.0)
        pt = tl.exp2(tl.dot(k, qt) * qk_scale - lse[None, :])  # [BN, BM] = P^T
        if CAUSAL_MASK:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, tl.trans(do))  # [BN, BM] = dP^T
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk)
    return dk, dv


@triton.jit(do_not_specialize=["N", "S"])
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, N, S, qk_scale, scale,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                          G: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                          BD: tl.constexpr):
    i_hk = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    i_n = tl.program_id(2)  # the first keys, seen by the most queries, first
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    if i_s == S:  # the padding tail
        bos = tl.load(CU + S)
        _zero_tail(DK + i_hk * stride_dkh, stride_dkt, bos, N, i_n, tl.num_programs(2), D, BN, BD)
        _zero_tail(DV + i_hk * stride_dvh, stride_dvt, bos, N, i_n, tl.num_programs(2), D, BN, BD)
        return
    bos = tl.load(CU + i_s)
    T = tl.load(CU + i_s + 1) - bos
    start_n = i_n * BN
    if start_n >= T:
        return
    bos = bos.to(tl.int64)
    offs_n = start_n + tl.arange(0, BN)
    mask = (offs_n[:, None] < T) & mask_d[None, :]
    K += bos * stride_kt + i_hk * stride_kh
    V += bos * stride_vt + i_hk * stride_vh
    k = tl.load(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask=mask, other=0.0)  # [BN, BD]
    v = tl.load(V + offs_n[:, None] * stride_vt + offs_d[None, :], mask=mask, other=0.0)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BD], tl.float32)
    for g in range(G):
        i_h = i_hk * G + g
        Qh = Q + bos * stride_qt + i_h * stride_qh
        DOh = DO + bos * stride_dot + i_h * stride_doh
        LSEh = LSE + i_h * N + bos
        DELTAh = DELTA + i_h * N + bos
        # queries [start_n, start_n + BN) cross the diagonal; later ones see every key of the tile
        dk, dv = _attn_bwd_dkdv_tiles(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qt, stride_dot, offs_n,
                                      start_n, tl.minimum(start_n + BN, T), T, qk_scale, D, BM, BD, True)
        dk, dv = _attn_bwd_dkdv_tiles(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qt, stride_dot, offs_n,
                                      start_n + BN, T, T, qk_scale, D, BM, BD, False)
    DK += bos * stride_dkt + i_hk * stride_dkh
    DV += bos * stride_dvt + i_hk * stride_dvh
    tl.store(DK + offs_n[:, None] * stride_dkt + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + offs_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_dq_tiles(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_m, lo, hi, qk_scale,
                       D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    for start_n in range(lo, hi, BN):
        cols = start_n + offs_n
        if CAUSAL_MASK:
            mask_n = cols < hi
            kt = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None],
                         mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BD, BN]
            vt = tl.load(V + cols[None, :] * stride_vt + offs_d[:, None],
                         mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        else:
            kt = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None], mask=mask_d[:, None], other=0.0)
            vt = tl.load(V + cols[None, :] * stride_vt + offs_d[:, None], mask=mask_d[:, None], other=0.0)
        p = tl.exp2(tl.dot(q, kt) * qk_scale - lse[:, None])  # [BM, BN]
        if CAUSAL_MASK:
            p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
        dp = tl.dot(do, vt)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
    return dq


@triton.jit(do_not_specialize=["N", "S"])
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, N, S, qk_scale, scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_dot, stride_doh, stride_dqt, stride_dqh,
                        G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BD: tl.constexpr):
    i_h = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    n_m = tl.num_programs(2)
    i_m = n_m - 1 - tl.program_id(2)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    if i_s == S:  # the padding tail
        _zero_tail(DQ + i_h * stride_dqh, stride_dqt, tl.load(CU + S), N, i_m, n_m, D, BM, BD)
        return
    bos = tl.load(CU + i_s)
    T = tl.load(CU + i_s + 1) - bos
    start_m = i_m * BM
    if start_m >= T:
        return
    bos = bos.to(tl.int64)
    offs_m = start_m + tl.arange(0, BM)
    mask_m = offs_m < T
    mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + bos * stride_qt + i_h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=mask, other=0.0)
    do = tl.load(DO + bos * stride_dot + i_h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=mask, other=0.0)
    lse = tl.load(LSE + i_h * N + bos + offs_m, mask=mask_m, other=0.0) * _LOG2E
    delta = tl.load(DELTA + i_h * N + bos + offs_m, mask=mask_m, other=0.0)
    K += bos * stride_kt + (i_h // G) * stride_kh
    V += bos * stride_vt + (i_h // G) * stride_vh
    dq = tl.zeros([BM, BD], tl.float32)
    dq = _attn_bwd_dq_tiles(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_m, 0, start_m,
                            qk_scale, D, BN, BD, False)
    dq = _attn_bwd_dq_tiles(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_m, start_m,
                            tl.minimum(start_m + BM, T), qk_scale, D, BN, BD, True)
    tl.store(DQ + bos * stride_dqt + i_h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=mask)


def _config(kind: str, BD: int, dtype: torch.dtype):
    if interpreting():
        return _INTERPRET_CONFIG
    table = CONFIGS[kind]
    row = BD * dtype.itemsize // 2
    return table[min((d for d in table if d >= row), default=max(table))]


def _heads(t: torch.Tensor, name: str, N: int, D: int) -> torch.Tensor:
    """A [N, H, D] view with unit last stride (any token and head strides)."""
    if t.dim() != 3 or t.shape[0] != N or t.shape[2] != D:
        raise ValueError(f"attention: {name} must be [N={N}, H, D={D}], got {list(t.shape)}")
    return t if t.stride(2) == 1 else t.contiguous()


def _check(q, k, v, cu_seqlens):
    N, Hq, D = q.shape
    k, v = _heads(k, "k", N, D), _heads(v, "v", N, D)
    Hk = k.shape[1]
    if v.shape[1] != Hk:
        raise ValueError(f"attention: k has {Hk} heads, v has {v.shape[1]}")
    if Hq % Hk:
        raise ValueError(f"attention: query heads Hq={Hq} must be a multiple of KV heads Hk={Hk}")
    if not 0 < D <= MAX_D:
        raise ValueError(f"attention: head dim D={D} must be in [1, {MAX_D}]")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise ValueError(f"attention: cu_seqlens must be 1-D int32 on {q.device}, got "
                         f"{cu_seqlens.dtype} {list(cu_seqlens.shape)} on {cu_seqlens.device}")
    if not 2 <= cu_seqlens.numel() <= 65535:  # S + 1 programs along a grid dimension
        raise ValueError(f"attention: cu_seqlens has {cu_seqlens.numel()} entries; allowed 2 to 65535")
    return k, v, cu_seqlens.contiguous(), N, Hq, Hk, D


def attention_fwd_triton(q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    q = _heads(q, "q", q.shape[0], q.shape[-1])
    k, v, cu, N, Hq, Hk, D = _check(q, k, v, cu_seqlens)
    S = cu.numel() - 1
    o = torch.empty(N, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(Hq, N, device=q.device, dtype=torch.float32)
    if N == 0:
        return o, lse
    BD = max(16, triton.next_power_of_2(D))
    BM, BN, num_warps, num_stages = _config("fwd", BD, q.dtype)
    grid = (Hq, S + 1, triton.cdiv(max(max_seqlen, 1), BM))
    _attn_fwd_kernel[grid](q, k, v, o, lse, cu, N, S, scale * LOG2E,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           o.stride(0), o.stride(1), G=Hq // Hk, D=D, BM=BM, BN=BN, BD=BD,
                           num_warps=num_warps, num_stages=num_stages)
    return o, lse


def attention_bwd_triton(do, q, k, v, o, lse, cu_seqlens, max_seqlen: int, scale: float):
    q = _heads(q, "q", q.shape[0], q.shape[-1])
    k, v, cu, N, Hq, Hk, D = _check(q, k, v, cu_seqlens)
    do, o = _heads(do, "do", N, D), _heads(o, "o", N, D)
    if lse.shape != (Hq, N) or lse.dtype != torch.float32:
        raise ValueError(f"attention: lse must be fp32 [{Hq}, {N}], got {lse.dtype} {list(lse.shape)}")
    lse = lse.contiguous()
    S = cu.numel() - 1
    dq = torch.empty(N, Hq, D, device=q.device, dtype=q.dtype)
    dk = torch.empty(N, Hk, D, device=q.device, dtype=k.dtype)
    dv = torch.empty(N, Hk, D, device=q.device, dtype=v.dtype)
    if N == 0:
        return dq, dk, dv
    BD = max(16, triton.next_power_of_2(D))
    G, T = Hq // Hk, max(max_seqlen, 1)
    delta = torch.empty(Hq, N, device=q.device, dtype=torch.float32)
    BT = _INTERPRET_CONFIG[0] if interpreting() else _BT_DELTA
    _attn_bwd_delta_kernel[(triton.cdiv(N, BT), Hq)](o, do, delta, N, o.stride(0), o.stride(1),
                                                     do.stride(0), do.stride(1), D=D, BT=BT, BD=BD)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               do.stride(0), do.stride(1))
    BN, BM, num_warps, num_stages = _config("dkdv", BD, q.dtype)
    if BN % BM:  # the dk/dv kernel walks its key tile in whole query tiles
        raise ValueError(f"attention dkdv config: BN={BN} is not a multiple of BM={BM}")
    _attn_bwd_dkdv_kernel[(Hk, S + 1, triton.cdiv(T, BN))](
        q, k, v, do, lse, delta, dk, dv, cu, N, S, scale * LOG2E, scale, *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), G=G, D=D, BN=BN, BM=BM, BD=BD,
        num_warps=num_warps, num_stages=num_stages)
    BM, BN, num_warps, num_stages = _config("dq", BD, q.dtype)
    if BM % BN:  # the dq kernel walks its query tile in whole key tiles
        raise ValueError(f"attention dq config: BM={BM} is not a multiple of BN={BN}")
    _attn_bwd_dq_kernel[(Hq, S + 1, triton.cdiv(T, BM))](
        q, k, v, do, lse, delta, dq, cu, N, S, scale * LOG2E, scale, *strides,
        dq.stride(0), dq.stride(1), G=G, D=D, BM=BM, BN=BN, BD=BD,
        num_warps=num_warps, num_stages=num_stages)
    return dq, dk, dv


def _seq_bounds(cu_seqlens: torch.Tensor):
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def attention_fwd_ref(q, k, v, cu_seqlens, max_seqlen, scale):
    N, Hq, D = q.shape
    G = Hq // k.shape[1]
    o = torch.zeros_like(q)
    lse = torch.zeros(Hq, N, device=q.device, dtype=torch.float32)
    for s, e in _seq_bounds(cu_seqlens):  # a loop over sequences, not tokens
        if e == s:
            continue
        qs = q[s:e].float().transpose(0, 1)  # [Hq, L, D]
        ks = k[s:e].float().transpose(0, 1).repeat_interleave(G, 0)
        vs = v[s:e].float().transpose(0, 1).repeat_interleave(G, 0)
        S = qs @ ks.transpose(1, 2) * scale  # [Hq, L, L]
        L = e - s
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        S = S.masked_fill(mask, float("-inf"))
        m = S.logsumexp(-1)  # [Hq, L]
        P = torch.exp(S - m[..., None])
        o[s:e] = (P @ vs).transpose(0, 1).to(q.dtype)
        lse[:, s:e] = m
    return o, lse


def attention_bwd_ref(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale):
    N, Hq, D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros(N, Hk, D, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    for s, e in _seq_bounds(cu_seqlens):
        if e == s:
            continue
        L = e - s
        qs = q[s:e].float().transpose(0, 1)
        ks = k[s:e].float().transpose(0, 1).repeat_interleave(G, 0)
        vs = v[s:e].float().transpose(0, 1).repeat_interleave(G, 0)
        dos = do[s:e].float().transpose(0, 1)
        os_ = o[s:e].float().transpose(0, 1)
        S = qs @ ks.transpose(1, 2) * scale
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        P = torch.exp(S.masked_fill(mask, float("-inf")) - lse[:, s:e, None])
        dvs = P.transpose(1, 2) @ dos  # [Hq, L, D]
        dP = dos @ vs.transpose(1, 2)
        delta = (dos * os_).sum(-1, keepdim=True)
        dS = P * (dP - delta)
        dq[s:e] = (dS @ ks * scale).transpose(0, 1)
        dks = dS.transpose(1, 2) @ qs * scale
        dk[s:e] = dks.view(Hk, G, L, D).sum(1).transpose(0, 1)
        dv[s:e] = dvs.view(Hk, G, L, D).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@dispatch(attention_fwd_triton, attention_fwd_ref, on="q")
def attention_fwd(q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    """q: [N, Hq, D], k, v: [N, Hk, D] (any token/head strides, unit last stride),
    cu_seqlens: [S+1] int32, max_seqlen >= the longest sequence
    -> (o [N, Hq, D], lse [Hq, N] fp32)."""


@dispatch(attention_bwd_triton, attention_bwd_ref, on="q")
def attention_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen: int, scale: float):
    """do, o: [N, Hq, D], lse: [Hq, N] fp32 from attention_fwd
    -> (dq [N, Hq, D], dk [N, Hk, D], dv [N, Hk, D])."""
