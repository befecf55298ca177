"""Every hot Triton kernel compiled for the H200 (sm_90) as its launcher launches it, on a
machine without a GPU: the ops are called on CPU tensors with RLCU_BACKEND=triton and without
TRITON_INTERPRET (so each launcher picks its GPU tiles, not the interpreter's), and the JIT's
launch is replaced by a compile for sm_90 through Triton's own specialisation of the arguments
(16-byte alignment, ints divisible by 16) and its own ptxas. Nothing runs: the outputs are left
unwritten, so only shapes may flow from one call to the next.

Run by test_sm90_compile.py in a subprocess (`python tests/support/sm90_launches.py [CALL ...]`: only
the named calls of `calls()`); prints one JSON line, kernel -> [variants], each
{"shared": bytes, "warps", "stages", "regs", "spills" (bytes a thread), and MARKS: bool}
or {"error"}."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ["RLCU_BACKEND"] = "triton"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import overriding  # noqa: E402

bf = torch.bfloat16
COMPILED: dict[str, list] = {}
# PTX a variant's entry says whether it holds: pipelined async copies, warpgroup MMAs, grid
# dependency control (programmatic dependent launch), an fp32 product exempt from contraction, fp32 FMAs
MARKS = {"cp_async": "cp.async", "wgmma": "wgmma", "griddepcontrol": "griddepcontrol.wait",
         "launch_dependents": "griddepcontrol.launch_dependents", "mul_rn": "mul.rn.f32", "fma_f32": "fma.rn.f32"}


def resources(ptx: str) -> dict:
    """{"regs": registers a thread, "spills": bytes of spill stores a thread} of a compiled
    kernel, from `ptxas -v` (the ptxas Triton ships) on its PTX; empty where it is missing."""
    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    if not tool.exists() or target is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "k.ptx")
        src.write_text(ptx)
        p = subprocess.run([str(tool), f"-arch={target.group(1)}", "-v", str(src), "-o", str(Path(d, "k.cubin"))],
                           capture_output=True, text=True)
    log = p.stdout + p.stderr
    regs, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    return {"regs": int(regs.group(1)), "spills": int(spills.group(1))} if regs and spills else {}


def _install():
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.compiler.compiler import compile as tcompile
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 128)
    backend = make_backend(target)
    binders, seen = {}, set()  # as the JIT: one binder a kernel, one compile a specialisation

    def run(self, *args, grid, warmup, **kwargs):
        name = f"{self.module}.{self.__name__}"
        try:
            if self not in binders:
                binders[self] = create_function_from_signature(self.signature, self.params, backend)
            bound, spec, options = binders[self](*args, **kwargs)
            key = (name, repr(spec), repr(options))
            if key in seen:
                return
            seen.add(key)
            options, sig, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, options)
            k = tcompile(ASTSource(self, sig, constexprs, attrs), target=target, options=options.__dict__)
            ptx = k.asm["ptx"]
            entry = {"shared": k.metadata.shared, "warps": k.metadata.num_warps, "stages": k.metadata.num_stages,
                     **{m: pat in ptx for m, pat in MARKS.items()}, **resources(ptx)}
        except Exception as e:  # recorded: the test names the kernel and the error
            entry = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
        COMPILED.setdefault(name, []).append(entry)

    JITFunction.run = run


def calls():
    """The ops at small model-like shapes (Qwen3 heads: D = 128, GQA 2:1), each path once."""
    from rlcu.model.rope import RopeSpec, inv_freq
    from rlcu.ops import paged_attention as pa
    from rlcu.ops.adamw import adamw_step
    from rlcu.ops.attention import attention_bwd, attention_fwd
    from rlcu.ops.attention_exact import attention_exact_paged, attention_exact_varlen
    from rlcu.ops.embedding import embedding_bwd, embedding_fwd
    from rlcu.ops.kv_cache import kv_write
    from rlcu.ops.logprob import logprob_bwd, logprob_fwd
    from rlcu.ops.matmul_invariant import mm
    from rlcu.ops.paged_attention import paged_attention, prefill_tiles
    from rlcu.ops.qkv_prep import qkv_prep
    from rlcu.ops.rl_loss import policy_loss, value_loss
    from rlcu.ops.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
    from rlcu.ops.rope import rope_bwd, rope_fwd
    from rlcu.ops.sampling import greedy, sample
    from rlcu.ops.swiglu import swiglu_bwd, swiglu_fwd

    T, H, Hq, Hk, D, V, I = 256, 1024, 16, 8, 128, 4096, 3072
    x, w = torch.randn(T, H).to(bf), torch.ones(H, dtype=bf)
    ids = torch.randint(0, V, (T,), dtype=torch.int32)
    emb = torch.randn(V, H).to(bf)
    yield "embedding", lambda: (embedding_fwd(ids, emb), embedding_bwd(x, ids, torch.zeros(V, H)))
    yield "rmsnorm", lambda: rmsnorm_bwd(x, x, w, rmsnorm_fwd(x, w, 1e-6)[1])
    gu = torch.randn(T, 2 * I).to(bf)
    yield "swiglu", lambda: swiglu_bwd(swiglu_fwd(gu), gu)
    pos = torch.arange(T, dtype=torch.int32)
    q = torch.randn(T, Hq, D).to(bf)
    freqs = inv_freq(RopeSpec(theta=1e6), D)
    yield "rope", lambda: rope_bwd(rope_fwd(q, pos, freqs), pos, freqs)
    cu = torch.tensor([0, 100, T], dtype=torch.int32)
    k, v = torch.randn(T, Hk, D).to(bf), torch.randn(T, Hk, D).to(bf)

    def attn():
        o, lse = attention_fwd(q, k, v, cu, 156, D**-0.5)
        attention_bwd(o, q, k, v, o, lse, cu, 156, D**-0.5)

    yield "attention", attn
    BS, NB = 16, 64
    kc, vc = torch.zeros(NB, BS, Hk, D, dtype=bf), torch.zeros(NB, BS, Hk, D, dtype=bf)
    slots = torch.arange(T, dtype=torch.int64)
    yield "kv_write", lambda: kv_write(k, v, kc, vc, slots)
    for hq in (Hq, 32, 64):  # the 0.6B, 8B and 32B head counts, both launches (qkv_prep.launch):
        big = torch.randn(T, (hq + 2 * Hk) * D).to(bf)  # a decode step's rows, and the trainer's (stats)
        for stats in (False, True):
            yield f"qkv_prep_{hq}_heads{'_stats' if stats else ''}", lambda big=big, hq=hq, stats=stats: qkv_prep(
                big, torch.ones(D, dtype=bf), torch.ones(D, dtype=bf), pos, slots, kc, vc, hq, Hk, D, 1e-6, freqs,
                stats)
    big, bias = torch.randn(T, (Hq + 2 * Hk) * D).to(bf), torch.randn((Hq + 2 * Hk) * D).to(bf)
    for stats in (False, True):  # rope alone with Qwen2's q/k/v bias (Llama's: without it)
        yield f"qkv_prep_rope_bias{'_stats' if stats else ''}", lambda stats=stats: [qkv_prep(
            big, None, None, pos, slots, kc, vc, Hq, Hk, D, 1e-6, freqs, stats, bias=b) for b in (bias, None)]
    S = 8
    tables = torch.arange(S * 8, dtype=torch.int32).view(S, 8) % NB
    lens = torch.full((S,), 100, dtype=torch.int32)
    qd = torch.randn(S, Hq, D).to(bf)
    def decode_kernel(kernel, fn):  # fn with the decode plan's kernel set, whatever the default
        def call():
            with overriding(pa.CONFIGS, decode_plan=dict(pa.CONFIGS["decode_plan"], kernel=kernel)):
                fn()
        return call

    cu1 = torch.arange(S + 1, dtype=torch.int32)
    yield "paged_decode", decode_kernel("split", lambda: paged_attention(qd, kc, vc, tables, cu1, lens, 1, 128,
                                                                         D**-0.5))
    long_lens = torch.full((S,), 1000, dtype=torch.int32)  # past unsplit_keys: the split kernel and its reduce
    long_tables = torch.arange(S * 64, dtype=torch.int32).view(S, 64) % NB
    yield "paged_decode_split", decode_kernel("split", lambda: paged_attention(
        qd, kc, vc, long_tables, torch.arange(S + 1, dtype=torch.int32), long_lens, 1, 1024, D**-0.5))

    def listed():  # the list kernel, its work list built once (as the engine does) and by the call
        cuq = torch.arange(S + 1, dtype=torch.int32)
        work = pa.decode_work(cuq, long_lens, Hk)
        paged_attention(qd, kc, vc, long_tables, cuq, long_lens, 1, 1024, D**-0.5, None, work)
        paged_attention(qd, kc, vc, long_tables, cuq, long_lens, 1, 1024, D**-0.5)

    yield "paged_decode_list", decode_kernel("list", listed)
    cuq = torch.arange(0, S * 32 + 1, 32, dtype=torch.int32)
    qp = torch.randn(S * 32, Hq, D).to(bf)
    tiles = tuple(torch.from_numpy(t) for t in prefill_tiles([32] * S, Hq, Hk))
    yield "paged_prefill", lambda: paged_attention(qp, kc, vc, tables, cuq, lens, 32, 128, D**-0.5, tiles)
    logits = torch.randn(S, V).to(bf)
    f = torch.ones(S)
    yield "sample", lambda: (sample(logits, f * 0.7, torch.full((S,), 50, dtype=torch.int32), f * 0.9, f * 0.0,
                                    torch.arange(S, dtype=torch.int64), torch.zeros(S, dtype=torch.int64)),
                             greedy(logits))
    tg = torch.randint(0, V, (T,), dtype=torch.int64)
    head = torch.randn(V, H).to(bf)

    def lp():
        out = logprob_fwd(x, head, tg, 1.0, True)
        logprob_bwd(torch.ones(T), torch.ones(T), x, head, tg, out[-1], torch.zeros(V, H), 1.0)

    yield "logprob", lp
    n = torch.randn(T)
    yield "rl_loss", lambda: (policy_loss(n, n, n, n, n.abs(), n), value_loss(n, n, n, n.abs(), clip=0.2))
    P = 1 << 16
    p32, g32 = torch.randn(P), torch.randn(P)

    def adam():
        adamw_step(p32, g32, torch.zeros(P), torch.zeros(P), torch.empty(P, dtype=bf), lr=1e-3, beta1=0.9,
                   beta2=0.95, eps=1e-8, weight_decay=0.1, step=1, grad_scale=1.0)
        p16 = torch.randn(P).to(bf)
        adamw_step(p16, g32.to(bf), torch.zeros(P, dtype=bf), torch.zeros(P, dtype=bf), None, lr=1e-3, beta1=0.9,
                   beta2=0.95, eps=1e-8, weight_decay=0.1, step=1, grad_scale=1.0)

    yield "adamw", adam

    def exact():  # exact mode's kernels: the batch-invariant GEMM and attention
        mm(x, torch.randn(512, H).to(bf))
        mm(x[:7], torch.randn(512, H).to(bf))
        attention_exact_varlen(q, k, v, cu, 156, D**-0.5)
        attention_exact_paged(qd, kc, vc, tables, torch.arange(S + 1, dtype=torch.int32), lens, 1, D**-0.5)

    yield "exact", exact

    def heuristic_tiles(fn):  # the decode GEMMs at their heuristic tiles: the measured table set aside
        def call():
            from rlcu.ops import decode_linear as dl

            with overriding(dl.CONFIGS, table={}, pdl=False, inline_reduce=True):  # fn may switch the last two
                fn(dl)
        return call

    def fused_linear(dl):  # the decode projections, split and not, and under PDL
        for M in (1, 64, 256):
            xm = torch.randn(M, H).to(bf)
            dl.decode_linear(xm, torch.randn(4096, H).to(bf), w, 1e-6)  # qkv, the norm inside
            dl.decode_linear(xm, torch.randn(2 * I, H).to(bf), w, 1e-6, None, True)  # gate_up + SwiGLU
            dl.decode_linear(torch.randn(M, I).to(bf), torch.randn(H, I).to(bf), None, 1e-6, xm)  # down + residual
        dl.CONFIGS.update(pdl=True)
        dl.decode_linear(x[:64], torch.randn(4096, H).to(bf), w, 1e-6)
        dl.CONFIGS.update(pdl=False, inline_reduce=False)  # split-K (down at 64 rows) by the reduce kernel
        dl.decode_linear(torch.randn(64, I).to(bf), torch.randn(H, I).to(bf), None, 1e-6, x[:64].clone())

    yield "decode_linear", heuristic_tiles(fused_linear)

    def fused_qkv(dl):  # the norm, the QKV GEMM and qkv_prep in one kernel (ops/decode_qkv.py)
        from rlcu.ops.decode_qkv import decode_qkv

        wq, hd = torch.randn((Hq + 2 * Hk) * D, H).to(bf), torch.ones(D, dtype=bf)
        for M in (1, 64, 256):
            decode_qkv(torch.randn(M, H).to(bf), wq, w, 1e-6, hd, hd, pos[:M], slots[:M], kc, vc, Hq, Hk, D, freqs)
        # rope alone with Qwen2's bias; rope alone without it (Llama's, Mistral's) spills 4 bytes at these
        # 64-row heuristic tiles (255 registers, as Qwen3's), so it is left out here: the fused decode path is
        # opt-in (decode_linear.CONFIGS["enabled"] is off by default; generate.py --fused-linear), and the
        # default path runs cuBLAS and qkv_prep for every family
        bias = torch.randn((Hq + 2 * Hk) * D).to(bf)
        decode_qkv(x[:64], wq, w, 1e-6, None, None, pos[:64], slots[:64], kc, vc, Hq, Hk, D, freqs, bias=bias)
        dl.CONFIGS.update(pdl=True)
        decode_qkv(x[:64], wq, w, 1e-6, hd, hd, pos[:64], slots[:64], kc, vc, Hq, Hk, D, freqs)

    yield "decode_qkv", heuristic_tiles(fused_qkv)

    def lora():  # the grouped LoRA products at decode's and prefill's tiles (8B's qkv slices, r = 64)
        from rlcu.ops.lora import lora_apply, lora_expand, lora_shrink

        n, r, N = 8, 64, (Hq + 2 * Hk) * D
        a, b = torch.randn(n, 3 * r, H).to(bf), torch.randn(n, N, r).to(bf)
        sl = ((0, Hq * D), (Hq * D, (Hq + Hk) * D), ((Hq + Hk) * D, N))
        for M in (1, 256, 1024):
            idx = torch.zeros(M, dtype=torch.int32)
            h = lora_shrink(torch.randn(M, H).to(bf), a, idx, idx)
            lora_expand(h, b, idx, torch.randn(M, N).to(bf), torch.ones(n), sl, idx)
            # H = 2 splits: up to fuse_max_t rows the expand adds the partials (S = 2), past it the reduce's h
            lora_apply(torch.randn(M, H).to(bf), a, b, idx, torch.randn(M, N).to(bf), torch.ones(n), sl, idx)
        b8 = b[:, :, :8].contiguous()  # r = 8: a tail under the MMA's 16, one tiling for every T
        lora_expand(h[:, :8].contiguous(), b8, idx, torch.randn(1024, N).to(bf), torch.ones(n))

    yield "lora", lora

    def dropout():  # LoRA's dropout masks from a seed in device memory (ops/dropout.py)
        from rlcu.ops.dropout import dropout_mask

        for stream in (1, 3):  # 1: the value the JIT would make a constant if it specialised it
            dropout_mask(torch.zeros(1, dtype=torch.int64), stream, 0.1, 256, H, bf)

    yield "dropout", dropout

    def moe():  # Qwen3-30B-A3B's experts (E = 128, k = 8, H = 2048, I = 768): decode's tiles and prefill's
        from rlcu.ops.moe import experts_bwd, experts_fwd, route_bwd, route_fwd
        from rlcu.ops.moe_route import route_replay

        E, k, Hm, Im = 128, 8, 2048, 768
        wgu, wd = torch.randn(E, 2 * Im, Hm).to(bf), torch.randn(E, Hm, Im).to(bf)
        for M in (1, 2048):
            xm = torch.randn(M, Hm).to(bf)
            ids, wts, p = route_fwd(torch.randn(M, E).to(bf), k, True)
            ids.zero_()  # unwritten outputs: only shapes flow, and the sort is read on the host nowhere
            out, saved = experts_fwd(xm, ids, wts, wgu, wd)
            experts_bwd(xm, xm, wts, wgu, wd, saved, torch.zeros(E, 2 * Im, Hm), torch.zeros(E, Hm, Im))
            route_bwd(wts, p, ids, wts, True, torch.zeros(E))
            route_replay(torch.randn(M, E).to(bf), ids, True)  # routing replay: the rollout's experts
        from rlcu.ops import moe_gemm

        with overriding(moe_gemm.CONFIGS, prefill=(*moe_gemm.CONFIGS["prefill"][:5], 8)):  # blocks in groups of 8
            experts_fwd(xm, ids, wts, wgu, wd)
        with overriding(moe_gemm.CONFIGS, dw_long_rows=0):  # the weight gradient's tiles for deep K sums
            experts_bwd(xm, xm, wts, wgu, wd, saved, torch.zeros(E, 2 * Im, Hm), torch.zeros(E, Hm, Im))

    yield "moe", moe


def main() -> int:
    try:
        _install()
    except ImportError as e:  # no triton, or one without these internals (written for triton 3.6)
        print(f"cannot compile for sm_90 here: {e}")
        return 3
    only = set(sys.argv[1:])  # call names to run (default: all)
    failed = {}
    for name, fn in calls():
        if only and name not in only:
            continue
        try:
            fn()
        except Exception:  # a launcher that fails on the host (its checks, a CPU-only path)
            failed[name] = traceback.format_exc()[-1500:]
    print(json.dumps({"kernels": COMPILED, "call_errors": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
