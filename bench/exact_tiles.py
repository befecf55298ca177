"""Which tiles may exact mode's kernels pick by M and still give a row the same bits?

Batch invariance needs a row's reductions (K for the GEMM, head_dim and the keys for attention)
done in one order whatever the batch. The tile shape over rows and columns (BM, BN) and the warp
count do not enter that order in the source: each output element is acc + a_k . b_k, K walked in
BK steps into one fp32 accumulator. Whether the compiled code keeps it so (the tensor-core
instruction, its operand split, the reduction layout of a row sum) is a property of the
compiler and the hardware, so it is measured here, on the device, bit for bit:

- GEMM: every candidate (BM, BN, BK, GROUP_M, warps, stages) at M in {1, 7, 64, 256, 8192} against
  the reference configuration (matmul_invariant.CONFIG) at M = 8192, at each weight shape of
  the 0.6B model (--8b: and of the 8B); then each candidate's time against cuBLAS at each M;
- attention: the training kernel's row tile (BM) and warps against the BM = 16 tile the decode
  path runs, bit for bit, with its time against the default training kernel.

A candidate with another BK must differ (the check can fail); the others either match on every
shape and M, or are reported with their count of differing elements.

    python bench/exact_tiles.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, meta, qwen3_06b_config

REF = (128, 128, 64, 8, 8, 3, False)
GEMM_CANDIDATES = [REF] + [(bm, bn, bk, 8, w, st, tma) for tma in (False, True) for bm, bn, bk, w, st in (
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 32, 64, 4, 4), (64, 64, 128, 4, 3),
    (64, 32, 128, 4, 4), (64, 128, 128, 4, 3), (64, 256, 64, 4, 3),
    # other instruction families (BM < 64: not a warpgroup MMA) and K steps
    (32, 64, 64, 4, 4), (16, 64, 64, 4, 4), (16, 32, 128, 4, 4), (128, 128, 32, 8, 4), (128, 128, 128, 8, 2))
    if not (tma and bm < 64)][1:]
L2_BYTES = 120 << 20  # operands cycled through more than this: each call reads HBM, as in a model


def _timed(fn_of, n_sets: int, inner: int = 12, reps: int = 7) -> float:
    """Median ms of one call over n_sets operand copies (common.graph_ms)."""
    return graph_ms([fn_of(i % n_sets) for i in range(inner)], inner, reps)


def _shapes(cfg):
    H, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, H), "o": (H, cfg.q_size), "gate_up": (2 * inter, H),
            "down": (H, inter), "lm_head": (V, H)}


def gemm(quick: bool, with_8b: bool = False) -> dict:
    from rlcu.ops import matmul_invariant as mi

    d, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=d).manual_seed(0)
    models = {"0.6B": _shapes(qwen3_06b_config())}
    if with_8b:
        models["8B"] = _shapes(qwen3_06b_config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                                num_key_value_heads=8))
    Ms = (1, 7, 64, 256, 8192) if not quick else (1, 64, 512)
    big = Ms[-1]
    out, keep = {}, mi.CONFIGS
    try:
        for model, shapes in models.items():
            for name, (N, K) in shapes.items():
                if model == "8B" and name == "lm_head":
                    continue
                w = torch.randn(N, K, device=d, dtype=bf, generator=g) * 0.02
                x = torch.randn(big, K, device=d, dtype=bf, generator=g)
                mi.CONFIGS = ((1 << 62, 1 << 62, REF),)
                ref = mi.mm(x, w)
                ws = [w] + [w.clone() for _ in range(max(0, min(7, L2_BYTES // (N * K * 2))))]
                sets = {M: [(x[:M] if i == 0 else x[:M].clone(), ws[i % len(ws)], torch.empty(M, N, device=d, dtype=bf))
                            for i in range(len(ws))] for M in Ms}

                def cub(M):
                    return lambda i: (lambda a=sets[M][i]: torch.mm(a[0], a[1].t(), out=a[2]))

                def inv(M):
                    return lambda i: (lambda a=sets[M][i]: mi.mm(a[0], a[1], out=a[2]))

                t_cub = {M: _timed(cub(M), len(ws)) for M in Ms}
                for c in GEMM_CANDIDATES:
                    mi.CONFIGS = ((1 << 62, 1 << 62, c),)
                    row = out.setdefault(str(list(c)), {"config (BM, BN, BK, GROUP_M, warps, stages, tma)": list(c),
                                                        "differing_elements": 0, "per_shape": {}})
                    per = row["per_shape"].setdefault(f"{model} {name}", {})
                    for M in Ms:
                        off = 3 if M < big else 0  # a row block away from row 0 as well
                        M_ = min(M, big - off)
                        y = mi.mm(x[off:off + M_], w)
                        bad = int((y != ref[off:off + M_]).sum())
                        row["differing_elements"] += bad
                        t = _timed(inv(M), len(ws))
                        per[f"M={M}"] = {"ms": t, "cublas_ms": t_cub[M], "ratio": t / t_cub[M], "differ": bad}
                print(f"  {model} {name} N={N} K={K} done", flush=True)
    finally:
        mi.CONFIGS = keep
    for row in out.values():
        row["same_bits_as_ref"] = row["differing_elements"] == 0
        by_m = {}
        for per in row["per_shape"].values():
            for m, r in per.items():
                a = by_m.setdefault(m, [0.0, 0.0])
                a[0] += r["ms"]
                a[1] += r["cublas_ms"]
        row["ratio_by_M"] = {m: a[0] / a[1] for m, a in by_m.items()}
        print(f"gemm {row['config (BM, BN, BK, GROUP_M, warps, stages, tma)']}: same bits {row['same_bits_as_ref']} "
              f"({row['differing_elements']} differ); x cuBLAS " +
              " ".join(f"{m} {v:.2f}" for m, v in row["ratio_by_M"].items()), flush=True)
    best = {}
    for key, row in out.items():
        for sh, per in row["per_shape"].items():
            for m, r in per.items():
                b = best.setdefault(f"{sh} {m}", {"config": None, "ratio": 1e9})
                if r["differ"] == 0 and r["ratio"] < b["ratio"]:
                    b.update(config=key, ratio=r["ratio"], ms=r["ms"], cublas_ms=r["cublas_ms"])
    for k, b in best.items():
        print(f"best {k}: {b['config']} {b['ratio']:.2f}x cuBLAS", flush=True)
    return {"configs": out, "best_per_shape_and_M": best}


def packed_qkv(cfg, quick: bool, g):
    """Random bf16 q, k, v of B sequences of T tokens packed ([B T, heads, head_dim]), B, T."""
    B, T = (4, 512) if quick else (32, 1024)
    N, D, bf = B * T, cfg.head_dim, torch.bfloat16
    q, k, v = (torch.randn(N, h, D, device="cuda", dtype=bf, generator=g)
               for h in (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads))
    return q, k, v, B, T


def attention(quick: bool) -> dict:
    from rlcu.ops import attention_exact as ae
    from rlcu.ops.attention import attention_fwd

    cfg = qwen3_06b_config()
    d = "cuda"
    g = torch.Generator(device=d).manual_seed(1)
    q, k, v, B, T = packed_qkv(cfg, quick, g)
    N, D = q.shape[0], cfg.head_dim
    lens = torch.randint(1, 2 * T, (B,), generator=torch.Generator().manual_seed(0)).tolist()
    lens[-1] = N - sum(lens[:-1]) if sum(lens[:-1]) < N else 1
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=d, dtype=torch.int32).clamp(max=N)
    sc = D**-0.5
    keep = dict(ae.CONFIG)
    mx = int(max(lens))
    res = {"tokens": N, "default_ms": _timed(lambda i: (lambda: attention_fwd(q, k, v, cu, mx, sc)), 1)}
    try:
        ae.CONFIG.update(BM=16, BM_TRAIN=16, num_warps=4, SUB_TRAIN=1)
        ref, ref_lse = ae.attention_exact_varlen(q, k, v, cu, mx, sc)  # the decode path's row tile
        for BM, warps, sub, stages in ((16, 4, 2, 2), (32, 4, 1, 2), (32, 4, 2, 2), (32, 4, 1, 3), (32, 4, 2, 3),
                                       (32, 2, 1, 2), (64, 4, 1, 2), (64, 4, 1, 3), (64, 8, 1, 2)):
            ae.CONFIG.update(BM_TRAIN=BM, num_warps=warps, SUB_TRAIN=sub, num_stages=stages)
            try:
                o, lse = ae.attention_exact_varlen(q, k, v, cu, mx, sc)
                bad = int((o != ref).sum()) + int((lse != ref_lse).sum())
                t = _timed(lambda i: (lambda: ae.attention_exact_varlen(q, k, v, cu, mx, sc)), 1)
                r = {"ms": t, "x_default": t / res["default_ms"], "differ": bad}
            except Exception as e:  # noqa: BLE001  (a config that does not compile is a result)
                r = {"error": repr(e)[:300]}
            res[f"BM={BM} warps={warps} SUB={sub} stages={stages}"] = r
            print(f"attention BM={BM} warps={warps} SUB={sub} stages={stages}: {r}", flush=True)
            ae.CONFIG.clear()
            ae.CONFIG.update(keep)
    finally:
        ae.CONFIG.clear()
        ae.CONFIG.update(keep)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "exact_tiles.json"))
    ap.add_argument("--parts", default="gemm,attention")
    ap.add_argument("--8b", dest="with_8b", action="store_true", help="the 8B model's GEMM shapes too")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/exact_tiles.py: needs a CUDA device", file=sys.stderr)
        return 2
    res = {"meta": meta(), "what": __doc__.split("\n\n")[0], "reference_gemm": list(REF)}
    for part in a.parts.split(","):
        res[part] = gemm(a.quick, a.with_8b) if part == "gemm" else attention(a.quick)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
