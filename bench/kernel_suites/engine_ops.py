"""The engine's ops (rlcu.ops.paged_attention, rlcu.ops.sampling) on Qwen3-0.6B shapes, bf16.

- decode attention, batch 64 / 256 x context 512 / 2048 (every sequence at that length),
  block size 16: GB/s of K/V read (L x Hk x D x 2 tensors x 2 bytes per sequence) against
  the copy ceiling; peer: torch SDPA on contiguous (unpaged) [B, Hk, L, D] K/V with GQA.
- prefill over paged K/V, 4k tokens: one fresh 4096-token sequence, and a 2048-token chunk
  after a cached 2048-token prefix; TFLOP/s with causal FLOPs (each query position p attends
  to p + 1 keys: 4 * Hq * D * sum(p + 1)) against the bf16 matmul ceiling; peer: SDPA flash
  on the fresh 4k sequence (contiguous K/V).
- the sampler on [256, 151936] logits (bf16 and fp32): temperature only (one pass), with
  top-k 50 + top-p 0.9 on every row (the threshold search, sparse: ~50 tiles a row), and with
  top-p 0.95 alone on flat logits (the search reads whole rows); GB/s of one read of the
  logits; peer: the usual torch eager sampler (softmax, exponential noise, argmax of p / E);
  and how many of the 256 tokens differ from the twin's (0 or 1: near-ties of the noise).

    python bench/kernel_bench.py --only engine_ops
    python bench/kernel_suites/engine_ops.py            # this suite alone
    python bench/kernel_suites/engine_ops.py --sweep    # tiles / warps / stages per kernel
    python bench/kernel_suites/engine_ops.py --static   # no GPU: registers, spills, shared
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

Hq, Hk, D, BS = 16, 8, 128, 16
VOCAB = 151936


def _time(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _paged(q_lens, ctx_lens, seed=0):
    """bf16 q, a K/V pool holding every sequence's context in shuffled blocks, block tables,
    cu_seqlens_q, seq_lens: the arguments of paged_attention before the sizes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    S = len(q_lens)
    need = [(L + BS - 1) // BS for L in ctx_lens]
    nb = sum(need)
    kc = torch.randn(nb, BS, Hk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(nb, BS, Hk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(nb, device="cuda", generator=g).int()
    bt = torch.zeros(S, max(need), device="cuda", dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        bt[s, :n] = perm[used : used + n]
        used += n
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), device="cuda", dtype=torch.int32)
    q = torch.randn(int(cu[-1]), Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.tensor(ctx_lens, device="cuda", dtype=torch.int32)
    return q, kc, vc, bt, cu, lens


def _contiguous_kv(kc, vc, bt, L):
    """[S, Hk, L, D] copies of the paged K/V (for the unpaged peer)."""
    k = kc[bt.long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    v = vc[bt.long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    return k, v


def _decode_row(B: int, L: int, ceil: dict) -> dict:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from bench.common import rel_err
    from rlcu.ops.paged_attention import (
        decode_splits,
        paged_attention,
        paged_attention_ref,
    )

    args = _paged([1] * B, [L] * B)
    scale = D**-0.5
    err = rel_err(paged_attention(*args, 1, L, scale), paged_attention_ref(*args, 1, L, scale))
    ms = _time(lambda: paged_attention(*args, 1, L, scale))
    q, kc, vc, bt = args[:4]
    k, v = _contiguous_kv(kc, vc, bt, L)
    qs = q.view(B, Hq, 1, D)
    try:
        ms_peer = _time(lambda: sdpa(qs, k, v, scale=scale, enable_gqa=True))
    except Exception as e:  # noqa: BLE001 - an unsupported peer is reported as None
        print(f"sdpa decode peer failed: {type(e).__name__}: {e}", file=sys.stderr)
        ms_peer = None
    gbps = B * L * Hk * D * 2 * 2 / ms * 1e-6  # K and V, bf16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return dict(name=f"paged decode B={B} L={L}", ms=ms, ms_peer=ms_peer, GBps=gbps,
                frac=gbps / ceil["copy_GBps"] if ceil.get("copy_GBps") else None,
                splits=decode_splits(B, Hk, L, sms)[0], peer="sdpa, contiguous K/V",
                rel_err_vs_twin=err)


def _prefill_row(q_len: int, L: int, ceil: dict) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from bench.common import rel_err
    from rlcu.ops.paged_attention import paged_attention, paged_attention_ref

    args = _paged([q_len], [L])
    scale = D**-0.5
    err = rel_err(paged_attention(*args, q_len, L, scale),
                   paged_attention_ref(*args, q_len, L, scale))
    ms = _time(lambda: paged_attention(*args, q_len, L, scale))
    pos = torch.arange(L - q_len, L, dtype=torch.float64)
    flops = 4 * Hq * D * float((pos + 1).sum())  # QK^T and PV over the visible keys
    ms_peer = None
    if q_len == L:
        q, kc, vc, bt = args[:4]
        k, v = _contiguous_kv(kc, vc, bt, L)
        qs = q.view(1, L, Hq, D).transpose(1, 2)

        def peer():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)

        try:
            ms_peer = _time(peer)
        except Exception as e:  # noqa: BLE001
            print(f"sdpa prefill peer failed: {type(e).__name__}: {e}", file=sys.stderr)
    tflops = flops / ms * 1e-9
    peak = ceil.get("bf16_matmul_TFLOPs")
    return dict(name=f"paged prefill q={q_len} ctx={L}", ms=ms, ms_peer=ms_peer, tflops=tflops,
                frac=tflops / peak if peak else None, peer="sdpa flash, contiguous K/V, causal",
                rel_err_vs_twin=err)


def _torch_sampler(logits, T):
    """The common eager sampler: exponential race on softmax(logits / T)."""
    p = torch.softmax(logits.float() / T[:, None], -1)
    return (p / torch.empty_like(p).exponential_()).argmax(-1)


_SAMPLERS = {  # name: (temperature, top_k, top_p, logits scale)
    "temperature": (0.7, 0, 1.0, 3.0),
    "top-k 50 + top-p 0.9": (0.7, 50, 0.9, 3.0),
    # a flat distribution (randn / 1): the top-p search reads every tile of every row
    "top-p 0.95 flat": (1.0, 0, 0.95, 1.0),
}


def _sample_inputs(B: int, dtype, what: str):
    T, k, p, scale = _SAMPLERS[what]
    torch.manual_seed(0)
    logits = (torch.randn(B, VOCAB, device="cuda") * scale).to(dtype)
    params = (torch.full((B,), T, device="cuda"),
              torch.full((B,), k, device="cuda", dtype=torch.int32),
              torch.full((B,), p, device="cuda"),
              torch.zeros(B, device="cuda"), torch.arange(B, device="cuda", dtype=torch.int64),
              torch.zeros(B, device="cuda", dtype=torch.int64))
    return logits, params


def _sample_row(dtype, what: str, ceil: dict) -> dict:
    from rlcu.ops.sampling import sample, sample_ref

    B = 256
    logits, params = _sample_inputs(B, dtype, what)
    ms = _time(lambda: sample(logits, *params))
    plain = what == "temperature"
    ms_peer = _time(lambda: _torch_sampler(logits, params[0])) if plain else None
    # the twin draws the same tokens (the GPU's approximate outer log of the noise aside)
    mismatches = int((sample(logits, *params)[0] != sample_ref(logits, *params)[0]).sum())
    gbps = logits.numel() * logits.element_size() / ms * 1e-6  # one read of the logits
    return dict(name=f"sample [{B}, {VOCAB}] {str(dtype)[6:]} {what}", ms=ms, ms_peer=ms_peer,
                GBps=gbps, frac=gbps / ceil["copy_GBps"] if ceil.get("copy_GBps") else None,
                peer="torch eager softmax + exponential race" if plain else None,
                tokens_differing_from_twin=mismatches)


def run(ceil: dict) -> list[dict]:
    rows = [_decode_row(B, L, ceil) for B, L in itertools.product((64, 256), (512, 2048))]
    torch.cuda.empty_cache()
    rows += [_prefill_row(q_len, L, ceil) for q_len, L in ((4096, 4096), (2048, 4096))]
    torch.cuda.empty_cache()
    for dtype, what in itertools.product((torch.bfloat16, torch.float32), _SAMPLERS):
        rows.append(_sample_row(dtype, what, ceil))
    return rows


# ------------------------------------------------------------------------------ config sweep
_SPACE = {
    "decode": [dict(BN=bn, num_warps=w, num_stages=s)
               for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))],
    "prefill": [dict(BM=bm, BN=bn, num_warps=w, num_stages=s)
                for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))],
    "pass1": [dict(BV=bv, CHUNK=8192, num_warps=w)
              for bv, w in itertools.product((256, 512, 1024, 2048), (2, 4, 8))],
    "splits": [dict(per_sm=p, min_part=mp, unsplit_keys=1024)
               for p, mp in itertools.product((2, 4, 8, 16), (64, 128, 256))],
    "row": [dict(BT=bt, CHUNK=ch, num_warps=w, maxnreg=r)
            for bt, ch, w, r in itertools.product((128, 256, 512), (16384, 32768), (4, 8, 16),
                                                  (None, 128))],
}


def _sweep_one(mod, kind, label, fn) -> list[dict]:
    default = dict(mod.CONFIGS[kind])
    results = []
    for cfg in _SPACE[kind]:
        mod.CONFIGS[kind] = cfg
        try:
            ms = _time(fn)
        except Exception as e:  # noqa: BLE001 - out of resources: not a candidate
            print(f"  {kind} {cfg}: {type(e).__name__}", file=sys.stderr)
            continue
        results.append(dict(kind=kind, case=label, config=cfg, ms=ms, default=cfg == default))
    mod.CONFIGS[kind] = default
    results.sort(key=lambda r: r["ms"])
    for r in results[:5]:
        print(f"{kind:<8} {label:<22} {str(r['config']):<60} {r['ms']:8.4f} ms"
              f"{'  (default)' if r['default'] else ''}")
    return results


def sweep(kinds) -> list[dict]:
    """Time each candidate config of each kernel (one table entry changed at a time)."""
    import rlcu.ops.paged_attention as pa
    import rlcu.ops.sampling as sm

    out = []
    if "decode" in kinds:
        for B, L in ((64, 2048), (256, 512)):
            args = _paged([1] * B, [L] * B)
            out += _sweep_one(pa, "decode", f"B={B} L={L}",
                              lambda a=args, L=L: pa.paged_attention(*a, 1, L, D**-0.5))
    if "splits" in kinds:  # short contexts, where the split policy decides (B=64: 2 splits)
        for B, L in ((64, 512), (16, 512), (64, 1024)):
            args = _paged([1] * B, [L] * B)
            out += _sweep_one(pa, "splits", f"B={B} L={L}",
                              lambda a=args, L=L: pa.paged_attention(*a, 1, L, D**-0.5))
    if "prefill" in kinds:
        args = _paged([4096], [4096])
        out += _sweep_one(pa, "prefill", "q=4096",
                          lambda: pa.paged_attention(*args, 4096, 4096, D**-0.5))
    for kind, whats in (("pass1", ("temperature",)), ("row", ("top-k 50 + top-p 0.9", "top-p 0.95 flat"))):
        if kind in kinds:
            for what in whats:
                logits, params = _sample_inputs(256, torch.bfloat16, what)
                out += _sweep_one(sm, kind, what, lambda x=logits, p=params: sm.sample(x, *p))
    return out


# ------------------------------------------------------------------- static (no GPU needed)
def static_compile(fn, types: dict, consts: dict, num_warps: int, num_stages: int = 3,
                   arch: int = 90, maxnreg: int | None = None, aligned=()) -> dict:
    """Compile `fn` for sm_<arch> without a GPU and read the cubin's registers, spill stack and
    shared memory. `types` maps argument names to Triton types ("*bf16", "fp32", ...; the rest
    are i32); pointers, strides and the `aligned` ints are taken as multiples of 16, as the
    runtime specialises them for real tensors."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        sig[n] = "constexpr" if n in consts else types.get(n, "i32")
        if sig[n].startswith("*") or n.startswith("stride") or n in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    regs = int(m.group(1))
    fit = min(65536 // (regs * 32 * num_warps), 64 // num_warps, 32,
              232448 // max(k.metadata.shared + 1024, 1))  # programs an SM (H100/H200)
    return dict(kernel=fn.__name__, regs=regs, spill_stack=int(m.group(2)),
                shared=k.metadata.shared, programs_per_sm=fit)


def static(dtype: str = "bf16") -> list[dict]:
    """The engine kernels at their default configs on Qwen3-0.6B shapes."""
    import triton

    import rlcu.ops.paged_attention as pa
    import rlcu.ops.sampling as sm

    c = pa.CONFIGS["decode"]
    ptr = {n: "*i32" for n in ("BLOCK_TABLES", "CU_Q", "SEQ_LENS")}
    ptr.update(Q=f"*{dtype}", KC=f"*{dtype}", VC=f"*{dtype}", O=f"*{dtype}", O_PART="*fp32",
               LSE_PART="*fp32", scale_log2="fp32")
    rows = [static_compile(pa._decode_kernel, ptr, dict(G=Hq // Hk, BG=16, D=D, BD=D, BS=BS,
                                                        BN=c["BN"], SPLIT=False),
                           c["num_warps"], c["num_stages"])]
    c1, cr = sm.CONFIGS["pass1"], sm.CONFIGS["row"]
    NC = triton.cdiv(VOCAB, c1["CHUNK"])
    NT = NC * (c1["CHUNK"] // cr["BT"])
    ptr = dict(LOGITS=f"*{dtype}", TEMP="*fp32", TOP_K="*i32", TOP_P="*fp32", MIN_P="*fp32",
               SEEDS="*i64", OFFSETS="*i64", PF="*fp32", PI="*i32", TMAX="*i32", TOKENS="*i64",
               LOGPROBS="*fp32")
    rows += [
        static_compile(sm._pass1_kernel, ptr, dict(BV=c1["BV"], CHUNK=c1["CHUNK"], BT=cr["BT"],
                                                   FAST=True), c1["num_warps"]),
        static_compile(sm._row_kernel, ptr, dict(BC=triton.next_power_of_2(NC),
                                                 BNT=triton.next_power_of_2(NT), BT=cr["BT"],
                                                 TPC=cr["CHUNK"] // cr["BT"], NP=sm._NP,
                                                 PASSES=sm._PASSES, FAST=True), cr["num_warps"],
                       maxnreg=cr.get("maxnreg")),
    ]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time the config candidates")
    ap.add_argument("--static", action="store_true", help="compile for sm_90 (no GPU): registers")
    ap.add_argument("--dtype", default="bf16", help="--static: bf16 or fp32")
    ap.add_argument("--kinds", default="decode,splits,prefill,pass1,row")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.common import measure_ceilings, write_json

    if args.static:
        for r in static(args.dtype):
            print(r)
    elif args.sweep:
        write_json("engine_ops_sweep.json", {"results": sweep(args.kinds.split(","))})
    else:
        ceil = measure_ceilings()
        rows = run(ceil)
        for r in rows:
            print(r)
        write_json("engine_ops.json", {"ceilings": ceil, "results": rows})


if __name__ == "__main__":
    main()
