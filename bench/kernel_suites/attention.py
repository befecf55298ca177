"""Varlen causal GQA attention (rlcu.ops.attention) against torch SDPA's flash backend.

Qwen3-0.6B heads (Hq=16, Hk=8, D=128), bf16, causal, T in {1k, 2k, 4k} with B sequences of
T tokens packed (B*T = 16k). SDPA gets the same tokens as [B, H, T, D] views of [B, T, H, D]
memory (flash's native layout) and GQA natively where the backend takes it. Causal FLOPs are
counted as half: fwd = 2 * 2 * B * Hq * T^2 * D / 2, bwd = 2.5 * fwd.

    python bench/kernel_bench.py --only attention          # the suite
    python bench/kernel_suites/attention.py --sweep   # time block sizes / warps / stages per kernel
    python bench/kernel_suites/attention.py --static  # no GPU needed: compile for sm_90, print
                                                      # registers, spills and shared memory
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

Hq, Hk, D = 16, 8, 128
TOKENS = 16384
SEQLENS = (1024, 2048, 4096)


def _inputs(B: int, T: int, D: int = D, seed: int = 0):
    """q, k, v as slices of one fused qkv matrix (as the model has them), dO, cu_seqlens."""
    torch.manual_seed(seed)
    N = B * T
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : Hq * D].view(N, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(N, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(N, Hk, D)
    do = torch.randn(N, Hq, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, N + 1, T, device="cuda", dtype=torch.int32)
    return q, k, v, do, cu


def _flops_fwd(B: int, T: int, D: int = D) -> float:
    return 2 * 2 * B * Hq * T * T * D / 2


def _sdpa(q, k, v, do, B, T):
    """(fwd, fwd+bwd) closures for SDPA flash, its output, and how GQA was given to it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def bhtd(x):  # [N, H, D] -> [B, H, T, D] view of [B, T, H, D] memory
        return x.contiguous().view(B, T, x.shape[1], x.shape[2]).transpose(1, 2)

    qs, ks, vs, dos = bhtd(q), bhtd(k), bhtd(v), bhtd(do)
    scale = q.shape[-1] ** -0.5
    gqa = "native"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = sdpa(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    except RuntimeError:  # the flash backend refuses GQA: give it expanded heads
        gqa = "expanded"
        ks, vs = (bhtd(x.repeat_interleave(Hq // Hk, 1)) for x in (k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = sdpa(qs, ks, vs, is_causal=True, scale=scale)
    kw = dict(is_causal=True, scale=scale, **({"enable_gqa": True} if gqa == "native" else {}))
    leaves = [x.detach().requires_grad_() for x in (qs, ks, vs)]

    def fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(qs, ks, vs, **kw)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa(*leaves, **kw).backward(dos)

    return fwd, fwd_bwd, leaves, o.transpose(1, 2).reshape(q.shape), gqa


def _ours(q, k, v, do, cu, T):
    from rlcu.ops.attention import attention_bwd, attention_fwd

    scale = q.shape[-1] ** -0.5

    def fwd():
        return attention_fwd(q, k, v, cu, T, scale)

    def fwd_bwd():
        o, lse = attention_fwd(q, k, v, cu, T, scale)
        return attention_bwd(do, q, k, v, o, lse, cu, T, scale)

    return fwd, fwd_bwd


def run(ceil: dict) -> list[dict]:
    from triton.testing import do_bench

    from rlcu.ops.attention import attention_fwd

    peak = ceil.get("bf16_matmul_TFLOPs")
    rows = []
    for T in SEQLENS:
        B = TOKENS // T
        q, k, v, do, cu = _inputs(B, T)
        f_ours, fb_ours = _ours(q, k, v, do, cu, T)
        f_sdpa, fb_sdpa, leaves, o_sdpa, gqa = _sdpa(q, k, v, do, B, T)
        err = float((attention_fwd(q, k, v, cu, T, D**-0.5)[0].float() - o_sdpa.float()).norm()
                    / o_sdpa.float().norm())
        for what, mine, theirs, mult, grads in (("fwd", f_ours, f_sdpa, 1.0, None),
                                                 ("fwd+bwd", fb_ours, fb_sdpa, 3.5, leaves)):
            ms = do_bench(mine, warmup=25, rep=100, return_mode="median")
            ms_sdpa = do_bench(theirs, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
            flops = mult * _flops_fwd(B, T)
            row = dict(name=f"attention {what} T={T} B={B}", ms=ms, ms_sdpa=ms_sdpa,
                       tflops=flops / ms * 1e-9, tflops_sdpa=flops / ms_sdpa * 1e-9,
                       speedup=ms_sdpa / ms, sdpa_gqa=gqa, rel_err_o_vs_sdpa=err)
            if peak:
                row["frac_matmul_peak"] = row["tflops"] / peak
            rows.append(row)
        del q, k, v, do, leaves, o_sdpa
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------ config sweep
_SPACE = {
    "fwd": [(bm, bn) for bm in (64, 128) for bn in (32, 64, 128) if bm % bn == 0],  # (BM, BN)
    "dkdv": [(bn, bm) for bn in (64, 128) for bm in (16, 32, 64) if bn % bm == 0],  # (BN, BM)
    "dq": [(bm, bn) for bm in (64, 128) for bn in (16, 32, 64) if bm % bn == 0],  # (BM, BN)
}
_WARPS = (4, 8)
_STAGES = {"fwd": (2, 3, 4), "dkdv": (1, 2, 3), "dq": (1, 2, 3)}


def sweep(kinds, dims, T: int = 2048) -> list[dict]:
    """Time every candidate config of each kernel, one kernel's table entry changed at a time
    (the forward alone for 'fwd', the whole backward for 'dkdv' and 'dq')."""
    from triton.testing import do_bench

    import rlcu.ops.attention as attn

    B = TOKENS // T
    out = []
    for Dh in dims:
        q, k, v, do, cu = _inputs(B, T, D=Dh)
        scale = Dh**-0.5
        o, lse = attn.attention_fwd(q, k, v, cu, T, scale)
        BD = max(16, 1 << (Dh - 1).bit_length())
        key = min(d for d in attn.CONFIGS["fwd"] if d >= BD)
        for kind in kinds:
            default = attn.CONFIGS[kind][key]
            flops = _flops_fwd(B, T, Dh) * (1.0 if kind == "fwd" else 2.5)
            if kind == "fwd":
                fn = lambda: attn.attention_fwd(q, k, v, cu, T, scale)  # noqa: E731
            else:
                fn = lambda: attn.attention_bwd(do, q, k, v, o, lse, cu, T, scale)  # noqa: E731
            results = []
            for (a, b), w, s in itertools.product(_SPACE[kind], _WARPS, _STAGES[kind]):
                attn.CONFIGS[kind][key] = (a, b, w, s)
                try:
                    ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
                except Exception as e:  # out of shared memory / registers: not a candidate
                    print(f"  D={Dh} {kind} {(a, b, w, s)}: {type(e).__name__}", file=sys.stderr)
                    continue
                results.append(dict(kind=kind, D=Dh, config=[a, b, w, s], ms=ms, tflops=flops / ms * 1e-9,
                                    default=(a, b, w, s) == tuple(default)))
            attn.CONFIGS[kind][key] = default
            results.sort(key=lambda r: r["ms"])
            for r in results[:5] + [r for r in results[5:] if r["default"]]:
                print(f"D={Dh} {kind:<5} {str(tuple(r['config'])):<20} {r['ms']:8.3f} ms "
                      f"{r['tflops']:6.1f} TFLOP/s{'  (default)' if r['default'] else ''}")
            out += results
    return out


def static(kinds, dims, dtype: str = "bf16", arch: int = 90) -> list[dict]:
    """Compile each kernel's configs ahead of time for sm_<arch> (no GPU needed) and read the
    cubin's registers, spill stack and shared memory: configs that spill or overflow shared
    memory are poor candidates. Pointers and strides are taken as 16-byte aligned, as the
    runtime specialises them for the model's tensors."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import rlcu.ops.attention as attn

    kernels = {"fwd": attn._attn_fwd_kernel, "dkdv": attn._attn_bwd_dkdv_kernel, "dq": attn._attn_bwd_dq_kernel}
    tile_names = {"fwd": ("BM", "BN"), "dkdv": ("BN", "BM"), "dq": ("BM", "BN")}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = []
    for kind, Dh in itertools.product(kinds, dims):
        fn = kernels[kind]
        BD = max(16, 1 << (Dh - 1).bit_length())
        sig, attrs = {}, {}
        for i, n in enumerate(fn.arg_names):
            if n in ("G", "D", "BM", "BN", "BD"):
                sig[n] = "constexpr"
            elif n in ("LSE", "DELTA"):
                sig[n] = "*fp32"
            elif n == "CU":
                sig[n] = "*i32"
            elif n.isupper() and n not in ("N", "S"):  # Q, K, V, O, DO, DK, DV, DQ
                sig[n] = "*" + dtype
            elif n in ("qk_scale", "scale"):
                sig[n] = "fp32"
            else:
                sig[n] = "i32"
            if sig[n].startswith("*") or n.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        for (a, b), w, s in itertools.product(_SPACE[kind], _WARPS, _STAGES[kind]):
            consts = {"G": 2, "D": Dh, "BD": BD, tile_names[kind][0]: a, tile_names[kind][1]: b}
            src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs)
            row = dict(kind=kind, D=Dh, dtype=dtype, config=[a, b, w, s])
            try:
                k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=w, num_stages=s))
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
                m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
                row.update(regs=int(m.group(1)), spill_stack=int(m.group(2)), shared=k.metadata.shared)
            except Exception as e:
                row.update(error=f"{type(e).__name__}: {str(e)[:120]}")
            print(row, flush=True)
            out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time the config candidates of each kernel")
    ap.add_argument("--static", action="store_true", help="compile the candidates for sm_90, no GPU")
    ap.add_argument("--dtype", default="bf16", help="--static: bf16 or fp32")
    ap.add_argument("--kinds", default="fwd,dkdv,dq")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--T", type=int, default=2048)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.common import write_json

    if args.static:
        static(args.kinds.split(","), [int(d) for d in args.dims.split(",")], args.dtype)
    elif args.sweep:
        res = sweep(args.kinds.split(","), [int(d) for d in args.dims.split(",")], args.T)
        write_json("attention_sweep.json", {"T": args.T, "tokens": TOKENS, "results": res})
    else:
        for r in run({}):
            print(r)


if __name__ == "__main__":
    main()
