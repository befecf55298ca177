"""The engine's ops (rlcu.ops.paged_attention, rlcu.ops.sampling) on Qwen3-0.6B shapes, bf16.

- decode attention, batch 64 / 256 x context 512 / 2048 (every sequence at that length),
  block size 16: GB/s of K/V read (L x Hk x D x 2 tensors x 2 bytes per sequence) against
  the copy ceiling; peer: torch SDPA on contiguous (unpaged) [B, Hk, L, D] K/V with GQA.
- prefill over paged K/V, 4k tokens: one fresh 4096-token sequence, and a 2048-token chunk
  after a cached 2048-token prefix; TFLOP/s with causal FLOPs (each query position p attends
  to p + 1 keys: 4 * Hq * D * sum(p + 1)) against the bf16 matmul ceiling; peer: SDPA flash
  on the fresh 4k sequence (contiguous K/V).
- the sampler on [256, 151936] logits (bf16 and fp32): temperature only (one pass), and with
  top-k 50 + top-p 0.9 on every row (the threshold search); GB/s of one read of the logits;
  peer: the usual torch eager sampler (softmax, exponential noise, argmax of p / E).

    python bench/kernels.py --only engine_ops
    python bench/kernel_suites/engine_ops.py            # this suite alone
    python bench/kernel_suites/engine_ops.py --sweep    # tiles / warps / stages per kernel
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


def _rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _decode_row(B: int, L: int, ceil: dict) -> dict:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from rlcu.ops.paged_attention import decode_splits, paged_attention, paged_attention_ref

    args = _paged([1] * B, [L] * B)
    scale = D**-0.5
    err = _rel_err(paged_attention(*args, 1, L, scale), paged_attention_ref(*args, 1, L, scale))
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

    from rlcu.ops.paged_attention import paged_attention, paged_attention_ref

    args = _paged([q_len], [L])
    scale = D**-0.5
    err = _rel_err(paged_attention(*args, q_len, L, scale),
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


def _sample_inputs(B: int, dtype, filtered: bool):
    torch.manual_seed(0)
    logits = (torch.randn(B, VOCAB, device="cuda") * 3).to(dtype)
    params = (torch.full((B,), 0.7, device="cuda"),
              torch.full((B,), 50 if filtered else 0, device="cuda", dtype=torch.int32),
              torch.full((B,), 0.9 if filtered else 1.0, device="cuda"),
              torch.zeros(B, device="cuda"), torch.arange(B, device="cuda", dtype=torch.int64),
              torch.zeros(B, device="cuda", dtype=torch.int64))
    return logits, params


def _sample_row(dtype, filtered: bool, ceil: dict) -> dict:
    from rlcu.ops.sampling import sample

    B = 256
    logits, params = _sample_inputs(B, dtype, filtered)
    ms = _time(lambda: sample(logits, *params))
    ms_peer = None if filtered else _time(lambda: _torch_sampler(logits, params[0]))
    gbps = logits.numel() * logits.element_size() / ms * 1e-6  # one read of the logits
    what = "top-k 50 + top-p 0.9" if filtered else "temperature"
    return dict(name=f"sample [{B}, {VOCAB}] {str(dtype)[6:]} {what}", ms=ms, ms_peer=ms_peer,
                GBps=gbps, frac=gbps / ceil["copy_GBps"] if ceil.get("copy_GBps") else None,
                peer="torch eager softmax + exponential race" if not filtered else None)


def run(ceil: dict) -> list[dict]:
    rows = [_decode_row(B, L, ceil) for B, L in itertools.product((64, 256), (512, 2048))]
    torch.cuda.empty_cache()
    rows += [_prefill_row(q_len, L, ceil) for q_len, L in ((4096, 4096), (2048, 4096))]
    torch.cuda.empty_cache()
    for dtype, filtered in itertools.product((torch.bfloat16, torch.float32), (False, True)):
        rows.append(_sample_row(dtype, filtered, ceil))
    return rows


# ------------------------------------------------------------------------------ config sweep
_SPACE = {
    "decode": [dict(BN=bn, num_warps=w, num_stages=s)
               for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))],
    "prefill": [dict(BM=bm, BN=bn, num_warps=w, num_stages=s)
                for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))],
    "pass1": [dict(BV=bv, CHUNK=8192, num_warps=w)
              for bv, w in itertools.product((256, 512, 1024, 2048), (2, 4, 8))],
    "finish": [dict(BV=bv, num_warps=w) for bv, w in itertools.product((128, 256, 512), (4, 8))],
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
        print(f"{kind:<8} {label:<14} {str(r['config']):<60} {r['ms']:8.4f} ms"
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
    if "prefill" in kinds:
        args = _paged([4096], [4096])
        out += _sweep_one(pa, "prefill", "q=4096",
                          lambda: pa.paged_attention(*args, 4096, 4096, D**-0.5))
    for kind in ("pass1", "finish"):
        if kind in kinds:
            logits, params = _sample_inputs(256, torch.bfloat16, filtered=kind == "finish")
            out += _sweep_one(sm, kind, "B=256", lambda x=logits, p=params: sm.sample(x, *p))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time the config candidates")
    ap.add_argument("--kinds", default="decode,prefill,pass1,finish")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.common import measure_ceilings, write_json

    if args.sweep:
        write_json("engine_ops_sweep.json", {"results": sweep(args.kinds.split(","))})
    else:
        ceil = measure_ceilings()
        rows = run(ceil)
        for r in rows:
            print(r)
        write_json("engine_ops.json", {"ceilings": ceil, "results": rows})


if __name__ == "__main__":
    main()
