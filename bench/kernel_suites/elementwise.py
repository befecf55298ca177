"""The memory-bound ops of the training path (RMSNorm, RoPE, SwiGLU, embedding), forward and
backward, on Qwen3-0.6B shapes at 32 x 1024 tokens, bf16: the Triton kernel against its twin
run by torch eager and by torch.compile, and against the copy bandwidth measured in the same run.

GB/s counts the minimal traffic: every input read once, every output written once (the
embedding touches only the rows of the distinct ids: read them in the forward, read and write
them in fp32 in the backward). Times are medians of `triton.testing.do_bench` after warm-up.

    python bench/kernel_bench.py --only elementwise
    python bench/kernel_suites/elementwise.py          # this suite alone, a table
    python bench/kernel_suites/elementwise.py --static # no GPU: rmsnorm backward registers
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

N = 32 * 1024  # tokens
HIDDEN, HQ, HK, HEAD_DIM, INTER, VOCAB = 1024, 16, 8, 128, 3072, 151936
THETA, EPS = 1e6, 1e-6


def _time(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _time_compiled(twin, args):
    """torch.compile of the twin, or None when compiling (or running it) fails."""
    try:
        import torch._dynamo

        torch._dynamo.reset()
        fn = torch.compile(twin, dynamic=False)
        fn(*args)
        return _time(lambda: fn(*args))
    except Exception as e:  # noqa: BLE001 - a peer that cannot compile is reported as None
        print(f"torch.compile({twin.__name__}) failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None


def _cases():
    """(name, kernel, twin, args, bytes) for every op and direction."""
    from rlcu.model.rope import RopeSpec, inv_freq
    from rlcu.ops import embedding, rmsnorm, rope, swiglu

    bf, dev = torch.bfloat16, "cuda"
    e = 2  # bytes of a bf16 element
    torch.manual_seed(0)
    cases = []

    for tag, rows, D in (("hidden", N, HIDDEN), ("qnorm", N * HQ, HEAD_DIM)):
        x = torch.randn(rows, D, device=dev, dtype=bf)
        dy = torch.randn(rows, D, device=dev, dtype=bf)
        w = (1 + 0.1 * torch.randn(D, device=dev)).to(bf)
        _, rstd = rmsnorm.rmsnorm_fwd_ref(x, w, EPS)
        shape = f"{rows}x{D}"
        cases.append((f"rmsnorm_{tag}_fwd[{shape}]", rmsnorm.rmsnorm_fwd_triton, rmsnorm.rmsnorm_fwd_ref,
                      (x, w, EPS), 2 * rows * D * e + D * e + rows * 4))
        cases.append((f"rmsnorm_{tag}_bwd[{shape}]", rmsnorm.rmsnorm_bwd_triton, rmsnorm.rmsnorm_bwd_ref,
                      (dy, x, w, rstd), 3 * rows * D * e + D * e + rows * 4 + D * 4))

    cu = torch.arange(0, N + 1, 1024, device=dev, dtype=torch.int32)
    pos = rope.positions_from_cu_seqlens(cu, N)
    f = inv_freq(RopeSpec(theta=THETA), HEAD_DIM, dev)
    for tag, H in (("q", HQ), ("k", HK)):
        x = torch.randn(N, H, HEAD_DIM, device=dev, dtype=bf)
        nbytes = 2 * N * H * HEAD_DIM * e + N * 4
        shape = f"{N}x{H}x{HEAD_DIM}"
        cases.append((f"rope_{tag}_fwd[{shape}]", rope.rope_fwd_triton, rope.rope_fwd_ref, (x, pos, f), nbytes))
        cases.append((f"rope_{tag}_bwd[{shape}]", rope.rope_bwd_triton, rope.rope_bwd_ref, (x, pos, f), nbytes))

    gu = torch.randn(N, 2 * INTER, device=dev, dtype=bf)
    da = torch.randn(N, INTER, device=dev, dtype=bf)
    shape = f"{N}x{2 * INTER}"
    cases.append((f"swiglu_fwd[{shape}]", swiglu.swiglu_fwd_triton, swiglu.swiglu_fwd_ref, (gu,),
                  3 * N * INTER * e))
    cases.append((f"swiglu_bwd[{shape}]", swiglu.swiglu_bwd_triton, swiglu.swiglu_bwd_ref, (da, gu),
                  5 * N * INTER * e))

    W = torch.randn(VOCAB, HIDDEN, device=dev, dtype=bf)
    dW = torch.zeros(VOCAB, HIDDEN, device=dev, dtype=torch.float32)  # the flat fp32 grads
    ids = torch.randint(0, VOCAB, (N,), device=dev)
    dx = torch.randn(N, HIDDEN, device=dev, dtype=bf)
    U = int(ids.unique().numel())
    shape = f"{N}x{HIDDEN} of {VOCAB}"
    cases.append((f"embedding_fwd[{shape}]", embedding.embedding_fwd_triton, embedding.embedding_fwd_ref,
                  (ids, W), N * 8 + U * HIDDEN * e + N * HIDDEN * e))
    cases.append((f"embedding_bwd[{shape}]", embedding.embedding_bwd_triton, embedding.embedding_bwd_ref,
                  (dx, ids, dW), N * HIDDEN * e + N * 8 + 2 * U * HIDDEN * 4))
    return cases


def run(ceil: dict) -> list[dict]:
    copy = ceil["copy_GBps"]
    rows = []
    for name, kernel, twin, args, nbytes in _cases():
        ms = _time(lambda: kernel(*args))
        ms_eager = _time(lambda: twin(*args))
        ms_compile = _time_compiled(twin, args)
        gbps = nbytes / (ms * 1e-3) / 1e9
        rows.append(dict(name=name, ms=ms, ms_eager=ms_eager, ms_compile=ms_compile, GBps=gbps,
                         frac_copy_bw=gbps / copy))
    return rows


def static(dtype: str = "bf16") -> list[dict]:
    """No GPU needed: registers, spills and shared memory of the RMSNorm backward at the
    benchmark's shapes, compiled for sm_90 (bench/kernel_suites/engine_ops.py static_compile)."""
    from bench.kernel_suites.engine_ops import static_compile
    from rlcu.ops import rmsnorm

    rows = []
    for D in (HIDDEN, HEAD_DIM):
        BN, BD, num_warps, stages, maxnreg = rmsnorm._blocks_bwd(D)
        types = {n: f"*{dtype}" for n in ("DY", "X", "W", "RES", "DX")}
        types.update(RSTD="*fp32", DW_PART="*fp32", D="i32")
        for res in (False, True):  # the final norm's backward, and the layers' (with the residual)
            rows.append(dict(D=D, residual=res, **static_compile(rmsnorm._rmsnorm_bwd_kernel, types,
                                                                 dict(BN=BN, BD=BD, STAGES=stages, HAS_RES=res),
                                                                 num_warps, maxnreg=maxnreg, aligned=("D",))))
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if "--static" in sys.argv:
        for r in static("fp32" if "fp32" in sys.argv else "bf16"):
            print(r)
        sys.exit()
    from bench.common import measure_ceilings

    ceil = measure_ceilings()
    print(f"copy {ceil['copy_GBps']:.0f} GB/s")
    print(f"{'kernel':<44} {'ms':>8} {'eager':>8} {'compile':>8} {'GB/s':>7} {'of copy':>8}")
    for r in run(ceil):
        mc = "-" if r["ms_compile"] is None else f"{r['ms_compile']:.4f}"
        print(f"{r['name']:<44} {r['ms']:>8.4f} {r['ms_eager']:>8.4f} {mc:>8} {r['GBps']:>7.0f} "
              f"{r['frac_copy_bw']:>8.1%}")
