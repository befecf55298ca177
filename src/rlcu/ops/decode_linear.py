"""The decode layer's projections with their neighbours fused in, for a few rows (M <= 256):

    y = rmsnorm(x; g) W^T              (the input norm and qkv; the post norm and ...)
    y = swiglu(rmsnorm(x; g) Wgu^T)    (... gate_up with SwiGLU: a = silu(h Wg^T) * (h Wu^T))
    r += x W^T                         (o and down, on the residual in place)

A decode step's GEMMs read each weight once for 1-256 rows: they are weight-bound, and at
these sizes cuBLAS (or any one-kernel-per-op sequence) spends most of a layer between
launches and in ramp-up, several times what its weight bytes take at copy bandwidth
(bench/results/exact_tiles.json, stream_gemm.json). This kernel takes the norm and SwiGLU, two launches
of a layer each, into the GEMMs, and splits N finely (and K where N is small) so that every
SM streams weights.

The norm, in one pass over K: with rstd = rsqrt(mean(x^2) + eps) a row's factor,
rmsnorm(x; g) W^T = rstd * ((x * g) W^T), so the A tile is x * g (rounded to the weights'
dtype) and the sum of squares is taken from the same loads; the accumulator is scaled by
rstd at the end. (The unfused path rounds x * rstd to bf16 first: the two differ by one
rounding of the product, so this is not exact mode's op; exact mode never runs it.)

Split-K (SPLIT > 1): each program writes fp32 partial sums (and its rows' partial sums of
squares) to a workspace, and the SPLIT partials of a tile are added in a fixed order before the
epilogue (scale, SwiGLU, residual): deterministic. Where (CONFIGS["inline_reduce"], the
default) the program that finishes a tile last adds them, in the same kernel: after its
partials, each program passes a CTA barrier and adds one to its tile's counter (an acq_rel
atomic, the release of every thread's stores); the one that brings it to SPLIT reads the
partials through L2 (`.cg`) in split order, runs the epilogue and puts the counter back to 0.
The counters are one zeroed buffer a device (`_counters`), kept at zero by the kernels
themselves, so two such launches must not run at once on two streams (the engine runs its
layers on one; the bench's two-stream variant turns the inline reduce off). Otherwise (or
while a CUDA graph is captured before the buffer exists, or with more tiles than it holds) a
second kernel, `_reduce_kernel`, adds the partials.

PDL (CONFIGS["pdl"], Hopper and later): the kernel is launched with programmatic stream
serialisation, so that it may start while the kernel before it drains; it prefetches its
weight slice into L2 and then waits (griddepcontrol.wait: the kernel before has finished and
its writes are visible) before reading x or writing anything. Its programs signal
launch_dependents as they begin, so the projection after it (PDL-launched too) may start in
its last wave; a kernel launched without PDL after it waits for it as usual.

The twin runs the unfused ops the engine ran before this one, in the same order, so that the
CPU path's numbers do not change.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import HAS_TRITON, dispatch, interpreting, tl, triton
from rlcu.ops.rmsnorm import rmsnorm_fwd
from rlcu.ops.swiglu import swiglu_fwd

gdc_wait = gdc_launch_dependents = None
if HAS_TRITON:
    try:  # triton >= 3.4: grid dependency control (programmatic dependent launch)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - depends on the triton build
        pass

MAX_M = 256  # the rows this op is tuned for (the decode graphs' batch sizes)
_LINE = 64  # bf16 elements in a 128-byte line (the L2 prefetch's unit)

# (BM, BN, BK, SPLIT, num_warps, num_stages) by (N, K, swiglu, or "qkv" for decode_qkv.py):
# the first entry whose max_M holds M (None: the unfused ops, where they measured faster);
# shapes not listed take `heuristic_config`. Filled from bench/decode_linear.py (`MEASURED`).
_ANY = 1 << 30
# bench/decode_linear.py on the H200 (bench/results/decode_linear.json, Qwen3-0.6B and 8B, rows
# 1, 64, 256): where the op beat the unfused ops (the projections of a step: 30% at one row at
# 0.6B, 4% at 64, parity at 256), else None. The op is opt-in: on the generation protocol it
# moved the throughput by +0.4% at 0.6B and +0.1% at 8B (noise; the fixed 64 x 256 case +3.7%
# and +1.2%), since the GEMMs of our own are slower than cuBLAS at 64-256 rows of the larger
# shapes, so the table sends most of a busy step back to cuBLAS.
MEASURED = {
    (4096, 1024, "qkv"): [(1, (16, 0, 128, 4, 4, 4)), (64, None), (_ANY, None)],
    (1024, 2048, False): [(1, (16, 32, 128, 4, 4, 4)), (64, (64, 32, 64, 4, 4, 6)), (_ANY, None)],
    (3072, 1024, True): [(1, (16, 128, 64, 4, 4, 6)), (64, None), (_ANY, None)],
    (1024, 3072, False): [(1, (16, 64, 128, 8, 4, 6)), (64, (64, 32, 128, 4, 4, 4)), (_ANY, None)],
    (6144, 4096, "qkv"): [(1, None), (64, None), (_ANY, None)],
    (4096, 4096, False): [(1, (16, 64, 128, 2, 4, 6)), (64, None), (_ANY, None)],
    (12288, 4096, True): [(1, None), (64, None), (_ANY, None)],
    (4096, 12288, False): [(1, (16, 128, 128, 4, 4, 4)), (64, (64, 64, 128, 2, 4, 6)), (_ANY, None)],
}
CONFIGS: dict = {
    "enabled": False,  # the engine's layers use this op for steps of <= MAX_M tokens (fused_for)
    "table": MEASURED,
    "pdl": False,  # launch with programmatic dependent launch (see the module docstring)
    "prefetch": True,  # with pdl: prefetch the weight slice into L2 before the wait
    "inline_reduce": True,  # split-K's partials added by the tile's last program, not a second kernel
}
_COUNTERS: dict = {}  # device -> int32 tile counters, zero between launches (inline reduce)
_MAX_TILES = 1 << 16
_INTERPRET_CONFIG = (16, 16, 32, 1, 4, 1)
_TARGET_PROGRAMS = 128  # about one program an SM: the split-K factor grows until the grid has this many


@triton.jit
def _prefetch_l2(W, stride_w, rows, k_lo, k_len, K, KL: tl.constexpr, LINE: tl.constexpr):
    # one L2 prefetch per 128-byte line of W[rows, k_lo : k_lo + k_len]; lines past the slice or
    # past K prefetch the row's start instead (a valid address)
    lines = tl.arange(0, KL) * LINE
    cols = tl.where((lines < k_len) & (k_lo + lines < K), k_lo + lines, 0)
    ptrs = W + rows[:, None].to(tl.int64) * stride_w + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # IEEE: fp32 inputs (the CPU tests), and every input under the interpreter, whose
    # bf16 tl.dot gives garbage (triton 3.6): there the tiles are widened to fp32 first
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _epilogue(acc, acc_up, ss, R, Y, offs_m, offs_n, M, N, K, stride_r, stride_y, eps,
              NORM: tl.constexpr, SWIGLU: tl.constexpr, RES: tl.constexpr):
    # acc (and acc_up): the fp32 [BM, BN] sums; ss: the rows' sums of squares of x
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)
        acc = acc * rstd[:, None]
        if SWIGLU:
            acc_up = acc_up * rstd[:, None]
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if RES:
        acc += tl.load(R + offs_m[:, None] * stride_r + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_split(acc, acc_up, ss, P, PSS, s, offs_m, offs_n, mask, mmask, M, width, pair_off, stride_pss,
               NORM: tl.constexpr, PAIR: tl.constexpr, CACHE: tl.constexpr):
    # split s's partials added to (acc, acc_up, ss)
    pp = P + (s * M + offs_m[:, None]) * width + offs_n[None, :]
    acc += tl.load(pp, mask=mask, other=0.0, cache_modifier=CACHE)
    if PAIR:
        acc_up += tl.load(pp + pair_off, mask=mask, other=0.0, cache_modifier=CACHE)
    if NORM:
        ss += tl.load(PSS + s * stride_pss + offs_m, mask=mmask, other=0.0, cache_modifier=CACHE)
    return acc, acc_up, ss


@triton.jit
def _sum_partials(P, PSS, offs_m, offs_n, M, n_valid, width, pair_off, SPLIT, stride_pss, NORM: tl.constexpr,
                  PAIR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CACHE: tl.constexpr, UNROLL: tl.constexpr):
    # the SPLIT partials (rows of `width`, the pair's second tile pair_off columns on) of rows
    # offs_m, columns offs_n (< n_valid), in split order (the same bits every replay); the
    # partial sums of squares from PSS[s * stride_pss + m]; CACHE: the loads' cache modifier
    # (".cg": through L2); UNROLL (SPLIT a constexpr): the loop unrolled, so that every split's
    # loads are in flight together
    mmask = offs_m < M
    mask = mmask[:, None] & (offs_n < n_valid)[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    if UNROLL:
        for s in tl.static_range(SPLIT):
            acc, acc_up, ss = _add_split(acc, acc_up, ss, P, PSS, s, offs_m, offs_n, mask, mmask, M, width, pair_off,
                                         stride_pss, NORM, PAIR, CACHE)
    else:
        for s in range(SPLIT):
            acc, acc_up, ss = _add_split(acc, acc_up, ss, P, PSS, s, offs_m, offs_n, mask, mmask, M, width, pair_off,
                                         stride_pss, NORM, PAIR, CACHE)
    return acc, acc_up, ss


@triton.jit
def _pdl_begin(W, stride_w, rows_w, pair_off, k_lo, K_SPLIT, K, PAIR: tl.constexpr, PREFETCH: tl.constexpr,
               KL: tl.constexpr, LINE: tl.constexpr):
    # the next kernel, if PDL-launched too (the layer's next projection), may start once every
    # program here has begun: its weight prefetch then runs in this kernel's tail
    gdc_launch_dependents()
    if PREFETCH:  # the weights do not depend on the kernel before: fetch them while it drains
        _prefetch_l2(W, stride_w, rows_w, k_lo, K_SPLIT, K, KL, LINE)
        if PAIR:
            _prefetch_l2(W, stride_w, rows_w + pair_off, k_lo, K_SPLIT, K, KL, LINE)
    gdc_wait()


@triton.jit
def _mainloop(X, W, G, offs_m, mmask, rows_w, pair_off, k_lo, K, K_SPLIT, stride_x, stride_w, NORM: tl.constexpr,
              PAIR: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # rows offs_m of X (normed by G inside: the A tile is x * g, the rows' sums of squares from
    # the same loads) times W rows rows_w (and rows_w + pair_off: PAIR), K from k_lo, K_SPLIT
    # of it -> (acc, acc_up, ss), fp32
    offs_k = tl.arange(0, BK)
    xp = X + offs_m[:, None] * stride_x + (k_lo + offs_k)[None, :]  # [BM, BK]
    wp = W + rows_w[None, :] * stride_w + (k_lo + offs_k)[:, None]  # [BK, BN]: the W^T tile
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(0, K_SPLIT, BK):
        kmask = (k_lo + k0 + offs_k) < K
        a = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            af = a.to(tl.float32)
            ss += tl.sum(af * af, 1)
            g = tl.load(G + k_lo + k0 + offs_k, mask=kmask, other=0.0).to(tl.float32)
            a = (af * g[None, :]).to(W.dtype.element_ty)
        b = tl.load(wp, mask=kmask[:, None], other=0.0)
        acc = _dot(a, b, acc, IEEE)
        if PAIR:  # the second tile of the pair: W rows pair_off further
            acc_up = _dot(a, tl.load(wp + pair_off * stride_w, mask=kmask[:, None], other=0.0), acc_up, IEEE)
        xp += BK
        wp += BK
    return acc, acc_up, ss


@triton.jit
def _split_arrive(P, PSS, CNT, acc, acc_up, ss, offs_m, offs_n, M, n_valid, width, pair_off, tile, pid_n, pid_k,
                  n_tiles, SPLIT: tl.constexpr, NORM: tl.constexpr, PAIR: tl.constexpr, INLINE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    # split-K: this program's fp32 partials to P ([split, M, width]) and PSS ([split, column
    # tiles, M]); INLINE: the tile's arrival counter CNT[tile] -> (last, acc, acc_up, ss), the
    # tile's sums where this program is the last to finish it (module docstring)
    mmask = offs_m < M
    pp = P + (pid_k * M + offs_m[:, None]) * width + offs_n[None, :]
    mask = mmask[:, None] & (offs_n < n_valid)[None, :]
    tl.store(pp, acc, mask=mask)
    if PAIR:
        tl.store(pp + pair_off, acc_up, mask=mask)
    if NORM:  # each tile's own (its last program reads them); _reduce_kernel reads tile 0's
        if INLINE or pid_n == 0:
            tl.store(PSS + (pid_k * n_tiles + pid_n) * M + offs_m, ss, mask=mmask)
    last = False
    if INLINE:
        tl.debug_barrier()  # every thread's partials stored before the release
        arrived = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT - 1
        if last:
            tl.debug_barrier()
            acc, acc_up, ss = _sum_partials(P, PSS + pid_n * M, offs_m, offs_n, M, n_valid, width, pair_off, SPLIT,
                                            n_tiles * M, NORM, PAIR, BM, BN, ".cg", True)
            tl.store(CNT + tile, 0)  # zero again for the next launch
    return last, acc, acc_up, ss


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(X, W, G, R, Y, P, PSS, CNT, M, N, K, K_SPLIT, stride_x, stride_w, stride_r, stride_y, eps,
                   NORM: tl.constexpr, SWIGLU: tl.constexpr, RES: tl.constexpr, PARTIAL: tl.constexpr,
                   INLINE: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                   PREFETCH: tl.constexpr, KL: tl.constexpr, LINE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    offs_n = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    mmask = offs_m < M
    k_lo = pid_k * K_SPLIT
    rows_w = tl.where(offs_n < N, offs_n, 0)  # clamped: the prefetch and loads never leave W
    if PDL:  # the up half of [Wg; Wu] is N rows on
        _pdl_begin(W, stride_w, rows_w, N, k_lo, K_SPLIT, K, SWIGLU, PREFETCH, KL, LINE)
    acc, acc_up, ss = _mainloop(X, W, G, offs_m, mmask, rows_w, N, k_lo, K, K_SPLIT, stride_x, stride_w, NORM,
                                SWIGLU, IEEE, BM, BN, BK)
    if not PARTIAL:
        _epilogue(acc, acc_up, ss, R, Y, offs_m, offs_n, M, N, K, stride_r, stride_y, eps, NORM, SWIGLU, RES)
    else:
        n_tiles = tl.num_programs(0)
        last, acc, acc_up, ss = _split_arrive(P, PSS, CNT, acc, acc_up, ss, offs_m, offs_n, M, N,
                                              2 * N if SWIGLU else N, N, pid_m * n_tiles + pid_n, pid_n, pid_k,
                                              n_tiles, SPLIT, NORM, SWIGLU, INLINE, BM, BN)
        if last:
            _epilogue(acc, acc_up, ss, R, Y, offs_m, offs_n, M, N, K, stride_r, stride_y, eps, NORM, SWIGLU, RES)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(P, PSS, R, Y, M, N, K, SPLIT, stride_pss, stride_r, stride_y, eps,
                   NORM: tl.constexpr, SWIGLU: tl.constexpr, RES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    offs_n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    offs_m = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    acc, acc_up, ss = _sum_partials(P, PSS, offs_m, offs_n, M, N, 2 * N if SWIGLU else N, N, SPLIT, stride_pss, NORM,
                                    SWIGLU, BM, BN, "", False)
    _epilogue(acc, acc_up, ss, R, Y, offs_m, offs_n, M, N, K, stride_r, stride_y, eps, NORM, SWIGLU, RES)


def fused_for(M: int) -> bool:
    """Whether the engine's forward of an M-token step runs its projections through this op:
    CONFIGS["enabled"] and M <= MAX_M (decode steps and small mixed ones; prefill keeps cuBLAS)."""
    return bool(CONFIGS["enabled"]) and M <= MAX_M


def row_tile(M: int) -> int:
    """The row tile of an M-row step: M's power of two, 16 to 64."""
    return max(16, min(64, triton.next_power_of_2(M)))


def split_for(programs: int, K: int, BK: int = 128) -> int:
    """The split-K factor of a grid of `programs` tiles: doubled until about one program an SM
    (_TARGET_PROGRAMS), each split keeping two K steps or more."""
    split = 1
    while programs * split * 2 <= _TARGET_PROGRAMS and K // (split * 2) >= 2 * BK:
        split *= 2
    return split


def heuristic_config(M: int, N: int, K: int) -> tuple:
    """(BM, BN, BK, SPLIT, num_warps, num_stages) where CONFIGS["table"] has no entry: rows in
    one tile up to 64, 32 columns a program up to 64 rows (64 beyond, where the A tile's
    re-reads from L2 grow with M / BN), and K split until about one program an SM."""
    BM, BN = row_tile(M), 32 if M <= 64 else 64
    return BM, BN, 128, split_for(triton.cdiv(N, BN) * triton.cdiv(M, BM), K), 4, 4


def table_config(M: int, key: tuple, default, interpreted: tuple = _INTERPRET_CONFIG):
    """The tiles of an M-row call at CONFIGS["table"][key] (the first entry whose max M holds M;
    None: the unfused ops), else default(); `interpreted` under the interpreter."""
    if interpreting():
        return interpreted
    for max_m, cfg in CONFIGS["table"].get(key, ()):
        if M <= max_m:
            return cfg
    return default()


def config_for(M: int, N: int, K: int, swiglu: bool) -> tuple:
    return table_config(M, (N, K, swiglu), lambda: heuristic_config(M, N, K))


def launch_args(x: torch.Tensor, K: int, BK: int, split: int, warps: int, stages: int):
    """(K a program sums, a multiple of BK; the split count that gives; the keywords that this
    op's kernel and decode_qkv's take alike: SPLIT, IEEE, PDL, PREFETCH, KL, LINE and the launch
    options)."""
    k_split = triton.cdiv(triton.cdiv(K, BK), split) * BK
    split = triton.cdiv(K, k_split)
    pdl = bool(CONFIGS["pdl"]) and gdc_launch_dependents is not None and not interpreting()
    prefetch = pdl and bool(CONFIGS["prefetch"])
    kw = dict(SPLIT=split, IEEE=x.dtype == torch.float32 or interpreting(), PDL=pdl, PREFETCH=prefetch,
              KL=triton.next_power_of_2(triton.cdiv(k_split, _LINE)) if prefetch else 1, LINE=_LINE,
              num_warps=warps, num_stages=stages)
    if pdl:
        kw["launch_pdl"] = True
    return k_split, split, kw


def _check(x, w, norm_w, residual, swiglu):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"decode_linear: x must be [M, K] and w [N, K], got {list(x.shape)} and {list(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"decode_linear: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if norm_w is not None and norm_w.shape != (x.shape[1],):
        raise ValueError(f"decode_linear: norm_w must be [{x.shape[1]}], got {list(norm_w.shape)}")
    if swiglu and (w.shape[0] % 2 or residual is not None):
        raise ValueError("decode_linear: swiglu takes w = [gate; up] ([2I, K]) and no residual")
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    if residual is not None and (residual.shape != (x.shape[0], n) or residual.dtype != x.dtype):
        raise ValueError(f"decode_linear: residual must be {x.dtype} [{x.shape[0]}, {n}], "
                         f"got {residual.dtype} {list(residual.shape)}")


def decode_linear_triton(x, w, norm_w=None, eps=1e-6, residual=None, swiglu=False, cfg=None):
    M, K = x.shape
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    y = residual if residual is not None else torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    if y.stride(1) != 1:
        raise ValueError("decode_linear: residual must have a unit column stride")
    cfg = cfg or config_for(M, N, K, swiglu)
    if cfg is None:  # the table's word: the unfused ops (cuBLAS) are faster at this shape and M
        return decode_linear_ref(x, w, norm_w, eps, residual, swiglu)
    BM, BN, BK, split, warps, stages = cfg
    k_split, split, kw = launch_args(x, K, BK, split, warps, stages)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM), split)
    part = pss = y  # not read unless split > 1 (and the norm's partial sums only with the norm)
    cnt = _counters(x.device, grid[0] * grid[1]) if split > 1 and CONFIGS["inline_reduce"] else None
    if split > 1:
        part = torch.empty(split, M, 2 * N if swiglu else N, device=x.device, dtype=torch.float32)
        if norm_w is not None:
            pss = torch.empty(split, grid[0], M, device=x.device, dtype=torch.float32)
    g = norm_w if norm_w is not None else x
    r = residual if residual is not None else y
    meta = dict(NORM=norm_w is not None, SWIGLU=swiglu, RES=residual is not None)
    _linear_kernel[grid](x, w, g, r, y, part, pss, cnt if cnt is not None else y, M, N, K, k_split, x.stride(0),
                         w.stride(0), r.stride(0), y.stride(0), eps, PARTIAL=split > 1, INLINE=cnt is not None,
                         BM=BM, BN=BN, BK=BK, **meta, **kw)
    if split > 1 and cnt is None:
        RBN = min(128, triton.next_power_of_2(N))
        RBM = max(1, min(triton.next_power_of_2(M), 4096 // RBN))
        _reduce_kernel[(triton.cdiv(N, RBN), triton.cdiv(M, RBM))](part, pss, r, y, M, N, K, split, grid[0] * M,
                                                                  r.stride(0), y.stride(0), eps, BM=RBM, BN=RBN,
                                                                  num_warps=4, **meta)
    return y


def _counters(device: torch.device, tiles: int):
    """The device's inline-reduce tile counters (int32, zero between launches: each tile's last
    program puts its counter back), or None: more tiles than they hold, or a CUDA graph being
    captured before they exist (a capture does not run the zeroing; the reduce kernel then
    serves that call, and an eager call, such as a graph's warm-up run, creates them)."""
    if tiles > _MAX_TILES:
        return None
    key = (device.type, device.index)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[key] = torch.zeros(_MAX_TILES, device=device, dtype=torch.int32)
    return _COUNTERS[key]


def decode_linear_ref(x, w, norm_w=None, eps=1e-6, residual=None, swiglu=False, cfg=None):
    h = rmsnorm_fwd(x, norm_w, eps)[0] if norm_w is not None else x
    if residual is not None:
        return residual.addmm_(h, w.t())
    y = h @ w.t()
    return swiglu_fwd(y) if swiglu else y


@dispatch(decode_linear_triton, decode_linear_ref, on="x")
def decode_linear(x, w, norm_w=None, eps=1e-6, residual=None, swiglu=False, cfg=None):
    """x [M, K], w [N, K] (swiglu: [2I, K], gate rows then up rows), norm_w [K] or None ->
    rmsnorm(x; norm_w) w^T [M, N] (swiglu: silu(h Wg^T) * (h Wu^T), [M, I]); with residual
    [M, N]: residual += x w^T in place, returned. cfg: a (BM, BN, BK, SPLIT, warps, stages)
    to use instead of config_for's (the benchmark's sweep)."""
    _check(x, w, norm_w, residual, swiglu)
