"""The grouped LoRA products: a batch of rows, each with its own adapter (or none), in one launch
per product, for the engine (decode graphs and prefill) and the trainer (idx all 0) alike:

    h = lora_shrink(x, a, idx)                      h[t] = x[t] a[idx[t]]^T          [T, R] fp32
    lora_expand(h, b, idx, y, scale, slices)        y[t, cols_j] += scale[idx[t]] h[t, j r:(j+1) r] b[idx[t]][cols_j]^T

`a` [n, R, K] and `b` [n, N, r] stack the n adapters of one module; a fused module (qkv: q, k, v;
gate_up: gate, up) has one slice a projection, each of rank r (R = S r), over the column range
slices[j] of y. idx [T] int32 on the device, -1 for a row without adapter (h row 0, y unchanged).

Rows in any order, no sort: a program takes a tile of BM rows and runs one pass over K (or r) per
adapter id between the tile's lowest and highest (passes whose adapter no row of the tile has are
skipped), each pass's result kept for the rows of that adapter. So a tile costs one pass per
adapter it holds: prefill's runs of one adapter (a sequence's tokens) and a decode batch grouped
by adapter take one or two. An unsorted decode batch may pass `order` (a device permutation that
groups the rows, e.g. idx.argsort(stable=True), made once a step and shared by every module of
every layer): the tiles then take the rows order[m0 : m0 + BM], gathered and scattered in place.

Batch invariance, by construction (exact mode rests on it): a row's sums depend on its own x, h
and adapter alone. Shrink walks K in a fixed split (K_SPLIT a function of K only, never of T)
of BK steps into one fp32 accumulator per split, the splits' partials then added in split order
(`_reduce_kernel`, or the expand itself: `lora_apply`, one launch fewer, the same adds in the same
order); expand sums the r terms of a row in one chain. The row and column tiles follow T (a
row's sums are the same under any of them where the reduced dim has no tail, as
matmul_invariant measured for its tiles; with a tail, one tiling serves every T).

Precision and rounding, kernel and twin alike:
  h: x, a in their dtype, exact products, fp32 sums (bf16 tensor-core dots on the GPU).
  y: h enters the bf16 product at about 16 bits: hi = bf16(h), lo = bf16(h - hi); then
     t = (hi b^T) + (lo b^T) (fp32 sums, hi's first), s t one fp32 product, y + s t one fp32 add,
     one rounding to y's dtype. (fp32 b: t = h b^T directly.) On the GPU the product is an
     explicit mul.rn, so that it is never contracted into an FMA with the add: the twin's two
     roundings are the kernel's. Where the sums are exact (small integers: the tests) the twin
     gives the kernel's bits; elsewhere the two differ only by the order of the fp32 sums.

CUDA graphs: no host sync, no allocation but T-sized workspaces, idx / order / scale read on the
device; idx values outside [-1, n) are not checked (a check would read them on the host).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import HAS_TRITON, dispatch, interpreting, tl, triton
from rlcu.ops.exact import tree_sum

if HAS_TRITON:
    from rlcu.ops.matmul_invariant import dot_invariant
else:  # pragma: no cover - the kernels are never launched without triton
    dot_invariant = None

MAX_SLICES = 4
# K_SPLIT: shrink's K per split, for every T (the splits' order is part of a row's bits).
# tiles: rows (max T or None, shrink's (BK, BM, BR, warps, stages), expand's (BM, BN, warps,
# stages)); a T takes the first row whose max T is not below it. Decode's few rows in 16-row
# tiles (mma.sync) with narrow R / N tiles, so that T = 1 still spreads a's and b's bytes over
# many SMs; prefill's in 64-row tiles (warpgroup MMAs, a and b re-read from L2 a quarter as
# often). BK (bf16: 256-byte rows of x and a) may follow T only where bench/kernel_tune.py found
# the candidate's h bit-equal to the default's (the tensor cores chain K in 16-wide steps).
# fuse_max_t: lora_apply's expand adds shrink's split partials itself (no reduce launch) up to
# this T; past it the one reduce pass is cheaper than each column tile re-reading S partials.
CONFIGS = {
    "k_split": 512,
    "tiles": ((16, (128, 16, 16, 4, 4), (16, 64, 4, 2)),
              (256, (128, 32, 32, 4, 4), (32, 128, 4, 2)),
              (None, (128, 64, 64, 4, 3), (64, 128, 4, 2))),
    "fuse_max_t": 256,
}
_INTERPRET = {"k_split": 64, "tiles": ((None, (32, 16, 16, 4, 1), (16, 16, 4, 1)),), "fuse_max_t": 256}
_REF_ELEMS = 1 << 22  # the twins' [rows, cols, K] product block, at most


@triton.jit
def _tile_rows(IDX, ORDER, T, BM: tl.constexpr, HAS_ORDER: tl.constexpr):
    # this program's rows (their places in x / h / y), a mask of those < T, their adapter ids
    # (-1 past T) and the range of ids present
    offs = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    mmask = offs < T
    if HAS_ORDER:
        rows = tl.load(ORDER + offs, mask=mmask, other=0).to(tl.int64)
    else:
        rows = offs
    ids = tl.load(IDX + rows, mask=mmask, other=-1)
    first = tl.min(tl.where(ids >= 0, ids, 1 << 30), 0).to(tl.int64)  # int64: the loops' j scales strides
    last = tl.max(ids, 0).to(tl.int64)
    return rows, mmask, ids, first, last


@triton.jit
def _shrink_pass(X, A, rows, mmask, offs_r, rmask, j, k_lo, K, K_SPLIT, stride_x, stride_an, stride_ar,
                 IEEE: tl.constexpr, BY_SUM: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    # x[rows, k_lo : k_lo + K_SPLIT] a[j, offs_r, same]^T, K in BK steps into one fp32 accumulator
    offs_k = tl.arange(0, BK)
    xp = X + rows[:, None] * stride_x + (k_lo + offs_k)[None, :]  # [BM, BK]
    ap = A + j * stride_an + offs_r[None, :] * stride_ar + (k_lo + offs_k)[:, None]  # [BK, BR]
    acc = tl.zeros([BM, BR], tl.float32)
    for k0 in range(0, K_SPLIT, BK):
        kmask = (k_lo + k0 + offs_k) < K
        xt = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
        at = tl.load(ap, mask=kmask[:, None] & rmask[None, :], other=0.0)
        acc = dot_invariant(xt, at, acc, IEEE, BY_SUM)
        xp += BK
        ap += BK
    return acc


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(X, A, IDX, ORDER, P, T, K, R, K_SPLIT, stride_x, stride_an, stride_ar, stride_p, stride_ps,
                   HAS_ORDER: tl.constexpr, IEEE: tl.constexpr, BY_SUM: tl.constexpr, BM: tl.constexpr,
                   BR: tl.constexpr, BK: tl.constexpr):
    # grid (row tiles, R tiles, K splits): split pid_k's partial sums of the tile's rows to
    # P[pid_k] (h itself when K is one split); rows without adapter get zeros
    rows, mmask, ids, first, last = _tile_rows(IDX, ORDER, T, BM, HAS_ORDER)
    offs_r = tl.program_id(1) * BR + tl.arange(0, BR)
    rmask = offs_r < R
    pid_k = tl.program_id(2)
    acc = tl.zeros([BM, BR], tl.float32)
    for j in range(first, last + 1):
        mine = ids == j
        if tl.max(mine.to(tl.int32), 0) > 0:
            part = _shrink_pass(X, A, rows, mmask, offs_r, rmask, j, pid_k * K_SPLIT, K, K_SPLIT, stride_x,
                                stride_an, stride_ar, IEEE, BY_SUM, BM, BR, BK)
            acc = tl.where(mine[:, None], part, acc)
    pp = P + pid_k.to(tl.int64) * stride_ps + rows[:, None] * stride_p + offs_r[None, :]
    tl.store(pp, acc, mask=mmask[:, None] & rmask[None, :])


@triton.jit
def _reduce_kernel(P, H, n, S, stride_ps, BLOCK: tl.constexpr):
    # h = the S partials added in split order (the same for every T)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(P + offs, mask=mask, other=0.0)
    for s in range(1, S):
        acc += tl.load(P + s * stride_ps + offs, mask=mask, other=0.0)
    tl.store(H + offs, acc, mask=mask)


@triton.jit
def _mul_rn(a, b, INTERP: tl.constexpr):
    # a b rounded once, never fused into a following add (mul.rn is exempt from contraction)
    if INTERP:
        out = a * b
    else:
        out = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                        is_pure=True, pack=1)
    return out


@triton.jit
def _to(x, dtype: tl.constexpr, RNE: tl.constexpr):
    # x (fp32) rounded to dtype, to nearest even; RNE: by hand, to bf16 (the interpreter's cast
    # truncates): the nearest bf16 as an fp32, which the cast then keeps exactly
    if RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _slice_bounds(sl, C0, C1, C2, C3, C4, C5, C6, C7):
    # slice sl's column range [c0, c1) from the scalars (MAX_SLICES pairs)
    c0 = tl.where(sl == 0, C0, tl.where(sl == 1, C2, tl.where(sl == 2, C4, C6)))
    c1 = tl.where(sl == 0, C1, tl.where(sl == 1, C3, tl.where(sl == 2, C5, C7)))
    return c0, c1


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(H, B, IDX, ORDER, SCALE, Y, T, r, S, stride_h, stride_hs, stride_bn, stride_bc, stride_y,
                   C0, C1, C2, C3, C4, C5, C6, C7, HAS_ORDER: tl.constexpr, SPLIT_H: tl.constexpr,
                   IEEE: tl.constexpr, INTERP: tl.constexpr, RNE_B: tl.constexpr, RNE_Y: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # grid (row tiles, column tiles of the widest slice, slices); H holds S split partials of h
    # (stride_hs apart), added here in split order as _reduce_kernel adds them (S = 1: h itself)
    sl = tl.program_id(2)
    c0, c1 = _slice_bounds(sl, C0, C1, C2, C3, C4, C5, C6, C7)
    n0 = c0 + tl.program_id(1) * BN
    if n0 < c1:  # past this slice's end: nothing to do
        rows, mmask, ids, first, last = _tile_rows(IDX, ORDER, T, BM, HAS_ORDER)
        cols = n0 + tl.arange(0, BN)
        cmask = cols < c1
        offs_k = tl.arange(0, BR)
        kmask = offs_k < r
        hp = H + rows[:, None] * stride_h + sl * r + offs_k[None, :]
        hmask = mmask[:, None] & kmask[None, :]
        h = tl.load(hp, mask=hmask, other=0.0)  # [BM, BR] fp32
        for q in range(1, S):
            h += tl.load(hp + q * stride_hs, mask=hmask, other=0.0)
        if SPLIT_H:  # h = hi + lo to about 16 bits, both in b's dtype (module docstring)
            hi = _to(h, B.dtype.element_ty, RNE_B)
            lo = _to(h - hi.to(tl.float32), B.dtype.element_ty, RNE_B)
        acc = tl.zeros([BM, BN], tl.float32)
        for j in range(first, last + 1):
            mine = ids == j
            if tl.max(mine.to(tl.int32), 0) > 0:
                bp = B + j * stride_bn + cols[None, :].to(tl.int64) * stride_bc + offs_k[:, None]
                bt = tl.load(bp, mask=kmask[:, None] & cmask[None, :], other=0.0)  # [BR, BN] = b_j[cols]^T
                t = tl.zeros([BM, BN], tl.float32)
                if SPLIT_H:
                    t = dot_invariant(hi, bt, t, IEEE, INTERP)
                    t = dot_invariant(lo, bt, t, IEEE, INTERP)
                else:
                    t = dot_invariant(h, bt, t, IEEE, INTERP)
                s = tl.load(SCALE + j) + tl.zeros([BM, BN], tl.float32)
                acc = tl.where(mine[:, None], _mul_rn(s, t, INTERP), acc)
        omask = (mmask & (ids >= 0))[:, None] & cmask[None, :]
        yp = Y + rows[:, None] * stride_y + cols[None, :]
        y = tl.load(yp, mask=omask, other=0.0).to(tl.float32)
        tl.store(yp, _to(y + acc, Y.dtype.element_ty, RNE_Y), mask=omask)


def _tiles(T: int, reduced_tail: bool) -> tuple:
    # the tiles row of T; a reduced dim with a tail keeps the first row for every T
    rows = (_INTERPRET if interpreting() else CONFIGS)["tiles"]
    return rows[0] if reduced_tail else next(row for row in rows if row[0] is None or T <= row[0])


def shrink_config(T: int, K: int) -> tuple:
    """(K_SPLIT, BK, BM, BR, warps, stages) of a T-row shrink over K (K_SPLIT never depends on T)."""
    k_split = (_INTERPRET if interpreting() else CONFIGS)["k_split"]
    return (k_split, *_tiles(T, K % 128 != 0)[1])


def expand_config(T: int, r: int) -> tuple:
    """(BM, BN, BR, warps, stages) of a T-row expand of rank r (BR: r padded to a power of two >= 16)."""
    BM, BN, warps, stages = _tiles(T, r % 16 != 0)[2]
    return BM, BN, max(16, triton.next_power_of_2(r)), warps, stages


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _shrink_partials(x, a, idx, order):
    # shrink's launch -> (p [S, T, R] fp32, the S split partials (h itself when S = 1), S)
    T, K = x.shape
    R = a.shape[1]
    x, a = _rows(x), _rows(a)
    k_split, bk, BM, BR, warps, stages = shrink_config(T, K)
    S = triton.cdiv(K, k_split)
    p = torch.empty(S, T, R, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(T, BM), triton.cdiv(R, BR), S)
    _shrink_kernel[grid](x, a, idx, order if order is not None else idx, p, T, K, R, k_split, x.stride(0),
                         a.stride(0), a.stride(1), R, T * R, HAS_ORDER=order is not None,
                         IEEE=x.dtype == torch.float32, BY_SUM=interpreting(), BM=BM, BR=BR, BK=bk,
                         num_warps=warps, num_stages=stages)
    return p, S


def _reduce(p, S):
    # h [T, R] = the S partials added in split order
    if S == 1:
        return p[0]
    h = torch.empty(p.shape[1:], device=p.device, dtype=torch.float32)
    BLOCK = 1024
    _reduce_kernel[(triton.cdiv(h.numel(), BLOCK),)](p, h, h.numel(), S, h.numel(), BLOCK=BLOCK, num_warps=4)
    return h


def lora_shrink_triton(x, a, idx, order=None):
    if x.shape[0] == 0:
        return torch.empty(0, a.shape[1], device=x.device, dtype=torch.float32)
    return _reduce(*_shrink_partials(x, a, idx, order))


def _expand(p, S, b, idx, y, scale, slices, order):
    # y += the expand of h = the S partials p [S, T, R] (or h [T, R] itself, S = 1)
    T, r = y.shape[0], b.shape[2]
    if y.stride(1) != 1:
        raise ValueError("lora_expand: y must have a unit column stride (it is updated in place)")
    b = _rows(b)
    slices = _slices(slices, y.shape[1])
    BM, BN, BR, warps, stages = expand_config(T, r)
    widest = max(c1 - c0 for c0, c1 in slices)
    bounds = [c for s in slices for c in s] + [0, 0] * (MAX_SLICES - len(slices))
    grid = (triton.cdiv(T, BM), triton.cdiv(widest, BN), len(slices))
    _expand_kernel[grid](p, b, idx, order if order is not None else idx, scale, y, T, r, S, p.stride(-2),
                         p.stride(0) if S > 1 else 0, b.stride(0), b.stride(1), y.stride(0), *bounds,
                         HAS_ORDER=order is not None, SPLIT_H=b.dtype != torch.float32,
                         IEEE=b.dtype == torch.float32, INTERP=interpreting(),
                         RNE_B=interpreting() and b.dtype == torch.bfloat16,
                         RNE_Y=interpreting() and y.dtype == torch.bfloat16,
                         BM=BM, BN=BN, BR=BR, num_warps=warps, num_stages=stages)
    return y


def lora_expand_triton(h, b, idx, y, scale, slices=None, order=None):
    if h.shape[0] == 0:
        return y
    return _expand(_rows(h), 1, b, idx, y, scale, slices, order)


def lora_apply_triton(x, a, b, idx, y, scale, slices=None, order=None):
    T = x.shape[0]
    if T == 0:
        return y
    p, S = _shrink_partials(x, a, idx, order)
    if T > (_INTERPRET if interpreting() else CONFIGS)["fuse_max_t"]:
        p, S = _reduce(p, S), 1
    return _expand(p, S, b, idx, y, scale, slices, order)


def _blocks(T: int, cols: int, k: int):
    # row and column block sizes whose [rows, cols, k] product stays within _REF_ELEMS
    kp = 1 << max(k - 1, 0).bit_length()
    bn = max(1, min(cols, _REF_ELEMS // kp))
    return max(1, _REF_ELEMS // (bn * kp)), bn


def _twin_dot(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u [m, k] fp32, w [c, k] -> [m, c]: exact products, tree sums over k (row by row, in blocks)."""
    wf = w.float()
    out = u.new_empty(u.shape[0], w.shape[0])
    bm, bn = _blocks(u.shape[0], w.shape[0], u.shape[1])
    for n0 in range(0, w.shape[0], bn):
        for m0 in range(0, u.shape[0], bm):
            out[m0:m0 + bm, n0:n0 + bn] = tree_sum(u[m0:m0 + bm, None, :] * wf[None, n0:n0 + bn])
    return out


def lora_shrink_ref(x, a, idx, order=None):
    h = torch.zeros(x.shape[0], a.shape[1], device=x.device, dtype=torch.float32)
    for j in range(a.shape[0]):
        rows = (idx == j).nonzero().flatten()
        if len(rows):
            h[rows] = _twin_dot(x[rows].float(), a[j])
    return h


def lora_expand_ref(h, b, idx, y, scale, slices=None, order=None):
    r = b.shape[2]
    for j in range(b.shape[0]):
        rows = (idx == j).nonzero().flatten()
        if not len(rows):
            continue
        for s, (c0, c1) in enumerate(_slices(slices, y.shape[1])):
            hs = h[rows, s * r:(s + 1) * r].float()
            if b.dtype == torch.float32:
                t = _twin_dot(hs, b[j, c0:c1])
            else:
                hi = hs.to(b.dtype).float()
                t = _twin_dot(hi, b[j, c0:c1]) + _twin_dot((hs - hi).to(b.dtype).float(), b[j, c0:c1])
            y[rows, c0:c1] = (y[rows, c0:c1].float() + scale[j].float() * t).to(y.dtype)
    return y


def _slices(slices, N: int) -> tuple:
    return ((0, N),) if slices is None else tuple((int(c0), int(c1)) for c0, c1 in slices)


def _check_rows(name, idx, order, T):
    if idx.shape != (T,) or idx.dtype != torch.int32:
        raise ValueError(f"{name}: idx must be int32 [{T}], got {idx.dtype} {list(idx.shape)}")
    if order is not None and (order.shape != (T,) or order.dtype != torch.int32):
        raise ValueError(f"{name}: order must be an int32 permutation [{T}], got {order.dtype} {list(order.shape)}")


def _check_float(name, **ts):
    for k, t in ts.items():
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{name}: {k} must be bfloat16 or float32, got {t.dtype}")


def _check_shrink(x, a, idx, order):
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_shrink: x must be [T, K] and a [n, R, K], got {list(x.shape)} and {list(a.shape)}")
    if x.dtype != a.dtype:
        raise TypeError(f"lora_shrink: x and a must share a dtype, got {x.dtype} and {a.dtype}")
    _check_float("lora_shrink", x=x)
    _check_rows("lora_shrink", idx, order, x.shape[0])


def _check_expand(h_shape, h_dtype, b, idx, y, scale, slices, order):
    T, n, N, r = h_shape[0], b.shape[0], y.shape[1] if y.dim() == 2 else -1, b.shape[-1]
    if len(h_shape) != 2 or h_dtype != torch.float32:
        raise ValueError(f"lora_expand: h must be fp32 [T, R], got {h_dtype} {list(h_shape)}")
    if b.dim() != 3 or y.shape != (T, b.shape[1]):
        raise ValueError(f"lora_expand: b must be [n, N, r] and y [T, N], got {list(b.shape)} and {list(y.shape)}")
    _check_float("lora_expand", b=b, y=y)
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"lora_expand: scale must be fp32 [{n}], got {scale.dtype} {list(scale.shape)}")
    sl = _slices(slices, N)
    if not 1 <= len(sl) <= MAX_SLICES or h_shape[1] != len(sl) * r:
        raise ValueError(f"lora_expand: {len(sl)} slices (1 to {MAX_SLICES}) of rank {r} need h [T, {len(sl) * r}], "
                         f"got {list(h_shape)}")
    if any(not 0 <= c0 < c1 <= N for c0, c1 in sl):
        raise ValueError(f"lora_expand: slices must be column ranges 0 <= c0 < c1 <= {N}, got {sl}")
    _check_rows("lora_expand", idx, order, T)


@dispatch(lora_shrink_triton, lora_shrink_ref, on="x")
def lora_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], a [n, R, K] (the n adapters' A of one module, slices stacked: R = S r), idx [T]
    int32 (an adapter, or -1) -> h [T, R] fp32, h[t] = x[t] a[idx[t]]^T, 0 where idx is -1.
    order: None, or an int32 permutation of the rows that groups them by adapter (speed only:
    the bits are the same)."""
    _check_shrink(x, a, idx, order)


@dispatch(lora_expand_triton, lora_expand_ref, on="h")
def lora_expand(h: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
                slices=None, order: torch.Tensor | None = None) -> torch.Tensor:
    """h [T, S r] fp32 (lora_shrink's), b [n, N, r] (the adapters' B, slices' rows stacked), idx
    [T] int32, y [T, N] updated in place and returned, scale [n] fp32, slices: S column ranges
    ((c0, c1), ...) of y (None: one, all N columns) -> y[t, c0_j:c1_j] += scale[idx[t]]
    h[t, j r:(j+1) r] b[idx[t], c0_j:c1_j]^T, rounded once into y (module docstring); rows
    with idx -1 unchanged. order: as lora_shrink's."""
    _check_expand(h.shape, h.dtype, b, idx, y, scale, slices, order)


def lora_apply_ref(x, a, b, idx, y, scale, slices=None, order=None):
    return lora_expand_ref(lora_shrink_ref(x, a, idx), b, idx, y, scale, slices)


@dispatch(lora_apply_triton, lora_apply_ref, on="x")
def lora_apply(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, y: torch.Tensor,
               scale: torch.Tensor, slices=None, order: torch.Tensor | None = None) -> torch.Tensor:
    """lora_expand(lora_shrink(x, a, idx, order), b, idx, y, scale, slices, order), bit for bit,
    in two launches where K takes several splits (up to CONFIGS' fuse_max_t rows the expand adds
    shrink's split partials itself, in split order: no reduce launch) -> y, updated in place."""
    _check_shrink(x, a, idx, order)
    _check_expand((x.shape[0], a.shape[1]), torch.float32, b, idx, y, scale, slices, order)
