"""How fast a plain Triton kernel streams a decode projection's weights, against cuBLAS.

A decode step's projections read each weight once for 1-256 rows: weight-bound, ~1-3 us of
bytes at Qwen3-0.6B, but cuBLAS takes 5-8 us each (bench/results/profile_engine.json), and
ops/decode_linear.py's fused kernels (split-K with an inline reduce, the norm in the A path)
took longer still at 64-256 rows (bench/results/decode_linear.json). This probe asks what the
simplest weight-streaming tiling reaches: y = x W^T, a program per (row tile, BN output
columns), the whole K in its loop (no split, no reduce, no epilogue), the W tile read by
pointer loads or by a TMA descriptor; a sweep of (BN, BK, stages, warps) per shape and rows.

Each op timed as ops/decode_linear's bench times it (`common.graph_ms`: a CUDA graph of 12
back-to-back calls over 4 weight copies, so none is read from L2, median of 7 replays), cuBLAS
(`torch.mm`) in the same run; GB/s = weight bytes / time, against the copy ceiling measured in
the same run. Every candidate is checked against an fp32 reference before it is timed
(`common.rel_err`; the runs in bench/results, f1ccf79 and 2ad8520, recorded max |diff| / max |ref|).

Also the input norm (and gate_up's SwiGLU) inside the streaming kernel, with x loaded by the
compiler's order or one K step ahead by hand (XNEXT), against the engine's unfused ops
(rmsnorm, cuBLAS, swiglu). What the runs found is in bench/results (stream_gemm.json,
stream_gemm_fused.json) and in the experiment journal that README.md kept until it moved to
docs/ (`git show 903f823:README.md`, "Why the fused projections lost").

    python bench/stream_gemm.py [--shapes 0.6b 8b] [--rows 1 64 128 256] [--quick] [--fused-only]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, graph_ms, measure_ceilings, qwen3_06b_config, rel_err, write_json  # noqa: E402
from bench.decode_linear import op_shapes  # noqa: E402

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the triton build
    TensorDescriptor = None

COPIES = 4  # weight copies the timed graph cycles through (4 x the op's bytes > L2 at every shape)


@triton.jit
def _stream_kernel(X, W, w_desc, Y, M, K, stride_x, stride_w, stride_y, TMA: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # TMA: the W tile by the descriptor w_desc, else by pointer loads from W
    pm, pn = tl.program_id(0), tl.program_id(1)  # row tiles adjacent: a W slice is read once from DRAM
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        x = tl.load(X + rm[:, None] * stride_x + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        if TMA:
            w = w_desc.load([pn * BN, k])
        else:
            w = tl.load(W + rn[:, None] * stride_w + (k + rk)[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=rm[:, None] < M)


@triton.jit
def _stream_fused_kernel(X, G, W, Y, M, K, N, stride_x, stride_w, stride_y, eps, SWIGLU: tl.constexpr,
                         XNEXT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # y = rmsnorm(x; g) W^T (the A tile is x * g, the rows' sums of squares from the same loads,
    # the sums scaled by rstd at the end) and SWIGLU: W = [Wg; Wu], N the rows of each,
    # y = silu(h Wg^T) * (h Wu^T), a program's gate and up columns the same BN of [0, N).
    # XNEXT: the next K step's x tile loaded one step ahead, by hand (the compiler's pipeline
    # takes only loads that feed a dot, and x feeds the norm's arithmetic first)
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    ss = tl.zeros((BM,), dtype=tl.float32)
    xp = X + rm[:, None] * stride_x + rk[None, :]
    if XNEXT:
        x_next = tl.load(xp, mask=rm[:, None] < M, other=0.0)
    for k in range(0, K, BK):
        if XNEXT:
            x = x_next
            x_next = tl.load(xp + k + BK, mask=(rm[:, None] < M) & (k + BK + rk < K)[None, :], other=0.0)
        else:
            x = tl.load(xp + k, mask=rm[:, None] < M, other=0.0)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, 1)
        x = (xf * tl.load(G + k + rk).to(tl.float32)[None, :]).to(W.dtype.element_ty)
        acc = tl.dot(x, tl.trans(tl.load(W + rn[:, None] * stride_w + (k + rk)[None, :])), acc)
        if SWIGLU:
            acc_up = tl.dot(x, tl.trans(tl.load(W + (N + rn)[:, None] * stride_w + (k + rk)[None, :])), acc_up)
    rstd = tl.rsqrt(ss / K + eps)[:, None]
    acc *= rstd
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * (acc_up * rstd)
    tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=rm[:, None] < M)


def row_tile(M: int) -> int:
    """The row tile: M rounded up to 16 (tl.dot's least), at most 128 (two tiles at 256 rows)."""
    return min(max(16, triton.next_power_of_2(M)), 128)


def stream_gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: tuple, tma: bool = False):
    """y = x w^T with cfg = (BN, BK, stages, warps); N % BN == 0 and K % BK == 0."""
    BN, BK, stages, warps = cfg
    M, K = x.shape
    N = w.shape[0]
    BM = row_tile(M)
    grid = (triton.cdiv(M, BM), N // BN)
    desc = TensorDescriptor.from_tensor(w, [BN, BK]) if tma else None
    _stream_kernel[grid](x, w, desc, y, M, K, x.stride(0), w.stride(0), y.stride(0), TMA=tma, BM=BM, BN=BN, BK=BK,
                         num_stages=stages, num_warps=warps)
    return y


def stream_fused(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: tuple, eps: float,
                 swiglu: bool, x_next: bool = False) -> torch.Tensor:
    """y = rmsnorm(x; g) w^T, or with swiglu (w = [Wg; Wu]) silu(h Wg^T) * (h Wu^T); cfg as stream_gemm's
    (BN counts gate columns under swiglu); x_next: the kernel's XNEXT."""
    BN, BK, stages, warps = cfg
    M, K = x.shape
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    BM = row_tile(M)
    _stream_fused_kernel[(triton.cdiv(M, BM), N // BN)](x, g, w, y, M, K, N, x.stride(0), w.stride(0), y.stride(0),
                                                       eps, SWIGLU=swiglu, XNEXT=x_next, BM=BM, BN=BN, BK=BK,
                                                       num_stages=stages, num_warps=warps)
    return y


SMEM = 220 * 1024  # the H200's shared memory a block, less Triton's own


def candidates(N: int, K: int, M: int, quick: bool, pair: bool = False) -> list[tuple]:
    """(BN, BK, stages, warps) that tile N and K and whose pipeline fits in shared memory (pair:
    two W tiles a stage, SwiGLU's gate and up)."""
    bns = (32,) if quick else (16, 32, 64)
    bks = (128,) if quick else (128, 256)
    stages = (3,) if quick else (3, 5)
    warps = (4,) if quick else (4, 8)
    BM = row_tile(M)
    return [c for c in itertools.product(bns, bks, stages, warps)
            if N % c[0] == 0 and K % c[1] == 0 and c[2] * (BM + (2 if pair else 1) * c[0]) * c[1] * 2 <= SMEM]


def sweep(row: dict, run, check, cands, variants=(False,)) -> dict:
    """Time run(i, cfg, variant), i the weight copy, over the copies for each candidate tile (checked first:
    check() -> relative error); the row gets its sweep, dropped tiles and best."""
    best = None
    for var in variants:
        for c in cands:
            try:
                run(0, c, var)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a tile the SM cannot hold is dropped, with why
                row.setdefault("dropped", []).append({"config": c, "variant": var, "error": str(e)[:160]})
                continue
            err = check()
            if err > 2e-2:
                raise AssertionError(f"{row} {c} {var}: relative error {err:.3g}")
            us = 1e3 * graph_ms([lambda i=i, c=c, var=var: run(i, c, var) for i in range(COPIES)])
            row.setdefault("sweep", []).append({"config": c, "variant": var, "us": us, "rel_err": err})
            if best is None or us < best["us"]:
                best = {"config": c, "variant": var, "us": us}
    row["best"] = best
    return row


def measure(N: int, K: int, M: int, quick: bool) -> dict:
    """x W^T: cuBLAS against stream_gemm's tiles (pointer and TMA loads of W)."""
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().t()
    row = {"N": N, "K": K, "M": M, "weight_bytes": N * K * 2}
    row["cublas_us"] = 1e3 * graph_ms([lambda w=w: torch.mm(x, w.t(), out=y) for w in ws])
    return sweep(row, lambda i, c, tma: stream_gemm(x, ws[i], y, c, tma),
                 lambda: rel_err(y, ref), candidates(N, K, M, quick),
                 (False,) if TensorDescriptor is None else (False, True))


def measure_fused(op: str, N: int, K: int, M: int, quick: bool, eps: float = 1e-6) -> dict:
    """The engine's unfused ops (rmsnorm, cuBLAS, and SwiGLU for gate_up) against stream_fused's
    tiles: the norm (and SwiGLU) inside the weight-streaming kernel."""
    from rlcu.ops.rmsnorm import rmsnorm_fwd
    from rlcu.ops.swiglu import swiglu_fwd

    sw = op == "gate_up"
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    g = 1 + 0.1 * torch.randn(K, device="cuda", dtype=torch.bfloat16)
    n_out = N // 2 if sw else N
    y = torch.empty(M, n_out, device="cuda", dtype=torch.bfloat16)
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + eps) * g.float()
    ref = h @ ws[0].float().t()
    if sw:
        ref = torch.nn.functional.silu(ref[:, :n_out]) * ref[:, n_out:]

    def unfused(w):
        z = rmsnorm_fwd(x, g, eps)[0] @ w.t()
        return swiglu_fwd(z) if sw else z

    row = {"op": op + "+norm" + ("+swiglu" if sw else ""), "N": N, "K": K, "M": M, "weight_bytes": N * K * 2}
    row["unfused_us"] = 1e3 * graph_ms([lambda w=w: unfused(w) for w in ws])
    return sweep(row, lambda i, c, xn: stream_fused(x, g, ws[i], y, c, eps, sw, xn),
                 lambda: rel_err(y, ref), candidates(n_out, K, M, quick, pair=sw), (False, True))


def report_fused(op: str, N: int, K: int, M: int, shape: str, eps: float, quick: bool) -> dict:
    f = measure_fused(op, N, K, M, quick, eps)
    f["shape"] = shape
    by = {v: min((s["us"] for s in f.get("sweep", []) if s["variant"] == v), default=float("nan")) for v in (0, 1)}
    print(f"{shape:>4} {f['op']:<19} M={M:<4} unfused {f['unfused_us']:6.1f} us  fused {by[0]:6.1f} us, with x "
          f"a step ahead {by[1]:6.1f} us  (best {f['best']['config']} x_next={f['best']['variant']})", flush=True)
    return f


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["0.6b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 64, 128, 256])
    p.add_argument("--quick", action="store_true", help="one candidate a variant (a smoke run)")
    p.add_argument("--fused-only", action="store_true", help="only the fused ops against the unfused ones")
    args = p.parse_args(argv)
    ceil = measure_ceilings()
    bw = ceil["copy_GBps"]
    print(f"copy ceiling {bw:.0f} GB/s", flush=True)
    rows, fused = [], []
    for shape in args.shapes:
        cfg = qwen3_06b_config(**SHAPES[shape])
        for M in args.rows:
            tot_c = tot_s = 0.0
            for op, (N, K) in op_shapes(cfg).items():
                if args.fused_only:
                    if op in ("qkv", "gate_up"):
                        fused.append(report_fused(op, N, K, M, shape, cfg.rms_norm_eps, args.quick))
                    continue
                r = measure(N, K, M, args.quick)
                r.update(shape=shape, op=op)
                rows.append(r)
                b = r["best"]
                gbs = lambda us: r["weight_bytes"] / (us * 1e-6) / 1e9  # noqa: E731
                print(f"{shape:>4} {op:<8} M={M:<4} {N:>6}x{K:<6} cuBLAS {r['cublas_us']:6.1f} us "
                      f"({gbs(r['cublas_us']):5.0f} GB/s)  stream {b['us']:6.1f} us ({gbs(b['us']):5.0f} GB/s) "
                      f"{b['config']} tma={b['variant']}  bytes at ceiling {r['weight_bytes'] / bw / 1e3:.1f} us",
                      flush=True)
                tot_c += r["cublas_us"]
                tot_s += b["us"]
                if op in ("qkv", "gate_up"):
                    fused.append(report_fused(op, N, K, M, shape, cfg.rms_norm_eps, args.quick))
            if not args.fused_only:
                print(f"{shape:>4} layer    M={M:<4} cuBLAS {tot_c:6.1f} us, stream {tot_s:6.1f} us", flush=True)
    write_json("stream_gemm_fused.json" if args.fused_only else "stream_gemm.json",
               {"ceilings": ceil, "rows": rows, "fused": fused})
    return 0


if __name__ == "__main__":
    sys.exit(main())
