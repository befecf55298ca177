"""A batch-invariant matmul, y = x W^T (+ c): the result for a row does not depend on how many
rows x has, nor on where the row sits among them. Exact mode's GEMM for every forward matmul
of the model and the engine (qkv, o with the residual, gate_up, down, the LM head).

cuBLAS (and a CPU BLAS) picks its kernel, tiles and split-K by the problem's M, so one row
of a 1-row product and of a 300-row product differ in the last bits (on the CPU here: 4 of 9
row counts give other bits than the 300-row product). This kernel fixes everything a row's
sums depend on: K walked from 0 into one fp32 accumulator (no split-K, no stream-K), the
optional c added to the fp32 accumulator in the epilogue and rounded once (as cuBLAS's beta = 1
does). The tiles follow M and N for speed (CONFIGS) where K is a multiple of 128: there, on
the GPU, a row's bits do not depend on them (the tensor cores chain K in 16-wide steps into the
accumulator whatever the tile; bench/exact_tiles.py checks every tile it times bit for bit on
the device). With a K tail they did change bits end to end, so such shapes keep one tiling.

The twin (the CPU path): y[m, n] = tree_sum over k of x[m, k] w[n, k] in fp32 (exact
elementwise products, then a fixed halving tree), in row and column blocks that bound the
[rows, cols, K] product's memory; no BLAS call, so no M-dependent kernel choice.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import HAS_TRITON, dispatch, interpreting
from rlcu.ops.exact import tree_sum

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

# Where K is a multiple of 128, a row's bits depend on the K order alone: each output element
# chains K in 16-wide tensor-core steps into one fp32 accumulator, whatever BM, BN, BK, the warps
# or the load path (measured bit for bit on the H200 for every tile below and more:
# bench/results/exact_tiles.json). So the tiles may follow M there (what must not is split-K,
# stream-K or any other split of K); config_for says where.
# (M, N, config): the first entry whose M and N bounds the product's do not exceed gives its
# (BM, BN, BK, GROUP_M, num_warps, num_stages, tma). The fastest of 37 tiles at each 0.6B weight
# shape and M in {1, 7, 64, 256, 8192} (bench/exact_tiles.py, H200): 0.93-1.24x cuBLAS's time.
_BIG = 1 << 62
CONFIGS: tuple[tuple[int, int, tuple], ...] = (
    (16, _BIG, (16, 32, 128, 8, 4, 4, False)),  # decode of a few sequences: weight-bound
    (128, 32768, (64, 32, 128, 8, 4, 4, True)),
    (128, _BIG, (64, 64, 128, 8, 4, 3, True)),
    (512, 2048, (64, 32, 128, 8, 4, 4, True)),  # decode of a full batch: o, down
    (512, 8192, (64, 64, 128, 8, 4, 3, True)),  # qkv, gate_up
    (512, _BIG, (128, 256, 64, 8, 8, 4, True)),  # the LM head
    (_BIG, _BIG, (128, 256, 64, 8, 8, 3, True)),  # training and prefill
)
ONE_CONFIG = (128, 128, 64, 8, 8, 3, False)  # every M, for the shapes CONFIGS does not cover
_INTERPRET_CONFIG = (32, 32, 32, 4, 4, 1, False)  # few programs: the interpreter's cost is per op
_REF_ELEMS = 1 << 22  # the twin's [rows, cols, K] product block, at most


if HAS_TRITON:

    @triton.jit
    def dot_invariant(a, b, acc, IEEE: tl.constexpr, BY_SUM: tl.constexpr):
        """acc + a b, with a row's result independent of the other rows of a. On the GPU the
        tensor-core dot (each element's K sum is one fixed instruction sequence); under the
        interpreter (BY_SUM) an elementwise product summed over K in order, since numpy's
        matmul (BLAS) gives a row other bits when it sits at another row of the tile."""
        if BY_SUM:
            out = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        elif IEEE:
            out = tl.dot(a, b, acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc)
        return out

    @triton.jit
    def _tile_of(M, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        # this program's (row tile, column tile) in grouped order: GROUP_M row tiles sweep the
        # column tiles together, so W stays in L2
        pid = tl.program_id(0)
        n_m = tl.cdiv(M, BM)
        n_n = tl.cdiv(N, BN)
        per_group = GROUP_M * n_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m

    @triton.jit
    def _epilogue(acc, C, Y, offs_m, offs_n, M, N: tl.constexpr, stride_cm, stride_ym, HAS_C: tl.constexpr):
        # + c in fp32 (cuBLAS's beta = 1), one rounding to Y's dtype
        omask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if HAS_C:
            acc += tl.load(C + offs_m[:, None] * stride_cm + offs_n[None, :], mask=omask,
                           other=0.0).to(tl.float32)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=omask)

    @triton.jit(do_not_specialize=["M"])
    def _mm_kernel(X, W, C, Y, M, stride_xm, stride_wn, stride_cm, stride_ym,
                   N: tl.constexpr, K: tl.constexpr, HAS_C: tl.constexpr, IEEE: tl.constexpr, BY_SUM: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr):
        pid_m, pid_n = _tile_of(M, N, BM, BN, GROUP_M)
        offs_m = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        offs_n = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        mmask = offs_m < M
        nmask = offs_n < N
        xp = X + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
        wp = W + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN] = W^T tile
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):  # one K order for every row, one accumulator
            if EVEN_K:  # no K tail: the same values as the masked load, fewer predicates
                a = tl.load(xp, mask=mmask[:, None], other=0.0)
                b = tl.load(wp, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < K - k0
                a = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(wp, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = dot_invariant(a, b, acc, IEEE, BY_SUM)
            xp += BK
            wp += BK
        _epilogue(acc, C, Y, offs_m, offs_n, M, N, stride_cm, stride_ym, HAS_C)

    @triton.jit(do_not_specialize=["M"])
    def _mm_tma_kernel(x_desc, w_desc, C, Y, M, stride_cm, stride_ym,
                       N: tl.constexpr, K: tl.constexpr, HAS_C: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        # _mm_kernel's sums with the tiles brought in by the tensor-memory accelerator (rows and
        # K past the ends read as zeros, as the masked loads do): the same K order, so the
        # same bits (bench/exact_tiles.py checks it on the device)
        pid_m, pid_n = _tile_of(M, N, BM, BN, GROUP_M)
        m0 = pid_m * BM
        n0 = pid_n * BN
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            a = x_desc.load([m0, k0])  # [BM, BK]
            b = w_desc.load([n0, k0])  # [BN, BK]
            acc = tl.dot(a, b.T, acc)
        _epilogue(acc, C, Y, m0.to(tl.int64) + tl.arange(0, BM), n0.to(tl.int64) + tl.arange(0, BN), M, N,
                  stride_cm, stride_ym, HAS_C)


def _tma_ok(x, w) -> bool:
    # the descriptor's rules: 16-byte aligned bases and row strides
    e = x.element_size()
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * e) % 16 == 0 for t in (x, w))


def _check(x, w, c, out):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"mm: x must be [M, K] and w [N, K], got {list(x.shape)} and {list(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"mm: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    shape = (x.shape[0], w.shape[0])
    for name, t in (("c", c), ("out", out)):
        if t is not None and (t.shape != shape or t.dtype != x.dtype):
            raise ValueError(f"mm: {name} must be {x.dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def config_for(M: int, N: int, K: int) -> tuple:
    """The tiles of an [M, K] x [K, N] product: by M and N where K is a multiple of 128 (no
    K tail in any of CONFIGS' tiles; bit-equal on the H200 at every Qwen3 weight shape,
    bench/results/exact_tiles.json, and at K = 256), else one configuration for every M (at
    K = 96, a tail, the tiles by M gave 11% of the engine's tokens other bits than the
    trainer's: bench/results/exact_variants_tiny.json)."""
    if interpreting():
        return _INTERPRET_CONFIG
    if K % 128:
        return ONE_CONFIG
    return next(c for m, n, c in CONFIGS if M <= m and N <= n)


def mm_triton(x, w, c=None, out=None):
    M, K = x.shape
    N = w.shape[0]
    y = out if out is not None else torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if c is not None and c.stride(1) != 1:
        c = c.contiguous()
    if y.stride(1) != 1:
        raise ValueError("mm: out must have a unit column stride")
    BM, BN, BK, GM, warps, stages, tma = config_for(M, N, K)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    cc, sc = (c, c.stride(0)) if c is not None else (y, 0)
    if tma and x.dtype != torch.float32 and _tma_ok(x, w):
        _mm_tma_kernel[grid](TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK]),
                             cc, y, M, sc, y.stride(0), N=N, K=K, HAS_C=c is not None, BM=BM, BN=BN, BK=BK,
                             GROUP_M=GM, num_warps=warps, num_stages=stages)
    else:
        _mm_kernel[grid](x, w, cc, y, M, x.stride(0), w.stride(0), sc, y.stride(0), N=N, K=K,
                         HAS_C=c is not None, IEEE=x.dtype == torch.float32, BY_SUM=interpreting(), BM=BM, BN=BN,
                         BK=BK, GROUP_M=GM, EVEN_K=K % BK == 0, num_warps=warps, num_stages=stages)
    return y


def mm_ref(x, w, c=None, out=None):
    M, K = x.shape
    N = w.shape[0]
    y = out if out is not None else torch.empty(M, N, device=x.device, dtype=x.dtype)
    xf, wf = x.float(), w.float()
    kp = 1 << max(K - 1, 0).bit_length()
    bn = max(1, min(N, _REF_ELEMS // kp))
    bm = max(1, _REF_ELEMS // (bn * kp))
    for n0 in range(0, N, bn):
        wb = wf[None, n0:n0 + bn]  # [1, bn, K]
        for m0 in range(0, M, bm):
            acc = tree_sum(xf[m0:m0 + bm, None, :] * wb)  # [bm, bn]
            if c is not None:
                acc = acc + c[m0:m0 + bm, n0:n0 + bn].float()
            y[m0:m0 + bm, n0:n0 + bn] = acc.to(y.dtype)
    return y


@dispatch(mm_triton, mm_ref, on="x")
def mm(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None,
       out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] (a weight as stored, [out, in]), c: [M, N] or None -> x w^T + c in
    x's dtype, written to `out` when given (out may be c itself: each element is read, then
    written, by one program). A row's result depends on that row of x, w and c only."""
    _check(x, w, c, out)
