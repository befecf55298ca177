"""A decode layer's attention inputs in one kernel, for a few rows (M <= 256): the input norm,
the fused QKV projection and qkv_prep's work (the q and k heads' RMSNorm and RoPE, k and v
written to their cache slots):

    qkv = rmsnorm(x; g) Wqkv^T;   q = rope(rmsnorm(q heads; q_w));   k_cache[slot] = rope(rmsnorm(k heads; k_w));
    v_cache[slot] = v heads

One program holds one head's D columns for BM rows, as two accumulators of D / 2 columns (the
halves RoPE rotates into each other: W rows h D + i and h D + D / 2 + i), so the head's norm
and rotation run on the accumulators: no qkv tensor, and no qkv_prep launch (one launch a
layer fewer: bench/results/profile_engine.json). The GEMM is decode_linear.py's (its main loop,
the input norm inside it, split-K added by each tile's last program, optional PDL); the
epilogue first rounds qkv to the model's dtype, as the GEMM's output was, then runs
qkv_prep's norm and rotation (`qkv_prep.norm_rope_halves`), so the two paths differ only by
the GEMM's sums. The families without q/k norm compile NORM=False (rope alone), and a q/k/v bias
(Qwen2's) is added to the rounded qkv there, as qkv_prep adds it on load. Split-K needs
decode_linear's inline reduce (its counters); where they cannot serve, or the tile table says
None, the call runs the unfused ops (its twin). Exact mode never runs it.
"""

from __future__ import annotations

import torch

from rlcu.ops import decode_linear as dl
from rlcu.ops._backend import dispatch, tl, triton
from rlcu.ops.decode_linear import _mainloop, _pdl_begin, _split_arrive
from rlcu.ops.qkv_prep import norm_rope_halves, qkv_prep
from rlcu.ops.rmsnorm import rmsnorm_fwd
from rlcu.ops.rope import check_inv_freq, cos_sin

KIND = "qkv"  # the third element of this op's keys in decode_linear.CONFIGS["table"]


@triton.jit
def _heads_epilogue(acc1, acc2, ss, h, offs_m, i, M, K, eps, QW, KW, BIAS, POS, SLOT, Q, KC, VC, stride_cs,
                    stride_ch, INV, mscale, Hq, Hk, D: tl.constexpr, D2: tl.constexpr, NORM: tl.constexpr,
                    BIASED: tl.constexpr):
    dt = Q.dtype.element_ty
    mmask = offs_m < M
    rstd = tl.rsqrt(ss / K + eps)[:, None]  # the input norm's
    x1 = (acc1 * rstd).to(dt).to(tl.float32)[:, None, :]  # qkv, rounded as the GEMM's output: [BM, 1, D2]
    x2 = (acc2 * rstd).to(dt).to(tl.float32)[:, None, :]
    if BIASED:  # the projection's bias, added to the rounded output as qkv_prep adds it on load
        x1 = (x1 + tl.load(BIAS + h * D + i).to(tl.float32)[None, None, :]).to(dt).to(tl.float32)
        x2 = (x2 + tl.load(BIAS + h * D + D2 + i).to(tl.float32)[None, None, :]).to(dt).to(tl.float32)
    mask = mmask[:, None, None] & (i < D2)[None, None, :]
    if h < Hq + Hk:  # a q or k head: norm and rotation, the angles as rope.py forms them
        cos, sin = cos_sin(tl.load(POS + offs_m, mask=mmask, other=0).to(tl.float32), i, INV, D2, mscale)
        if h < Hq:
            y1, y2, _ = norm_rope_halves(x1, x2, QW, i, D, D2, eps, cos, sin, dt, NORM)
            q_off = offs_m[:, None, None] * (Hq * D) + h * D + i[None, None, :]
            tl.store(Q + q_off, y1, mask=mask)
            tl.store(Q + q_off + D2, y2, mask=mask)
        else:
            y1, y2, _ = norm_rope_halves(x1, x2, KW, i, D, D2, eps, cos, sin, dt, NORM)
            slot = tl.load(SLOT + offs_m, mask=mmask, other=-1).to(tl.int64)
            c_off = slot[:, None, None] * stride_cs + (h - Hq) * stride_ch + i[None, None, :]
            kmask = mask & (slot >= 0)[:, None, None]
            tl.store(KC + c_off, y1.to(KC.dtype.element_ty), mask=kmask)
            tl.store(KC + c_off + D2, y2.to(KC.dtype.element_ty), mask=kmask)
    else:  # a v head: as the GEMM gave it
        slot = tl.load(SLOT + offs_m, mask=mmask, other=-1).to(tl.int64)
        c_off = slot[:, None, None] * stride_cs + (h - Hq - Hk) * stride_ch + i[None, None, :]
        vmask = mask & (slot >= 0)[:, None, None]
        tl.store(VC + c_off, x1.to(VC.dtype.element_ty), mask=vmask)
        tl.store(VC + c_off + D2, x2.to(VC.dtype.element_ty), mask=vmask)


@triton.jit(do_not_specialize=["M"])
def _qkv_kernel(X, W, G, QW, KW, BIAS, POS, SLOT, Q, KC, VC, P, PSS, CNT, M, K, K_SPLIT, stride_x, stride_w,
                stride_cs, stride_ch, eps, INV, mscale, Hq, Hk, PARTIAL: tl.constexpr, SPLIT: tl.constexpr,
                IEEE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, KL: tl.constexpr, LINE: tl.constexpr,
                D: tl.constexpr, D2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr,
                BIASED: tl.constexpr):
    h = tl.program_id(0)  # the head: Hq q heads, then Hk k heads, then Hk v heads
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    i = tl.arange(0, D2)
    rows_w = h.to(tl.int64) * D + i  # the head's first half; the second is D2 rows on
    k_lo = pid_k * K_SPLIT
    if PDL:
        _pdl_begin(W, stride_w, rows_w, D2, k_lo, K_SPLIT, K, True, PREFETCH, KL, LINE)
    acc1, acc2, ss = _mainloop(X, W, G, offs_m, offs_m < M, rows_w, D2, k_lo, K, K_SPLIT, stride_x, stride_w, True,
                               True, IEEE, BM, D2, BK)
    if PARTIAL:  # the partials [split, M, N] (the halves D2 columns apart), added by the tile's last program
        n_tiles = tl.num_programs(0)
        N = n_tiles * D
        last, acc1, acc2, ss = _split_arrive(P, PSS, CNT, acc1, acc2, ss, offs_m, rows_w, M, N, N, D2,
                                             pid_m * n_tiles + h, h, pid_k, n_tiles, SPLIT, True, True,
                                             True, BM, D2)
        if last:
            _heads_epilogue(acc1, acc2, ss, h, offs_m, i, M, K, eps, QW, KW, BIAS, POS, SLOT, Q, KC, VC, stride_cs,
                            stride_ch, INV, mscale, Hq, Hk, D, D2, NORM, BIASED)
    else:
        _heads_epilogue(acc1, acc2, ss, h, offs_m, i, M, K, eps, QW, KW, BIAS, POS, SLOT, Q, KC, VC, stride_cs,
                        stride_ch, INV, mscale, Hq, Hk, D, D2, NORM, BIASED)


def heads_config(M: int, heads: int, K: int) -> tuple:
    """(BM, BN, BK, SPLIT, num_warps, num_stages) where the tile table has no entry: BN is D / 2
    (set by the launcher; listed as 0), rows as decode_linear's heuristic, K split until about
    one program an SM (a program a head and row tile)."""
    BM = dl.row_tile(M)
    return BM, 0, 128, dl.split_for(heads * triton.cdiv(M, BM), K), 4, 4


def config_for(M: int, N: int, K: int, heads: int):
    return dl.table_config(M, (N, K, KIND), lambda: heads_config(M, heads, K), (16, 0, 32, 1, 4, 1))


def decode_qkv_triton(x, w, norm_w, eps, q_w, k_w, pos, slots, k_cache, v_cache, Hq: int, Hk: int, D: int,
                      inv_freq, cfg=None, mscale: float = 1.0, bias=None):
    def unfused():  # the twin (positional: tests count its calls)
        return decode_qkv_ref(x, w, norm_w, eps, q_w, k_w, pos, slots, k_cache, v_cache, Hq, Hk, D, inv_freq, None,
                              mscale, bias)

    M, K = x.shape
    D2 = D // 2
    if M == 0 or D2 < 16 or D2 & (D2 - 1):  # a head's half must be one power-of-two tile
        return unfused()
    heads = Hq + 2 * Hk
    cfg = cfg or config_for(M, heads * D, K, heads)
    if cfg is None:  # the table's word: the unfused ops are faster at this shape and M
        return unfused()
    BM, _, BK, split, warps, stages = cfg
    k_split, split, kw = dl.launch_args(x, K, BK, split, warps, stages)
    grid = (heads, triton.cdiv(M, BM), split)
    cnt = dl._counters(x.device, grid[0] * grid[1]) if split > 1 else None
    if split > 1 and cnt is None:  # no counters for the inline reduce: the unfused ops
        return unfused()
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    q = torch.empty(M, Hq, D, device=x.device, dtype=x.dtype)
    part = pss = q  # not read unless split > 1
    if split > 1:
        part = torch.empty(split, M, heads * D, device=x.device, dtype=torch.float32)
        pss = torch.empty(split, heads, M, device=x.device, dtype=torch.float32)
    kc, vc = k_cache.view(-1, Hk, D), v_cache.view(-1, Hk, D)  # [slots, Hk, D]
    _qkv_kernel[grid](
        x, w, norm_w, q if q_w is None else q_w, q if k_w is None else k_w, q if bias is None else bias, pos, slots,
        q, kc, vc, part, pss, cnt if cnt is not None else q, M, K, k_split, x.stride(0), w.stride(0), kc.stride(0),
        kc.stride(1), eps, inv_freq, float(mscale), Hq, Hk, PARTIAL=split > 1, D=D, D2=D2, BM=BM, BK=BK,
        NORM=q_w is not None, BIASED=bias is not None, **kw)
    return q


def decode_qkv_ref(x, w, norm_w, eps, q_w, k_w, pos, slots, k_cache, v_cache, Hq: int, Hk: int, D: int,
                   inv_freq, cfg=None, mscale: float = 1.0, bias=None):
    qkv = rmsnorm_fwd(x, norm_w, eps)[0] @ w.t()
    return qkv_prep(qkv, q_w, k_w, pos, slots, k_cache, v_cache, Hq, Hk, D, eps, inv_freq, mscale=mscale, bias=bias)


@dispatch(decode_qkv_triton, decode_qkv_ref, on="x")
def decode_qkv(x, w, norm_w, eps, q_w, k_w, pos, slots, k_cache, v_cache, Hq: int, Hk: int, D: int, inv_freq,
               cfg=None, mscale: float = 1.0, bias=None):
    """x [M, hidden], w [(Hq + 2 Hk) D, hidden] (q heads, k heads, v heads), norm_w [hidden] (the
    input norm), q_w, k_w [D] (both None: no q/k norm, rope alone), pos [M] int32, slots [M] int64
    (< 0: write nowhere), k_cache, v_cache [num_blocks, block_size, Hk, D] (written in place),
    inv_freq [D/2] fp32 and mscale (the rope's, model/rope.py) -> q [M, Hq, D]: as qkv_prep of
    rmsnorm(x; norm_w) w^T. cfg: a (BM, -, BK, SPLIT, warps, stages) instead of the table's. bias
    [(Hq + 2 Hk) D] or None: the projection's (Qwen2's q/k/v bias), added in the GEMM's epilogue."""
    if x.dim() != 2 or w.shape != ((Hq + 2 * Hk) * D, x.shape[1]) or x.dtype != w.dtype:
        raise ValueError(f"decode_qkv: x must be [M, K] and w [(Hq + 2 Hk) D, K] = [{(Hq + 2 * Hk) * D}, K] of "
                         f"x's dtype, got {x.dtype} {list(x.shape)} and {w.dtype} {list(w.shape)}")
    if norm_w.shape != (x.shape[1],):
        raise ValueError(f"decode_qkv: norm_w must be [{x.shape[1]}], got {list(norm_w.shape)}")
    check_inv_freq("decode_qkv", inv_freq, D, x.device)
    if (q_w is None) != (k_w is None):
        raise ValueError("decode_qkv: q_w and k_w must both be tensors (q/k norm) or both None (rope alone)")
    if bias is not None and (bias.shape != w.shape[:1] or not bias.is_contiguous()):
        raise ValueError(f"decode_qkv: bias must be a contiguous [(Hq + 2 Hk) D] = [{w.shape[0]}], got "
                         f"{list(bias.shape)}")
