"""Fused LM-head logprob (rlcu.ops.logprob) and flat AdamW (rlcu.ops.adamw) against PyTorch.

(a) N = 32 x 1024 tokens, D = 1024, V = 151936 (Qwen3-0.6B's head), bf16. The peer is the
naive path `logits = h @ W.T; logits.float().log_softmax(-1).gather(...)` in eager mode and
under torch.compile, with its autograd backward; ours is logprob_fwd (+ logprob_bwd with a
pre-allocated dW, bf16 as autograd's, and fp32 as the trainer's grad buffer), and
logprob_fwd_bwd ("fused": the gradient computed in the forward sweep, from a grad_fn that
hands back the same upstream dlp/dent chunk by chunk). Peak memory is the
torch.cuda.max_memory_allocated delta over the inputs. The entropy variant (lp and ent,
both with upstream gradients) runs at N = 16k to keep the eager peer inside the GPU, and
against eager only (set RLCU_BENCH_COMPILE=0 to skip torch.compile altogether).
FLOPs: 2 N D V per logits GEMM; ours does 1 in the forward and 3 in the backward (the
logits are recomputed), 3 in all fused, the peer 1 and 2.

(b) AdamW over the 0.6B parameter count (596,049,920 fp32 master + bf16 working copy; fp32
grads as the trainer keeps them) against torch.optim.AdamW(fused=True) on one fp32 param,
also with the bf16 copy the peer would need. Bytes per element: ours reads p, g, m, v and
writes p, m, v, p_out (30), the peer 28 (+6 for its copy). Also grad_norm against
torch.linalg.vector_norm.

    python bench/kernel_bench.py --only logprob_adamw
    python bench/kernel_suites/logprob_adamw.py
    python bench/kernel_suites/logprob_adamw.py --sweep   # the bf16 mode's step per launch config
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

N, D, V = 32 * 1024, 1024, 151936
N_ENT = 16 * 1024
P_06B = 596_049_920  # Qwen3-0.6B, tied: 28 x 15,730,944 + 151936 x 1024 + 1024
HP = dict(lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
COMPILE = os.environ.get("RLCU_BENCH_COMPILE", "1") != "0"


def _ms(fn, grads=None):
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, grad_to_none=grads, return_mode="median")


def _peak_gib(fn) -> float:
    """Peak allocated bytes during fn() above what was allocated before, in GiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _naive_lp(h, W, tgt):
    logits = h @ W.T
    return logits.float().log_softmax(-1).gather(1, tgt[:, None])[:, 0]


def _naive_lp_ent(h, W, tgt):
    logp = (h @ W.T).float().log_softmax(-1)
    return logp.gather(1, tgt[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _logprob_rows(ceil: dict, n: int, entropy: bool) -> list[dict]:
    from rlcu.ops.logprob import logprob_bwd, logprob_fwd, logprob_fwd_bwd

    torch.manual_seed(0)
    h = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
    W = (torch.randn(V, D, device="cuda") * D**-0.5 * 3).bfloat16()
    tgt = torch.randint(0, V, (n,), device="cuda")
    dlp = torch.randn(n, device="cuda")
    dent = torch.randn(n, device="cuda") if entropy else None
    dW16 = torch.zeros(V, D, device="cuda", dtype=torch.bfloat16)
    dW32 = torch.zeros(V, D, device="cuda", dtype=torch.float32)
    hl, Wl = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    tag = f"N={n} D={D} V={V}" + (" +entropy" if entropy else "")
    peak = ceil.get("bf16_matmul_TFLOPs")
    gemm = 2 * n * D * V

    def ours_fwd():
        return logprob_fwd(h, W, tgt, 1.0, entropy)

    def ours_fwd_bwd(dW):
        def f():
            lp, ent, lse = logprob_fwd(h, W, tgt, 1.0, entropy)
            return logprob_bwd(dlp, dent, h, W, tgt, lse, dW, 1.0)
        return f

    def grad_fn(lp, ent, rows):  # the upstream gradient the other rows use, chunk by chunk
        return dlp[rows], (dent[rows] if entropy else None)

    def ours_fused(dW):
        def f():
            return logprob_fwd_bwd(h, W, tgt, grad_fn, dW, 1.0, entropy)
        return f

    naive = _naive_lp_ent if entropy else _naive_lp

    def peer_fwd(fn):
        def f():
            with torch.no_grad():
                return fn(h, W, tgt)
        return f

    def peer_fwd_bwd(fn):
        def f():
            out = fn(hl, Wl, tgt)
            torch.autograd.backward(out, (dlp, dent) if entropy else dlp)
        return f

    peers = {"eager": naive}
    if COMPILE and not entropy:  # compiling costs ~a minute per graph: the main case only
        peers["compile"] = torch.compile(naive, dynamic=False)

    with torch.no_grad():
        lp, ent, _ = ours_fwd()
        ref = naive(h, W, tgt)
        errs = {"rel_err_lp_vs_eager": _rel(lp, ref[0] if entropy else ref)}
        if entropy:
            errs["rel_err_ent_vs_eager"] = _rel(ent, ref[1])
        del lp, ent, ref

    measured = {}  # (kind, peer) -> {ms, peak} or {error}: the peer's fwd+bwd is timed once

    def peer(kind, pname):
        if (kind, pname) not in measured:
            pf = (peer_fwd if kind == "fwd" else peer_fwd_bwd)(peers[pname])
            grads = None if kind == "fwd" else [hl, Wl]
            try:
                pf()  # compiles, when compiled
                ms = _ms(pf, grads)
                hl.grad = Wl.grad = None
                measured[kind, pname] = {"ms": ms, "peak": _peak_gib(pf)}
            except Exception as e:  # out of memory, or the compiler gave up
                measured[kind, pname] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            hl.grad = Wl.grad = None
            torch.cuda.empty_cache()
        return measured[kind, pname]

    rows = []
    for what, mine, kind, flops in (("fwd", ours_fwd, "fwd", gemm),
                                    ("fwd+bwd dW bf16", ours_fwd_bwd(dW16), "fwd_bwd", 4 * gemm),
                                    ("fwd+bwd dW fp32", ours_fwd_bwd(dW32), "fwd_bwd", 4 * gemm),
                                    ("fused fwd+bwd dW bf16", ours_fused(dW16), "fwd_bwd", 3 * gemm),
                                    ("fused fwd+bwd dW fp32", ours_fused(dW32), "fwd_bwd", 3 * gemm)):
        row = dict(name=f"logprob {what} {tag}", ms=_ms(mine), peak_GiB=_peak_gib(mine), **errs)
        row["tflops"] = flops / row["ms"] * 1e-9
        if peak:
            row["frac_matmul_peak"] = row["tflops"] / peak
        for pname in peers:
            got = peer(kind, pname)
            if "error" in got:
                row[f"{pname}_error"] = got["error"]
                continue
            row[f"ms_{pname}"] = got["ms"]
            row[f"peak_GiB_{pname}"] = got["peak"]
            row[f"speedup_vs_{pname}"] = got["ms"] / row["ms"]
            row[f"mem_ratio_vs_{pname}"] = got["peak"] / row["peak_GiB"]
        if what.startswith("fused"):  # against our own separate fwd then bwd, same dW dtype
            sep = next(r for r in rows if r["name"] == row["name"].replace("fused ", "", 1))
            row["ms_separate"] = sep["ms"]
            row["speedup_vs_separate"] = sep["ms"] / row["ms"]
            with torch.no_grad():
                row["rel_err_dh_vs_separate"] = _rel(ours_fused(None)()[2], ours_fwd_bwd(None)())
        rows.append(row)
    return rows


def _adamw_rows(ceil: dict) -> list[dict]:
    from rlcu.ops.adamw import adamw_step, clip_scale, grad_norm

    n = P_06B
    torch.manual_seed(0)
    p = torch.randn(n, device="cuda")
    g = torch.randn(n, device="cuda") * 1e-3
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    scale = clip_scale(grad_norm(g), 1.0)  # a device tensor: no host sync in the step
    copy = ceil.get("copy_GBps")
    rows = []

    ms = _ms(lambda: adamw_step(p, g, m, v, out, step=10, grad_scale=scale, **HP))
    q = p.clone().requires_grad_()
    q.grad = g
    opt = torch.optim.AdamW([q], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)
    opt.step()  # creates the state
    ms_torch = _ms(opt.step)
    out2 = torch.empty_like(out)

    def torch_and_copy():
        opt.step()
        out2.copy_(q.detach())

    ms_torch_copy = _ms(torch_and_copy)
    row = dict(name=f"adamw step P={n} fp32 master + bf16 out", ms=ms, ms_torch=ms_torch,
               ms_torch_plus_copy=ms_torch_copy, GBps=30 * n / ms * 1e-6,
               GBps_torch=28 * n / ms_torch * 1e-6, speedup=ms_torch / ms,
               speedup_vs_torch_plus_copy=ms_torch_copy / ms)
    if copy:
        row["frac_copy_bw"] = row["GBps"] / copy
        row["frac_copy_bw_torch"] = row["GBps_torch"] / copy
    rows.append(row)
    opt = q = out2 = None
    torch.cuda.empty_cache()

    ms = _ms(lambda: grad_norm(g))
    ms_torch = _ms(lambda: torch.linalg.vector_norm(g))
    row = dict(name=f"grad_norm P={n} fp32", ms=ms, ms_torch=ms_torch, GBps=4 * n / ms * 1e-6,
               GBps_torch=4 * n / ms_torch * 1e-6, speedup=ms_torch / ms,
               rel_err_vs_torch=_rel(grad_norm(g), torch.linalg.vector_norm(g)))
    if copy:
        row["frac_copy_bw"] = row["GBps"] / copy
    rows.append(row)
    p = g = m = v = out = None
    torch.cuda.empty_cache()
    return rows


SR_CANDIDATES = ((4096, 8), (2048, 8), (2048, 4), (1024, 4), (1024, 2), (8192, 16))  # (block, warps)


def _adamw_bf16_rows(ceil: dict, candidates) -> list[dict]:
    """The bf16 memory mode's step (bf16 p, m, v and g, all three rounded stochastically) over
    the Qwen3-4B shape's parameter count, per launch config (block, warps); every config must
    give the default's bits. Peer: torch's fused AdamW on bf16 parameters (round to nearest)."""
    from bench.common import SHAPES
    from rlcu.model.config import Qwen3Config
    from rlcu.model.layout import ParamLayout
    from rlcu.ops import adamw as A

    n = ParamLayout(Qwen3Config(**SHAPES["4b"])).numel
    torch.manual_seed(0)
    p0 = (torch.randn(n, device="cuda") * 0.02).bfloat16()
    g = (torch.randn(n, device="cuda") * 1e-3).bfloat16()
    copy, default, rows, want = ceil.get("copy_GBps"), A.LAUNCH["sr"], [], None
    for cfg in dict.fromkeys((default, *candidates)):
        A.LAUNCH["sr"] = cfg
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        A.adamw_step(p, g, m, v, None, step=3, grad_scale=1.0, seed=1, **HP)
        if want is None:
            want = (p.clone(), m.clone(), v.clone())
        same = all(torch.equal(a, b) for a, b in zip((p, m, v), want))  # before the timed steps move them
        ms = _ms(lambda p=p, m=m, v=v: A.adamw_step(p, g, m, v, None, step=10, grad_scale=1.0, **HP))
        row = dict(name=f"adamw step P={n} bf16 p, m, v, g (stochastic rounding)", block=cfg[0], warps=cfg[1],
                   default=cfg == default, ms=ms, GBps=14 * n / ms * 1e-6, same_bits_as_default=same)
        if copy:
            row["frac_copy_bw"] = row["GBps"] / copy
        rows.append(row)
        p = m = v = None
    A.LAUNCH["sr"] = default
    want = None
    torch.cuda.empty_cache()
    q = p0.clone().requires_grad_()
    q.grad = g
    opt = torch.optim.AdamW([q], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)
    opt.step()
    ms_torch = _ms(opt.step)
    for r in rows:
        r.update(ms_torch=ms_torch, speedup=ms_torch / r["ms"])
    opt = q = p0 = g = None
    torch.cuda.empty_cache()
    return rows


def run(ceil: dict, sweep: bool = False) -> list[dict]:
    from rlcu.ops.adamw import LAUNCH

    rows = _logprob_rows(ceil, N, entropy=False)
    torch.cuda.empty_cache()
    rows += _logprob_rows(ceil, N_ENT, entropy=True)
    torch.cuda.empty_cache()
    rows += _adamw_rows(ceil)
    rows += _adamw_bf16_rows(ceil, SR_CANDIDATES if sweep else (LAUNCH["sr"],))
    return rows


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.common import measure_ceilings, write_json

    ceil = measure_ceilings()
    if "--sweep" in sys.argv:  # only the bf16 mode's step, at each launch candidate
        rows = _adamw_bf16_rows(ceil, SR_CANDIDATES)
        for r in rows:
            print(r)
        write_json("adamw_bf16_sweep.json", {"ceilings": ceil, "results": rows})
        return
    rows = run(ceil)
    for r in rows:
        print(r)
    write_json("logprob_adamw.json", {"ceilings": ceil, "results": rows})


if __name__ == "__main__":
    main()
