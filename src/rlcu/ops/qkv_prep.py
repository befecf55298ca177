"""Attention-input prep of the inference engine, fused: per-head q/k RMSNorm, RoPE, KV-cache write.

Per layer, from the fused projection qkv = h Wqkv^T ([N, (Hq + 2 Hk) D], heads of D in a row:
Hq q heads, then Hk k heads, then Hk v heads), for token n at position p = pos[n]:
    q[n, h] = rope(rmsnorm(qkv[n, q head h], q_w), p)              -> a new [N, Hq, D]
    k_cache[slot[n], h] = rope(rmsnorm(qkv[n, k head h], k_w), p)  (skipped when slot[n] < 0)
    v_cache[slot[n], h] = qkv[n, v head h]                         (skipped when slot[n] < 0)
with rmsnorm and rope exactly as rmsnorm.py and rope.py compute them in sequence, rounding to
the model's dtype where they do: x/rms(x) before the scale by w, the normed head (rmsnorm's
output), the rotated head (rope's output). Only the sum of squares differs in its order (two
half-row sums here), so on the GPU an output may differ from the unfused ops by one ulp.
The families without q/k norm (Llama, Mistral, Qwen2: q_w = k_w = None) compile NORM=False:
rope alone, rope.py's float ops, no stats. A q/k/v bias (Qwen2's) is added to the rows on load,
in fp32 and rounded to the model's dtype once, as the projection with its bias gives them.

The unfused sequence is two copies (the strided q and k slices), two norms, two ropes and one
cache write per layer: 7 launches that each read and write the heads again. Here one program
holds BT whole token rows (all Hq + 2 Hk heads) read in place from qkv, the angles of its
tokens are formed once and shared by the q and k heads, and each element is read once and
written once: 2 (Hq + 2 Hk) D elements a token. Every load is issued first, none waiting on
another's result (the positions, the slots and the q, k and v rows; k and v are read for every
token and written only where it has a slot), so that a decode step's launch, a few token rows
just written by the GEMM, waits on one round trip to L2 instead of four. N is not specialised
on: a shape compiles two variants (`launch`: a few rows for latency, many for throughput),
never one per token count (prefill chunks, decode batch sizes).

The trainer's forward runs this kernel too, in either mode, through `qk_norm_rope`, which
writes k and v into contiguous [N, Hk, D] tensors seen as a cache of N one-token blocks (slot
n = token n) and stores the per-head rstd for the backward (`STATS`). In exact mode
(ops/exact.py) the engine calls `qkv_prep(..., stats=True)`, so that both sides compile the
same kernel (same block shapes, warps and `STATS`); a token row's float ops do not depend on
which program holds it, so q and k have the same bits whatever the batch. `exact=` switches only
the twin (its norms' fixed-tree sums, rmsnorm.py).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton
from rlcu.ops.kv_cache import kv_write_ref
from rlcu.ops.rmsnorm import rmsnorm_fwd_ref
from rlcu.ops.rope import check_inv_freq, cos_sin, rope_fwd_ref

MAX_D = 256  # head_dim: a program holds BT x (Hq + 2 Hk) x D elements
# Two launches (`launch`), measured on the H200 (one token row = (Hq + 2 Hk) D elements padded to
# a power of two, bf16; the previous kernel, whose loads waited on each other, in the same run):
# "decode", a step's few rows (at most max_tokens, rows of at most max_row elements): one row a
# program, a warp per elems_per_warp elements, for latency: 2.5 / 3.5 us at 64 / 256 rows at
# Qwen3-0.6B's heads (previous: 4.3 / 5.1), 3.4 / 4.7 at 8B's (4.2 / 4.9). "bulk", everything
# else and every call with stats (the trainer, exact mode's engine: one kernel for both, so the
# same bits): tile elements a program, a warp per elems_per_warp, for throughput: 8192 rows in
# 37 / 66 / 111 us at 0.6B / 8B / 32B heads (previous: 59 / 85 / 173). Both spill-free (ptxas).
CONFIGS = {
    "decode": dict(max_tokens=256, max_row=8192, elems_per_warp=512),
    "bulk": dict(tile=16384, elems_per_warp=2048),
}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def norm_rope_halves(x1, x2, W, i, D, D2, eps, cos, sin, dt: tl.constexpr, NORM: tl.constexpr = True):
    """Heads as their halves x1, x2 [rows, heads, BD2] (fp32, values of dtype dt), the norm's
    weight W [D], cos and sin [rows, 1, BD2] -> the rotated halves (y1, y2) in dt and the
    rstd [rows, heads]: rmsnorm (rounding as rmsnorm.py), then rope (as rope.py). NORM=False:
    rope alone (the families without q/k norm), as rope.py's kernel rotates; the rstd returned
    is not one (never stored). The decode qkv projection (decode_qkv.py) runs it on its
    accumulators."""
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 2) + tl.sum(x2 * x2, 2)) / D + eps)  # [rows, heads]
        rstd = r[:, :, None]
        imask = i < D2
        w1 = tl.load(W + i, mask=imask, other=0.0).to(tl.float32)[None, None, :]
        w2 = tl.load(W + D2 + i, mask=imask, other=0.0).to(tl.float32)[None, None, :]
        # rmsnorm rounds x * rstd to the model dtype before the scale by w, and its output
        y1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        y2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    else:
        r = 0.0  # unused: no stats without a norm
        y1, y2 = x1, x2
    return (y1 * cos - y2 * sin).to(dt), (y2 * cos + y1 * sin).to(dt), r


@triton.jit
def add_bias(x1, x2, B, h, H, i, D, D2, dt: tl.constexpr):
    """Heads' halves x1, x2 [rows, heads, BD2] (fp32, values of dt) plus the bias of heads h < H
    (B + h D: the projection's bias [(Hq + 2 Hk) D]), rounded to dt as the projection's output with
    its bias is: (x + b) in fp32 once, then to dt."""
    off = h[None, :, None] * D + i[None, None, :]
    imask = (h < H)[None, :, None] & (i < D2)[None, None, :]
    b1 = tl.load(B + off, mask=imask, other=0.0).to(tl.float32)
    b2 = tl.load(B + off + D2, mask=imask, other=0.0).to(tl.float32)
    return (x1 + b1).to(dt).to(tl.float32), (x2 + b2).to(dt).to(tl.float32)


@triton.jit
def _halves(X, t, h, i, mask, stride_x, D, D2):
    """Heads [BT, BH, D] at X + t * stride_x + h * D as their halves (x1, x2), each [BT, BH, BD2]
    in X's dtype."""
    off = t[:, None, None] * stride_x + h[None, :, None] * D + i[None, None, :]
    return tl.load(X + off, mask=mask, other=0.0), tl.load(X + off + D2, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["N"])
def _qkv_prep_kernel(QKV, QW, KW, BIAS, POS, SLOT, Q, KC, VC, RQ, RK, N, Hq, Hk, D, D2, stride_qkv,
                     stride_cs, stride_ch, eps, INV, mscale, BT: tl.constexpr, BHQ: tl.constexpr,
                     BHK: tl.constexpr, BD2: tl.constexpr, STATS: tl.constexpr, NORM: tl.constexpr,
                     BIASED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BT + tl.arange(0, BT)  # [BT] tokens
    i = tl.arange(0, BD2)
    hq = tl.arange(0, BHQ)
    hk = tl.arange(0, BHK)
    tmask = t < N
    imask = (i < D2)[None, None, :]
    qmask = tmask[:, None, None] & (hq < Hq)[None, :, None] & imask
    rmask = tmask[:, None, None] & (hk < Hk)[None, :, None] & imask  # k and v rows of the tokens
    # every load first, none behind another's result: the rows were just written (L2), so the
    # kernel takes one round trip instead of one for the positions and slots, one for q, one
    # for k and one for v (k and v are read for every token, written only where it has a slot)
    pos = tl.load(POS + t, mask=tmask, other=0).to(tl.float32)
    slot = tl.load(SLOT + t, mask=tmask, other=-1).to(tl.int64)  # [BT]
    q1, q2 = _halves(QKV, t, hq, i, qmask, stride_qkv, D, D2)
    k1, k2 = _halves(QKV + Hq * D, t, hk, i, rmask, stride_qkv, D, D2)
    v1, v2 = _halves(QKV + (Hq + Hk) * D, t, hk, i, rmask, stride_qkv, D, D2)
    cos, sin = cos_sin(pos, i, INV, D2, mscale)  # [BT, 1, BD2], as rope.py forms them
    dt = QKV.dtype.element_ty
    q1, q2, k1, k2 = q1.to(tl.float32), q2.to(tl.float32), k1.to(tl.float32), k2.to(tl.float32)
    if BIASED:  # the projection's bias (Qwen2's), added on load
        q1, q2 = add_bias(q1, q2, BIAS, hq, Hq, i, D, D2, dt)
        k1, k2 = add_bias(k1, k2, BIAS + Hq * D, hk, Hk, i, D, D2, dt)
        v1, v2 = add_bias(v1.to(tl.float32), v2.to(tl.float32), BIAS + (Hq + Hk) * D, hk, Hk, i, D, D2, dt)

    # q: every token row
    q1, q2, rq = norm_rope_halves(q1, q2, QW, i, D, D2, eps, cos, sin, dt, NORM)
    q_off = t[:, None, None] * (Hq * D) + hq[None, :, None] * D + i[None, None, :]
    tl.store(Q + q_off, q1, mask=qmask)
    tl.store(Q + q_off + D2, q2, mask=qmask)
    if STATS:  # the per-head rstd, [N, Hq] (and [N, Hk] below), for the trainer's backward
        tl.store(RQ + t[:, None] * Hq + hq[None, :], rq, mask=tmask[:, None] & (hq < Hq)[None, :])

    # k and v: only the rows that have a cache slot; row slot of the cache seen as [slots, Hk, D]
    kmask = (slot >= 0)[:, None, None] & rmask
    k1, k2, rk = norm_rope_halves(k1, k2, KW, i, D, D2, eps, cos, sin, dt, NORM)
    if STATS:
        tl.store(RK + t[:, None] * Hk + hk[None, :], rk, mask=(slot >= 0)[:, None] & (hk < Hk)[None, :])
    c_off = slot[:, None, None] * stride_cs + hk[None, :, None] * stride_ch + i[None, None, :]
    tl.store(KC + c_off, k1.to(KC.dtype.element_ty), mask=kmask)
    tl.store(KC + c_off + D2, k2.to(KC.dtype.element_ty), mask=kmask)
    tl.store(VC + c_off, v1.to(VC.dtype.element_ty), mask=kmask)
    tl.store(VC + c_off + D2, v2.to(VC.dtype.element_ty), mask=kmask)


def _check(qkv, q_w, k_w, pos, slots, k_cache, v_cache, Hq: int, Hk: int, D: int, inv_freq, bias):
    if qkv.dim() != 2 or qkv.shape[1] != (Hq + 2 * Hk) * D:
        raise ValueError(f"qkv_prep: qkv must be [N, (Hq + 2 Hk) D] = [N, {(Hq + 2 * Hk) * D}] "
                         f"(Hq={Hq}, Hk={Hk}, D={D}), got shape {list(qkv.shape)}")
    if qkv.dtype not in _FLOATS:
        raise TypeError(f"qkv_prep: qkv must be float32, bfloat16 or float16, got {qkv.dtype}")
    if D % 2 or not 0 < D <= MAX_D:
        raise ValueError(f"qkv_prep: head_dim D={D} must be even and in [2, {MAX_D}]")
    N = qkv.shape[0]
    if (q_w is None) != (k_w is None):
        raise ValueError("qkv_prep: q_w and k_w must both be tensors (q/k norm) or both None (rope alone)")
    for name, w in (("q_w", q_w), ("k_w", k_w)):
        if w is not None and w.shape != (D,):
            raise ValueError(f"qkv_prep: {name} must have shape [{D}], got {list(w.shape)}")
    if bias is not None and bias.shape != ((Hq + 2 * Hk) * D,):
        raise ValueError(f"qkv_prep: bias must be [(Hq + 2 Hk) D] = [{(Hq + 2 * Hk) * D}], got {list(bias.shape)}")
    if pos.shape != (N,) or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qkv_prep: pos must be an int32 [{N}] tensor, got {pos.dtype} {list(pos.shape)}")
    if slots.shape != (N,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qkv_prep: slots must be an int64 [{N}] tensor, got {slots.dtype} "
                         f"{list(slots.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != (Hk, D):
        raise ValueError(f"qkv_prep: caches must be [num_blocks, block_size, {Hk}, {D}], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qkv_prep: k_cache and v_cache must be contiguous")
    for name, x in (("q_w", q_w), ("k_w", k_w), ("bias", bias), ("pos", pos), ("slots", slots),
                    ("k_cache", k_cache), ("v_cache", v_cache)):
        if x is not None and x.device != qkv.device:
            raise ValueError(f"qkv_prep: {name} is on {x.device}, qkv on {qkv.device}")
    check_inv_freq("qkv_prep", inv_freq, D, qkv.device)


def launch(N: int, row: int, stats: bool) -> tuple[int, int]:
    """(BT token rows a program, num_warps) for N rows of `row` elements (the program's blocks
    of one token, a power of two): CONFIGS' "decode" for a few rows without stats, else "bulk".
    A row's float ops follow the compiled variant (its BT and num_warps lay out the sum of
    squares), never N, and a call with stats always takes "bulk", whose variant depends on the
    shape only: the trainer's rows and exact mode's engine rows agree."""
    dec, bulk = CONFIGS["decode"], CONFIGS["bulk"]
    if not stats and N <= dec["max_tokens"] and row <= dec["max_row"]:
        return 1, max(4, row // dec["elems_per_warp"])
    BT = max(1, bulk["tile"] // row)
    return BT, min(16, max(4, BT * row // bulk["elems_per_warp"]))


def qkv_prep_triton(qkv, q_w, k_w, pos, slots, k_cache, v_cache, Hq: int, Hk: int, D: int,
                    eps: float, inv_freq, stats: bool = False, exact: bool = False, mscale: float = 1.0,
                    bias=None):
    # one kernel in both modes (exact mode's engine asks for stats, so that it runs the trainer's variant)
    N, norm = qkv.shape[0], q_w is not None
    q = torch.empty(N, Hq, D, device=qkv.device, dtype=qkv.dtype)
    if stats and norm:
        rq = torch.empty(N * Hq, device=qkv.device, dtype=torch.float32)
        rk = torch.empty(N * Hk, device=qkv.device, dtype=torch.float32)
    else:
        rq = rk = q  # not written (STATS off): no allocations on the engine's hot path
    if N > 0:
        if qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        D2 = D // 2
        BHQ, BHK, BD2 = triton.next_power_of_2(Hq), triton.next_power_of_2(Hk), triton.next_power_of_2(D2)
        BT, num_warps = launch(N, triton.next_power_of_2((BHQ + 2 * BHK) * 2 * BD2), stats)
        kc, vc = k_cache.view(-1, Hk, D), v_cache.view(-1, Hk, D)  # [slots, Hk, D]
        _qkv_prep_kernel[(triton.cdiv(N, BT),)](
            qkv, q_w.contiguous() if norm else q, k_w.contiguous() if norm else q,
            bias.contiguous() if bias is not None else q, pos.to(torch.int32).contiguous(), slots.contiguous(), q,
            kc, vc, rq, rk, N, Hq, Hk, D, D2, qkv.stride(0), kc.stride(0), kc.stride(1), eps, inv_freq,
            float(mscale), BT=BT, BHQ=BHQ, BHK=BHK, BD2=BD2, STATS=stats and norm, NORM=norm,
            BIASED=bias is not None, num_warps=num_warps)
    if not stats:
        return q
    return (q, rq, rk) if norm else (q, None, None)


def qkv_prep_ref(qkv, q_w, k_w, pos, slots, k_cache, v_cache, Hq: int, Hk: int, D: int,
                 eps: float, inv_freq, stats: bool = False, exact: bool = False, mscale: float = 1.0,
                 bias=None):
    N, qs, ks = qkv.shape[0], Hq * D, Hk * D
    if bias is not None:  # in fp32, rounded once to the model's dtype, as the kernel adds it
        qkv = (qkv.float() + bias.float()).to(qkv.dtype)
    q, k, rq, rk = qkv[:, :qs], qkv[:, qs:qs + ks], None, None
    if q_w is not None:
        q, rq = rmsnorm_fwd_ref(q.reshape(N * Hq, D), q_w, eps, exact)
        k, rk = rmsnorm_fwd_ref(k.reshape(N * Hk, D), k_w, eps, exact)
    v = qkv[:, qs + ks:].reshape(N, Hk, D)
    q = rope_fwd_ref(q.reshape(N, Hq, D), pos, inv_freq, mscale)
    k = rope_fwd_ref(k.reshape(N, Hk, D), pos, inv_freq, mscale)
    kv_write_ref(k, v, k_cache, v_cache, slots)
    return (q, rq, rk) if stats else q


@dispatch(qkv_prep_triton, qkv_prep_ref, on="qkv")
def qkv_prep(qkv, q_w, k_w, pos, slots, k_cache, v_cache, Hq: int, Hk: int, D: int, eps: float,
             inv_freq: torch.Tensor, stats: bool = False, exact: bool = False, mscale: float = 1.0,
             bias: torch.Tensor | None = None):
    """qkv: [N, (Hq + 2 Hk) D] (the fused projection; any row stride), q_w, k_w: [D] (the
    q/k RMSNorm weights; both None: no q/k norm, rope alone, as Llama, Mistral and Qwen2 run it),
    bias: [(Hq + 2 Hk) D] or None (Qwen2's q/k/v bias, added to qkv before anything else), pos: [N]
    int32, inv_freq [D/2] fp32 and mscale: the rope's table and
    factor on cos/sin (model/rope.py), slots: [N] int64 (block * block_size + offset, < 0:
    write nowhere), k_cache, v_cache: [num_blocks, block_size, Hk, D] (written in place)
    -> q [N, Hq, D] (contiguous, qkv's dtype): normed and rotated; with stats, (q, rq [N Hq],
    rk [N Hk]): the heads' rstd (fp32; rk only where slot >= 0; both None without a norm), as exact
    mode runs it. exact: exact mode's twin (its norms' fixed-tree sums; the kernel is the same in
    both modes)."""
    _check(qkv, q_w, k_w, pos, slots, k_cache, v_cache, Hq, Hk, D, inv_freq, bias)


def qk_norm_rope(qkv: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None, pos: torch.Tensor, Hq: int,
                 Hk: int, D: int, eps: float, inv_freq: torch.Tensor, *, exact: bool = False,
                 mscale: float = 1.0, bias: torch.Tensor | None = None):
    """The trainer's q/k norm and rope, by the engine's kernel: qkv [N, (Hq + 2 Hk) D]
    -> (q [N, Hq, D], k [N, Hk, D], v [N, Hk, D] (a copy), rq [N Hq], rk [N Hk] (fp32 rstd)); q_w,
    k_w None: rope alone (rq, rk None); bias: added to qkv first (v includes it).
    k and v are written as a cache of N blocks of one token (slot n = token n), so that each token
    row goes through the float ops the engine's `qkv_prep(..., stats=True)` gives it (exact: as
    `qkv_prep`'s)."""
    N = qkv.shape[0]
    k = torch.empty(N, 1, Hk, D, device=qkv.device, dtype=qkv.dtype)
    v = torch.empty_like(k)
    slots = torch.arange(N, device=qkv.device, dtype=torch.int64)
    q, rq, rk = qkv_prep(qkv, q_w, k_w, pos, slots, k, v, Hq, Hk, D, eps, inv_freq, True, exact=exact, mscale=mscale,
                         bias=bias)
    return q, k.view(N, Hk, D), v.view(N, Hk, D), rq, rk
