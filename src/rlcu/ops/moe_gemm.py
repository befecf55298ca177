"""The experts' grouped GEMMs over a MoeLayout (ops/moe_sort.py), their weight gradients, and the
weighted combine back to the tokens.

    y  = grouped_mm(a, w, layout, gather)        y[r] = a[row(r)] w[e(r)]^T      [rows, N] (sorted rows)
    grouped_dw(g, a, layout, gather, dw)         dw[e] += sum over e's rows r of g[r]^T a[row(r)]
    out = moe_combine(y, pos, weights)           out[t] = sum_{s = 0..k-1} weights[t, s] y[pos[t k + s]]
    dy, dweights = moe_combine_bwd(dout, y, pos, weights)

w is [E, N, K] (the stored [E, out, in]: gate_up [E, 2I, H], down [E, H, I]) or a transposed view
of one (w.transpose(1, 2): the backward's dA = dY W). row(r) is the token of the pair at sorted
row r when `gather` (the first GEMM reads x in token order), else r itself.

One program a (block, column tile): the block's expert from block_expert, its BM rows' A tiles
times W_e's, K walked from 0 in BK steps into one fp32 accumulator (no split-K), padding rows
masked. The programs' order (GROUP: 0, blocks fastest, each column tile over all blocks; g > 0, g
blocks sweep the column tiles together, so their A rows are read from HBM about once) and the
backward's dA GEMMs' own tiles (`<regime>_dx`, at the layout's BM) change the speed, not a bit.
A token's bits depend on its own row and W_e alone (exact mode): the tiles (BM, BN, BK)
follow the regime (decode's few pairs an expert: 16-row blocks, each touched expert's weights
read once a column tile; prefill's many: 64-row blocks at tensor-core tiles), which the K order
does not depend on where K is a multiple of 128 (matmul_invariant measured it for its tiles);
with a K tail every T takes one tiling. The combine sums the k slots in slot order in fp32.

The weight gradient: one program an (expert, N tile, K tile) walks its expert's rows in order,
no atomics: the same inputs give the same bits. An expert without pairs adds nothing. The
expert is the slowest grid dim, so that an expert's g and a rows stay in L2 while its tiles run
(experts fastest streamed every row from HBM once a tile).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import HAS_TRITON, dispatch, interpreting, tl, triton
from rlcu.ops.moe_sort import MoeLayout

if HAS_TRITON:
    from rlcu.ops.matmul_invariant import dot_invariant, mm_ref
else:  # pragma: no cover - the kernels are never launched without triton
    from rlcu.ops.matmul_invariant import mm_ref

    dot_invariant = None

# (BM, BN, BK, warps, stages, GROUP) of the grouped GEMM by regime, BM the layout's block rows;
# <regime>_dx: the backward's dA = dY W GEMMs' (BM the regime's); bench/kernel_tune.py sweeps them
CONFIGS = {
    "decode": (16, 64, 128, 4, 4, 0),
    "prefill": (128, 256, 64, 8, 4, 8),
    "decode_dx": (16, 64, 128, 4, 4, 0),
    "prefill_dx": (128, 256, 64, 8, 4, 8),
    "dw": (64, 64, 64, 4, 3),  # (BM: rows a step, BN, BK, warps, stages) of the weight gradient
    "dw_long": (128, 128, 128, 8, 2),  # the same where experts average more than dw_long_rows rows
    "dw_long_rows": 1024,  # (deep K sums: larger tiles read the rows from L2 fewer times)
    "decode_pairs": 32,  # pairs an expert on average at most, for decode's tiles
    "combine_bn": 1024,
}
_INTERPRET = {"decode": (16, 16, 32, 4, 1, 0), "prefill": (32, 32, 32, 4, 1, 0), "decode_dx": (16, 16, 32, 4, 1, 0),
              "prefill_dx": (32, 32, 32, 4, 1, 0), "dw": (16, 32, 32, 4, 1),
              "dw_long": (16, 32, 32, 4, 1)}


def regime(T: int, k: int, E: int, K: int = 128) -> str:
    """'decode' or 'prefill': the tiles of a T-token layer (the layout's BM with them); a K
    without a multiple of 128 keeps decode's for every T (a K tail's bits follow the tiling)."""
    return "decode" if T * k <= CONFIGS["decode_pairs"] * E or K % 128 else "prefill"


def dw_regime(rows: int, E: int) -> str:
    """'dw' or 'dw_long': the weight gradient's tiles for a layout of `rows` sorted rows over E
    experts (deep K sums past dw_long_rows rows an expert on average)."""
    return "dw_long" if rows > CONFIGS["dw_long_rows"] * E else "dw"


def gemm_config(name: str) -> tuple:
    return (_INTERPRET if interpreting() else CONFIGS)[name]


@triton.jit
def _rows_of(PAIRS, offs_m, lim, TOPK: tl.constexpr, GATHER: tl.constexpr):
    # the block's pairs (-1: padding), which rows are real, and the A row each reads
    pair = tl.load(PAIRS + offs_m, mask=offs_m < lim, other=-1)
    valid = pair >= 0
    if GATHER:
        arow = tl.where(valid, pair // TOPK, 0).to(tl.int64)
    else:
        arow = offs_m
    return valid, arow


@triton.jit
def _block_tile(N: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    # this program's (block, column tile) of a 1-D grid of blocks x column tiles (module docstring)
    pid = tl.program_id(0)
    n_n: tl.constexpr = (N + BN - 1) // BN
    n_b = tl.num_programs(0) // n_n
    if GROUP == 0:
        pid_b, pid_n = pid % n_b, pid // n_b
    else:
        first = (pid // (GROUP * n_n)) * GROUP
        size = tl.minimum(n_b - first, GROUP)
        pid_b, pid_n = first + (pid % (GROUP * n_n)) % size, (pid % (GROUP * n_n)) // size
    return pid_b.to(tl.int64), pid_n.to(tl.int64)


@triton.jit
def _grouped_mm_kernel(A, W, Y, PAIRS, BLOCK_E, stride_am, stride_we, stride_wn, stride_wk, stride_ym,
                       N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, GATHER: tl.constexpr,
                       IEEE: tl.constexpr, BY_SUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, EVEN_K: tl.constexpr, GROUP: tl.constexpr):
    pid_b, pid_n = _block_tile(N, BN, GROUP)
    e = tl.load(BLOCK_E + pid_b).to(tl.int64)
    offs_m = pid_b * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    acc = tl.zeros([BM, BN], tl.float32)
    if e >= 0:  # blocks past the last expert's are empty: zeros, as padding rows get
        valid, arow = _rows_of(PAIRS, offs_m, (pid_b + 1) * BM, TOPK, GATHER)
        offs_k = tl.arange(0, BK)
        ap = A + arow[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
        wp = W + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN] = W_e^T
        for k0 in range(0, K, BK):  # one K order for every row
            if EVEN_K:
                a = tl.load(ap, mask=valid[:, None], other=0.0)
                b = tl.load(wp, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < K - k0
                a = tl.load(ap, mask=valid[:, None] & kmask[None, :], other=0.0)
                b = tl.load(wp, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = dot_invariant(a, b, acc, IEEE, BY_SUM)
            ap += BK
            wp += BK * stride_wk
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=nmask[None, :])


@triton.jit
def _grouped_dw_kernel(G, A, PAIRS, STARTS, DW, stride_gm, stride_am, stride_de, stride_dn,
                       N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, GATHER: tl.constexpr,
                       IEEE: tl.constexpr, BY_SUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr):
    # dw[e][n, k] += sum over e's rows r (in order) of g[r, n] a[row(r), k]; grid (K tiles, N tiles, E)
    e = tl.program_id(2).to(tl.int64)
    offs_n = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(0).to(tl.int64) * BK + tl.arange(0, BK)
    nmask, kmask = offs_n < N, offs_k < K
    start = tl.load(STARTS + e).to(tl.int64)
    end = tl.load(STARTS + e + 1).to(tl.int64)
    acc = tl.zeros([BN, BK], tl.float32)
    for m0 in range(start, end, BM):
        offs_m = m0 + tl.arange(0, BM)
        valid, arow = _rows_of(PAIRS, offs_m, end, TOPK, GATHER)
        g = tl.load(G + offs_m[None, :] * stride_gm + offs_n[:, None], mask=valid[None, :] & nmask[:, None],
                    other=0.0)  # [BN, BM] = g^T
        a = tl.load(A + arow[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & kmask[None, :],
                    other=0.0)  # [BM, BK]
        acc = dot_invariant(g, a, acc, IEEE, BY_SUM)
    dp = DW + e * stride_de + offs_n[:, None] * stride_dn + offs_k[None, :]
    omask = nmask[:, None] & kmask[None, :]
    acc += tl.load(dp, mask=omask, other=0.0).to(tl.float32)
    tl.store(dp, acc.to(DW.dtype.element_ty), mask=omask)


@triton.jit
def _combine_kernel(Y, POS, WT, OUT, N, stride_y, stride_o, TOPK: tl.constexpr, HAS_W: tl.constexpr,
                    BN: tl.constexpr):
    # out[t] = sum over slots in order of w[t, s] y[pos[t, s]] (w = 1 without weights), fp32
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    cmask = cols < N
    acc = tl.zeros([BN], tl.float32)
    for s in tl.static_range(TOPK):
        p = tl.load(POS + t * TOPK + s).to(tl.int64)
        y = tl.load(Y + p * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_W:
            acc += tl.load(WT + t * TOPK + s) * y
        else:
            acc += y
    tl.store(OUT + t * stride_o + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


@triton.jit
def _combine_bwd_kernel(DOUT, Y, POS, WT, DY, DWT, N, stride_do, stride_y, stride_dy, TOPK: tl.constexpr,
                        BN: tl.constexpr):
    # dy[pos[t, s]] = w[t, s] dout[t];  dw[t, s] = dout[t] . y[pos[t, s]] (fp32, in column blocks)
    t = tl.program_id(0).to(tl.int64)
    for s in tl.static_range(TOPK):
        p = tl.load(POS + t * TOPK + s).to(tl.int64)
        w = tl.load(WT + t * TOPK + s)
        d = tl.zeros([BN], tl.float32)
        for n0 in range(0, N, BN):
            cols = n0 + tl.arange(0, BN)
            cmask = cols < N
            g = tl.load(DOUT + t * stride_do + cols, mask=cmask, other=0.0).to(tl.float32)
            d += g * tl.load(Y + p * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
            tl.store(DY + p * stride_dy + cols, (w * g).to(DY.dtype.element_ty), mask=cmask)
        tl.store(DWT + t * TOPK + s, tl.sum(d, 0))


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def grouped_mm_triton(a, w, layout, gather, cfg="decode", exact=False):
    E, N, K = w.shape
    rows = layout.pairs.shape[0]
    y = torch.empty(rows, N, device=a.device, dtype=a.dtype)
    BM, BN, BK, warps, stages, group = gemm_config(cfg)
    if rows == 0:
        return y
    if BM != layout.BM:
        raise ValueError(f"grouped_mm: config {cfg!r} has BM={BM}, the layout was made for BM={layout.BM}")
    a = _unit_rows(a)
    grid = (layout.block_expert.shape[0] * triton.cdiv(N, BN),)
    _grouped_mm_kernel[grid](a, w, y, layout.pairs, layout.block_expert, a.stride(0), w.stride(0), w.stride(1),
                             w.stride(2), y.stride(0), N=N, K=K, TOPK=layout.k, GATHER=bool(gather),
                             IEEE=a.dtype == torch.float32, BY_SUM=interpreting(), BM=BM, BN=BN, BK=BK,
                             EVEN_K=K % BK == 0, GROUP=group, num_warps=warps, num_stages=stages)
    return y


def grouped_dw_triton(g, a, layout, gather, dw):
    E, N, K = dw.shape
    if layout.pairs.shape[0] == 0:
        return dw
    if dw.stride(2) != 1:
        raise ValueError("grouped_dw: dw must have a unit last stride (it is updated in place)")
    g, a = _unit_rows(g), _unit_rows(a)
    BM, BN, BK, warps, stages = gemm_config(dw_regime(layout.pairs.shape[0], E))
    grid = (triton.cdiv(K, BK), triton.cdiv(N, BN), E)
    _grouped_dw_kernel[grid](g, a, layout.pairs, layout.starts, dw, g.stride(0), a.stride(0), dw.stride(0),
                             dw.stride(1), N=N, K=K, TOPK=layout.k, GATHER=bool(gather),
                             IEEE=g.dtype == torch.float32, BY_SUM=interpreting(), BM=BM, BN=BN, BK=BK,
                             num_warps=warps, num_stages=stages)
    return dw


def moe_combine_triton(y, pos, weights, T):
    N = y.shape[1]
    k = pos.shape[0] // max(T, 1)
    out = torch.empty(T, N, device=y.device, dtype=y.dtype)
    if T == 0:
        return out
    y = _unit_rows(y)
    BN = min(CONFIGS["combine_bn"], triton.next_power_of_2(N))
    _combine_kernel[(T, triton.cdiv(N, BN))](y, pos, weights if weights is not None else y, out, N, y.stride(0),
                                             out.stride(0), TOPK=k, HAS_W=weights is not None, BN=BN, num_warps=4)
    return out


def moe_combine_bwd_triton(dout, y, pos, weights):
    T, N = dout.shape
    k = weights.shape[1]
    dy = torch.empty_like(y)
    dw = torch.empty(T, k, device=y.device, dtype=torch.float32)
    if T == 0:
        return dy, dw
    dout, y = _unit_rows(dout), _unit_rows(y)
    BN = min(CONFIGS["combine_bn"], triton.next_power_of_2(N))
    _combine_bwd_kernel[(T,)](dout, y, pos, weights, dy, dw, N, dout.stride(0), y.stride(0), dy.stride(0), TOPK=k,
                              BN=BN, num_warps=4)
    return dy, dw


def _expert_rows(layout: MoeLayout, e: int, gather: bool):
    # (sorted rows, A rows) of expert e's pairs
    s0, n = int(layout.starts[e]), int(layout.counts[e])
    rows = torch.arange(s0, s0 + n, device=layout.pairs.device)
    return rows, (layout.pairs[rows].long() // layout.k if gather else rows)


def grouped_mm_ref(a, w, layout, gather, cfg="decode", exact=False):
    y = torch.zeros(layout.pairs.shape[0], w.shape[1], device=a.device, dtype=a.dtype)
    for e in range(w.shape[0]):
        rows, arows = _expert_rows(layout, e, gather)
        if len(rows):
            y[rows] = mm_ref(a[arows], w[e]) if exact else (a[arows].float() @ w[e].float().T).to(a.dtype)
    return y


def grouped_dw_ref(g, a, layout, gather, dw):
    for e in range(dw.shape[0]):
        rows, arows = _expert_rows(layout, e, gather)
        if len(rows):
            dw[e] = (dw[e].float() + g[rows].float().T @ a[arows].float()).to(dw.dtype)
    return dw


def moe_combine_ref(y, pos, weights, T):
    k = pos.shape[0] // max(T, 1)
    p = pos.view(T, k).long()
    acc = torch.zeros(T, y.shape[1], device=y.device, dtype=torch.float32)
    for s in range(k):  # slot order
        ys = y[p[:, s]].float()
        acc = acc + (weights[:, s, None] * ys if weights is not None else ys)
    return acc.to(y.dtype)


def moe_combine_bwd_ref(dout, y, pos, weights):
    T, k = weights.shape
    p = pos.view(T, k).long()
    dy = torch.zeros_like(y)
    g = dout.float()
    dw = torch.stack([(g * y[p[:, s]].float()).sum(1) for s in range(k)], 1) if T else weights.new_zeros(0, k)
    for s in range(k):
        dy[p[:, s]] = (weights[:, s, None] * g).to(y.dtype)
    return dy, dw


def _check_w(name: str, w: torch.Tensor, a: torch.Tensor, layout: MoeLayout, same_dtype: bool = True):
    if w.dim() != 3 or a.dim() != 2 or w.shape[2] != a.shape[1]:
        raise ValueError(f"{name}: w must be [E, N, K] and a [rows, K], got {list(w.shape)} and {list(a.shape)}")
    if same_dtype and w.dtype != a.dtype:
        raise TypeError(f"{name}: a and w must share a dtype, got {a.dtype} and {w.dtype}")
    if layout.counts.shape[0] != w.shape[0]:
        raise ValueError(f"{name}: the layout has {layout.counts.shape[0]} experts, w {w.shape[0]}")


@dispatch(grouped_mm_triton, grouped_mm_ref, on="a")
def grouped_mm(a: torch.Tensor, w: torch.Tensor, layout: MoeLayout, gather: bool, cfg: str = "decode",
               exact: bool = False) -> torch.Tensor:
    """a [T, K] (gather: rows by token) or [rows, K] (the layout's sorted rows), w [E, N, K] (a
    view's strides allowed) -> y [rows, N] in a's dtype, y[r] = a[row(r)] w[e(r)]^T; padding rows
    zero. cfg: the regime ('decode' | 'prefill', whose BM the layout was made with; the backward's
dA GEMMs '<regime>_dx'). exact:
    the twin's fixed-tree sums (the kernel is batch invariant in both modes)."""
    _check_w("grouped_mm", w, a, layout)


@dispatch(grouped_dw_triton, grouped_dw_ref, on="g")
def grouped_dw(g: torch.Tensor, a: torch.Tensor, layout: MoeLayout, gather: bool, dw: torch.Tensor) -> torch.Tensor:
    """g [rows, N] (sorted rows), a as grouped_mm's, dw [E, N, K] updated in place and returned:
    dw[e] += g[e's rows]^T a[their rows], fp32 sums in row order, one rounding to dw's dtype."""
    _check_w("grouped_dw", dw, a, layout, same_dtype=False)
    if g.dtype != a.dtype:
        raise TypeError(f"grouped_dw: g and a must share a dtype, got {g.dtype} and {a.dtype}")
    if g.dim() != 2 or g.shape != (layout.pairs.shape[0], dw.shape[1]):
        raise ValueError(f"grouped_dw: g must be [{layout.pairs.shape[0]}, {dw.shape[1]}], got {list(g.shape)}")


@dispatch(moe_combine_triton, moe_combine_ref, on="y")
def moe_combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None, T: int) -> torch.Tensor:
    """y [rows, N] (sorted rows), pos [T k] (the layout's), weights [T, k] fp32 or None (1) ->
    out [T, N] in y's dtype: out[t] = sum_{s = 0..k-1} weights[t, s] y[pos[t k + s]], in slot
    order, fp32."""
    if pos.dim() != 1 or (T and pos.shape[0] % T) or pos.dtype != torch.int32:
        raise ValueError(f"moe_combine: pos must be int32 [T k] with T={T}, got {pos.dtype} {list(pos.shape)}")
    if weights is not None and (weights.shape != (T, pos.shape[0] // max(T, 1)) or weights.dtype != torch.float32):
        raise ValueError(f"moe_combine: weights must be fp32 [T, k], got {weights.dtype} {list(weights.shape)}")


@dispatch(moe_combine_bwd_triton, moe_combine_bwd_ref, on="y")
def moe_combine_bwd(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor):
    """dout [T, N], y [rows, N], pos [T k], weights [T, k] fp32 -> (dy [rows, N] in y's dtype,
    weights[t, s] dout[t] at row pos[t k + s], padding rows unwritten; dweights [T, k] fp32)."""
    if weights.dim() != 2 or pos.shape != (weights.numel(),) or dout.shape != (weights.shape[0], y.shape[1]):
        raise ValueError(f"moe_combine_bwd: dout [T, N], pos [T k], weights [T, k] disagree: {list(dout.shape)}, "
                         f"{list(pos.shape)}, {list(weights.shape)}")
