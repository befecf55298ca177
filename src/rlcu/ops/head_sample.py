"""The LM head and the sampler's first pass in one kernel: logits = h W^T and their pass-1
partials (ops/sampling.py) from one sweep over the head's weights.

A decode step's LM head is memory-bound (0.6B: 311 MB of weights for 64-256 rows) while the
sampler's first pass is compute-bound (its noise hash, ~75 instructions a token) and runs as a
launch of its own after it. Here each program computes a [BM, BN] tile of logits (fp32 sums
rounded to h's dtype, as `h @ W.t()` gives them), writes it (the row kernel's filters and the
sampled token's logprob read it back), and reduces it in its epilogue to what `_pass1_kernel`
would: per row and tile the max z, the sum of exp(z - max), the min, the argmax and the
exponential race's winner (z = logits / T, the same noise of the same counters), and the tile's
largest key. A tile is both a pass-1 chunk and a row-kernel tile (BN tokens), so
`sampling._row_kernel` finishes each row unchanged (`sampling.finish_rows`). Given the same
logits the tokens are the sampler's bit for bit; the logprobs differ from it by the order of
the sums of exp (a few ulps).

The twin is the plain composition: logits = (h @ W^T) in h's dtype, then `sampling.sample`.
`CONFIGS["enabled"]` has the engine's decode steps use it (engine/paged_forward.py
`sample_rows`; never in exact mode, whose logits come from the batch-invariant GEMM).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, interpreting, tl, triton
from rlcu.ops._hash import hash32 as _hash32
from rlcu.ops.sampling import _gumbel, _okey, _row_params, finish_rows, pass1_buffers, sample

CONFIGS = {
    "enabled": False,  # the engine's decode steps sample through this op (paged_forward.sample_rows)
    "BN": 128,  # vocabulary entries a tile (a pass-1 chunk and a row-kernel tile)
    "BK": 64,
    "max_BM": 64,  # rows a tile: the batch's power of two, at least 16, at most this
    "num_warps": 8,
    "num_stages": 4,
}
_INTERPRET = dict(BN=32, BK=32, max_BM=16, num_warps=4, num_stages=1)


@triton.jit
def _row_keys(SEEDS, OFFSETS, rows, mask):
    # sampling._row_key for a vector of rows
    s = tl.load(SEEDS + rows, mask=mask, other=0).to(tl.int64)
    o = tl.load(OFFSETS + rows, mask=mask, other=0).to(tl.int64)
    k = _hash32((s & 0xFFFFFFFF).to(tl.uint32) ^ 0x243F6A88)
    k = _hash32(k ^ ((s >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = _hash32(k ^ (o & 0xFFFFFFFF).to(tl.uint32))
    return _hash32(k ^ ((o >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit(do_not_specialize=["M"])
def _head_pass1_kernel(H, W, LOGITS, TEMP, SEEDS, OFFSETS, PF, PI, TMAX, M, V, K, NC,
                       stride_h, stride_w, stride_l, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       FAST: tl.constexpr, IEEE: tl.constexpr):
    # the M tiles of one vocabulary tile are neighbours in the grid: its weights leave DRAM once
    num_m = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    pm, pn = pid % num_m, pid // num_m
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < V
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        kk = k + tl.arange(0, BK)
        kmask = kk < K
        a = tl.load(H + rows[:, None].to(tl.int64) * stride_h + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        b = tl.load(W + cols[None, :].to(tl.int64) * stride_w + kk[:, None], mask=cmask[None, :] & kmask[:, None],
                    other=0.0)
        if IEEE:  # fp32 inputs (the CPU tests), and the interpreter, whose bf16 tl.dot is wrong (triton 3.6)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    mask = rmask[:, None] & cmask[None, :]
    lg = acc.to(LOGITS.dtype.element_ty)
    tl.store(LOGITS + rows[:, None].to(tl.int64) * stride_l + cols[None, :], lg, mask=mask)
    # the sampler's pass 1 on the tile (sampling._pass1_kernel: z = logits / T, T = 1 for greedy rows)
    T = tl.load(TEMP + rows, mask=rmask, other=1.0)
    race = T > 0
    T = tl.where(race, T, 1.0)
    z = tl.where(cmask[None, :], tl.math.div_rn(lg.to(tl.float32), T[:, None]), float("-inf"))
    m = tl.max(z, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(z - m_safe[:, None]), 1)
    zmin = tl.min(tl.where(cmask[None, :], z, float("inf")), 1)
    a_idx = tl.min(tl.where(z == m[:, None], cols[None, :], 2147483647), 1)  # the first index on ties
    key = _row_keys(SEEDS, OFFSETS, rows, rmask)
    sc = tl.where(cmask[None, :] & race[:, None], z + _gumbel(key[:, None], cols[None, :], FAST), float("-inf"))
    best = tl.max(sc, 1)
    w_idx = tl.min(tl.where(sc == best[:, None], cols[None, :], 2147483647), 1)
    pc = rows.to(tl.int64) * NC + pn  # chunk pn of each row ([4, M, NC] / [2, M, NC] partials)
    MNC = M.to(tl.int64) * NC
    tl.store(PF + pc, m, mask=rmask)
    tl.store(PF + MNC + pc, s, mask=rmask)
    tl.store(PF + 2 * MNC + pc, zmin, mask=rmask)
    tl.store(PF + 3 * MNC + pc, best, mask=rmask)
    tl.store(PI + pc, a_idx, mask=rmask)
    tl.store(PI + MNC + pc, w_idx, mask=rmask)
    tl.store(TMAX + pc, _okey(m), mask=rmask)  # a tile a chunk: NT = NC


def _check(h, W, *params):
    if h.dim() != 2 or W.dim() != 2 or h.shape[1] != W.shape[1]:
        raise ValueError(f"head_sample: h [B, K] and W [V, K] expected, got {list(h.shape)} and {list(W.shape)}")
    if h.dtype != W.dtype:
        raise ValueError(f"head_sample: h is {h.dtype}, W {W.dtype}")
    B = h.shape[0]
    names = ("temperature", "top_k", "top_p", "min_p", "seeds", "offsets")
    for name, t in zip(names, params):
        if t.shape != (B,):
            raise ValueError(f"head_sample: {name} must be [{B}], got shape {list(t.shape)}")


def head_sample_triton(h, W, temperature, top_k, top_p, min_p, seeds, offsets):
    B, K = h.shape
    V = W.shape[0]
    logits = torch.empty(B, V, device=h.device, dtype=h.dtype)
    if B == 0:
        return (torch.empty(0, device=h.device, dtype=torch.int64),
                torch.empty(0, device=h.device, dtype=torch.float32), logits)
    if V >= 2**31 - 2**20:
        raise ValueError(f"head_sample: V={V} must be < 2^31 - 2^20")
    h = h if h.stride(1) == 1 else h.contiguous()
    W = W if W.stride(1) == 1 else W.contiguous()
    cfg = _INTERPRET if interpreting() else CONFIGS
    BN = cfg["BN"]
    BM = min(max(16, triton.next_power_of_2(B)), cfg["max_BM"])
    NC = triton.cdiv(V, BN)
    params = _row_params(temperature, top_k, top_p, min_p, seeds, offsets)
    pf, pi, tmax = pass1_buffers(B, NC, NC, h.device)
    ieee = interpreting() or h.dtype == torch.float32
    _head_pass1_kernel[(triton.cdiv(B, BM) * NC,)](
        h, W, logits, params[0], params[4], params[5], pf, pi, tmax, B, V, K, NC, h.stride(0), W.stride(0),
        logits.stride(0), BM=BM, BN=BN, BK=cfg["BK"], FAST=not interpreting(), IEEE=ieee,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    tokens, logprobs = finish_rows(logits, params, pf, pi, tmax, NC, NC, BN)
    return tokens, logprobs, logits


def head_sample_ref(h, W, temperature, top_k, top_p, min_p, seeds, offsets):
    logits = (h @ W.t()).to(h.dtype)
    return (*sample(logits, temperature, top_k, top_p, min_p, seeds, offsets), logits)


@dispatch(head_sample_triton, head_sample_ref, on="h")
def head_sample(h, W, temperature, top_k, top_p, min_p, seeds, offsets):
    """h [B, K] final hidden rows, W [V, K] the LM head (h's dtype); the sampler's per-row tensors
    as `sampling.sample` takes them -> (tokens [B] int64, logprobs [B] fp32, logits [B, V] in h's
    dtype): `sample(h @ W.t(), ...)` with the logits it sampled from."""
    _check(h, W, temperature, top_k, top_p, min_p, seeds, offsets)
