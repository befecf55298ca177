"""A decode layer's projections at 1-256 rows: the unfused ops the engine runs (cuBLAS, with the
norms, SwiGLU and qkv_prep as kernels of their own) against ops/decode_linear.py and
ops/decode_qkv.py (norm, SwiGLU, the residual and qkv_prep inside the GEMM), per op and as a
layer's chain, on the Qwen3-0.6B and 8B shapes, against the weight bytes' bound at the copy
bandwidth measured in the same run.

Per (shape, op, M), op one of
  qkv      rmsnorm + x Wqkv^T + qkv_prep (fused: ops/decode_qkv.py, the heads' norm, RoPE and
           the cache writes in the GEMM's epilogue; its BN is D / 2, listed as 0)
  o        x += o Wo^T, cuBLAS addmm      (fused: decode_linear(o, Wo, None, eps, x))
  gate_up  rmsnorm + x Wgu^T + swiglu     (fused: decode_linear(x, Wgu, g, eps, None, True))
  down     x += a Wd^T                    (fused: decode_linear(a, Wd, None, eps, x)),
the unfused sequence, decode_linear at config_for's tiles (`heuristic`), every candidate tile
(BN 16-128 at row_tile's rows, and WIDE_ROWS' 128 / 256-row tiles where M fills them, K split 1
or until ~one program an SM; `sweep`; then at the fastest tile the
K step and pipeline depth of REFINE), and the fastest of them with
programmatic dependent launch (`pdl`, then `pdl_prefetch`: the weight slice prefetched to
L2 before the wait); where the fastest splits K, also with its partials added by the reduce
kernel instead of the tile's last program (`reduce_kernel`). Timing (as bench/exact_tiles.py):
one CUDA graph of 12 back-to-back calls cycling through weight copies that together exceed L2 (each call reads HBM, as a
model's layers do), median of 7 replays / 12. Every fused result is checked against the
unfused one (relative error, recorded; a candidate above 2e-2 is dropped and listed).

Chain: a whole layer's four ops over the model's layers (distinct weights, the decode step's
order) in one graph, unfused against fused at the best tiles (with and without PDL): the
per-step time these kernels cost, which bench/decode_step.py's `rest` contains.

The JSON's `table` is CONFIGS["table"] for ops/decode_linear.py (load_table reads it back):
    python bench/decode_linear.py [--shapes 0.6b,8b] [--rows 1,8,32,64,128,256] [--quick] [--json NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    SHAPES,
    graph_ms,
    measure_ceilings,
    overriding,
    qwen3_06b_config,
    rel_err,
    write_json,
)

L2_BYTES = 120 << 20
OPS = ("qkv", "o", "gate_up", "down")
MAX_ERR = 2e-2
REFINE = ((64, 6), (128, 3), (128, 6), (256, 3), (256, 4))  # (BK, stages) tried at each op's best tile
# (BM, BN) row tiles of 128 and 256 rows, at 8 warps, BK 64 and 3 stages (ptxas for sm_90:
# gate_up's pair at (128, 64) takes 148 registers, a single tile at (256, 64) 151, spill-free)
WIDE_ROWS = ((128, 32), (128, 64), (256, 32), (256, 64))


def op_shapes(cfg) -> dict:
    """op -> (N rows of W, K)."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, H), "o": (H, cfg.q_size), "gate_up": (2 * inter, H),
            "down": (H, inter)}


def _timed(fns, inner: int = 12, reps: int = 7) -> float:
    return graph_ms(fns, inner, reps, warm=2)


def qkv_context(mcfg, M: int) -> tuple:
    """The qkv op's other operands at model config mcfg: (q_w, k_w, pos, slots, k_cache, v_cache,
    Hq, Hk, D, inv_freq), the M rows at distinct slots of a small cache."""
    from rlcu.model.rope import inv_freq

    d, bf, D, Hk = "cuda", torch.bfloat16, mcfg.head_dim, mcfg.num_key_value_heads
    kc = torch.zeros(-(-M // 16), 16, Hk, D, device=d, dtype=bf)
    return (1 + 0.1 * torch.randn(D, device=d, dtype=bf), 1 + 0.1 * torch.randn(D, device=d, dtype=bf),
            torch.randint(0, 4096, (M,), device=d, dtype=torch.int32), torch.arange(M, device=d), kc,
            torch.zeros_like(kc), mcfg.num_attention_heads, Hk, D, inv_freq(mcfg.rope, D, d))


def unfused(op: str, eps: float, ctx=None):
    """The engine's ops without decode_linear and decode_qkv (engine/paged_forward.py), as
    fn(x, w, g, res); ctx: qkv_context's for qkv (the norm, the GEMM and qkv_prep)."""
    from rlcu.ops.qkv_prep import qkv_prep
    from rlcu.ops.rmsnorm import rmsnorm_fwd
    from rlcu.ops.swiglu import swiglu_fwd

    if op == "qkv":
        q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, f = ctx
        return lambda x, w, g, r: qkv_prep(rmsnorm_fwd(x, g, eps)[0] @ w.t(), q_w, k_w, pos, slots, kc, vc, Hq, Hk, D,
                                           eps, f)
    if op == "gate_up":
        return lambda x, w, g, r: swiglu_fwd(rmsnorm_fwd(x, g, eps)[0] @ w.t())
    return lambda x, w, g, r: r.addmm_(x, w.t())


def fused(op: str, eps: float, cfg=None, ctx=None):
    from rlcu.ops.decode_linear import decode_linear
    from rlcu.ops.decode_qkv import decode_qkv

    if op == "qkv":
        return lambda x, w, g, r: decode_qkv(x, w, g, eps, *ctx, cfg)
    if op == "gate_up":
        return lambda x, w, g, r: decode_linear(x, w, g, eps, None, True, cfg)
    return lambda x, w, g, r: decode_linear(x, w, None, eps, r, False, cfg)


def candidates(M: int, N: int, K: int, head_dim: int | None = None) -> list[tuple]:
    """(BM, BN, BK, SPLIT, warps, stages): BN 16-128 at the row tile M needs, each unsplit and
    split until about one program an SM (ops/decode_linear.heuristic_config's rule). With
    head_dim (decode_qkv: a program a head, BN set by the op): M's row tile, the splits up to
    that rule's, at 4 and 8 warps."""
    import triton

    from rlcu.ops.decode_linear import row_tile, split_for

    BM = row_tile(M)
    out = []
    if head_dim:
        split = split_for(N // head_dim * triton.cdiv(M, BM), K)
        for s in sorted({1, max(1, split // 2), split}):
            out += [(BM, 0, 128, s, 4, 4), (BM, 0, 128, s, 8, 4)]
        return out
    for BN in (16, 32, 64, 128):
        split = split_for(triton.cdiv(N, BN) * triton.cdiv(M, BM), K)
        for s in sorted({1, split}):
            out.append((BM, BN, 128, s, 8 if BM * BN >= 64 * 128 else 4, 4))
    for BM, BN in WIDE_ROWS:  # row tiles past row_tile's 64 where M fills them: each weight tile read once
        if M >= BM:
            split = split_for(triton.cdiv(N, BN) * triton.cdiv(M, BM), K, 64)
            out += [(BM, BN, 64, s, 8, 3) for s in sorted({1, split})]
    return out


def own_config(op: str, M: int, N: int, K: int, head_dim: int | None = None) -> tuple:
    """The op's tiles at M rows (N rows of W; head_dim for qkv): config_for's, or its heuristic's
    where the table says None (the unfused ops, which run_op times on their own), so that the
    `heuristic` entry is always a tile of the op."""
    from rlcu.ops import decode_linear as dl
    from rlcu.ops import decode_qkv as dq

    if head_dim:
        return dq.config_for(M, N, K, N // head_dim) or dq.heads_config(M, N // head_dim, K)
    n = N // 2 if op == "gate_up" else N
    return dl.config_for(M, n, K, op == "gate_up") or dl.heuristic_config(M, n, K)


def operands(op: str, N: int, K: int, M: int, H: int, n_sets: int):
    """n_sets (x, w, g, residual) sets: weights cycled so that each call reads HBM."""
    d, bf = "cuda", torch.bfloat16
    out_n = N // 2 if op == "gate_up" else N
    sets = []
    for _ in range(n_sets):
        w = torch.randn(N, K, device=d, dtype=bf) / K**0.5
        x = torch.randn(M, K, device=d, dtype=bf)
        g = 1 + 0.1 * torch.randn(K, device=d, dtype=bf)
        r = torch.randn(M, out_n, device=d, dtype=bf) if op in ("o", "down") else None
        sets.append((x, w, g, r))
    return sets


def _try(fn, dropped: list, c):
    """fn() -> its value, or None with the config dropped where it cannot launch (its shared
    memory past the SM's, say)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - triton's OutOfResources and the like: not a candidate
        dropped.append({"config": c, "error": f"{type(e).__name__}: {str(e)[:160]}"})
        return None


def run_op(op: str, N: int, K: int, M: int, mcfg) -> dict:
    from rlcu.ops import decode_linear as dl

    eps, H = mcfg.rms_norm_eps, mcfg.hidden_size
    ctx = qkv_context(mcfg, M) if op == "qkv" else None
    n_sets = max(2, -(-L2_BYTES // (N * K * 2)))
    sets = operands(op, N, K, M, H, n_sets)
    x, w, g, r = sets[0]
    r = None if r is None else r.clone()  # the timed calls add into the sets' residuals

    def result(fn):
        return fn(x, w, g, None if r is None else r.clone())

    def bind(fn):
        return [lambda s=s: fn(*s) for s in sets]

    ref = result(unfused(op, eps, ctx))
    bytes_ = N * K * 2
    row = {"op": op, "M": M, "N": N, "K": K, "weight_bytes": bytes_,
           "unfused_ms": _timed(bind(unfused(op, eps, ctx)))}
    hd = mcfg.head_dim if op == "qkv" else None
    n_out = N // 2 if op == "gate_up" else N
    heur = own_config(op, M, N, K, hd)
    row["heuristic"] = {"config": heur, "ms": _timed(bind(fused(op, eps, heur, ctx))),
                        "rel_err": rel_err(result(fused(op, eps, heur, ctx)), ref)}
    sweep, dropped = [], []

    def attempt(c, **tags):  # checked, then timed; dropped if it cannot launch or is wrong
        err = _try(lambda: rel_err(result(fused(op, eps, c, ctx)), ref), dropped, c)
        if err is not None and err > MAX_ERR:
            dropped.append({"config": c, "rel_err": err})
        elif err is not None:
            sweep.append({"config": c, "ms": _timed(bind(fused(op, eps, c, ctx))), "rel_err": err, **tags})

    for c in candidates(M, n_out, K, hd):
        attempt(c)
    best = min(sweep + [row["heuristic"]], key=lambda e: e["ms"])
    BM, BN, _, split, warps, _ = best["config"]
    for BK, stages in REFINE:  # the pipeline's depth at the best tile: the K step and the stages
        c = (BM, BN, BK, split, warps, stages)
        if c not in [e["config"] for e in sweep] and not (split > 1 and K // split < BK):
            attempt(c, refine=True)
    best = min(sweep + [row["heuristic"]], key=lambda e: e["ms"])
    row.update(sweep=sweep, dropped=dropped, best=best)
    variants = {"pdl": dict(pdl=True, prefetch=False), "pdl_prefetch": dict(pdl=True, prefetch=True)}
    if best["config"][3] > 1 and op != "qkv":  # split-K's partials by the reduce kernel (decode_qkv: inline only)
        variants["reduce_kernel"] = dict(inline_reduce=False)
    for name, upd in variants.items():  # the best tile under other launch options
        with overriding(dl.CONFIGS, **upd):
            row[name] = {"ms": _timed(bind(fused(op, eps, best["config"], ctx))),
                         "rel_err": rel_err(result(fused(op, eps, best["config"], ctx)), ref)}
    return row


def chain(cfg, M: int, table: dict, pdl: bool | None) -> float:
    """ms of one step's projections (every layer's four ops, distinct weights), unfused
    (pdl None) or fused at `table`'s tiles."""
    from rlcu.ops import decode_linear as dl

    shapes, eps, L = op_shapes(cfg), cfg.rms_norm_eps, cfg.num_hidden_layers
    d, bf = "cuda", torch.bfloat16
    layers = [{op: torch.randn(*shapes[op], device=d, dtype=bf) / shapes[op][1] ** 0.5 for op in OPS} for _ in range(L)]
    gn = 1 + 0.1 * torch.randn(cfg.hidden_size, device=d, dtype=bf)
    x = torch.randn(M, cfg.hidden_size, device=d, dtype=bf)
    o = torch.randn(M, cfg.q_size, device=d, dtype=bf)
    ctx = qkv_context(cfg, M)
    f = {op: unfused(op, eps, ctx) if pdl is None else fused(op, eps, None, ctx) for op in OPS}

    def step():
        for lw in layers:
            f["qkv"](x, lw["qkv"], gn, None)
            f["o"](o, lw["o"], None, x)
            a = f["gate_up"](x, lw["gate_up"], gn, None)
            f["down"](a, lw["down"], None, x)

    with overriding(dl.CONFIGS, table=table, pdl=bool(pdl)):
        return _timed([step], inner=1, reps=15)


def table_of(rows: list[dict]) -> dict:
    """CONFIGS["table"] from the rows: per (N, K, swiglu or "qkv": decode_qkv's), (max M, best
    config) by M; None where the unfused ops were faster than every tile."""
    table: dict = {}
    for r in sorted(rows, key=lambda r: r["M"]):
        sw = r["op"] == "gate_up"
        key = (r["N"] // 2 if sw else r["N"], r["K"], "qkv" if r["op"] == "qkv" else sw)  # decode_qkv: its KIND
        fused_wins = r["best"]["ms"] < r["unfused_ms"]  # else None: the op falls back to the unfused ops there
        table.setdefault(key, []).append((r["M"], tuple(r["best"]["config"]) if fused_wins else None))
    for entries in table.values():  # the largest M measured serves every M above it too
        entries[-1] = (1 << 30, entries[-1][1])
    return table


def load_table(path: str | Path) -> dict:
    """The `table` of a decode_linear.json as CONFIGS["table"] (keys back to tuples)."""
    data = json.loads(Path(path).read_text())
    return {tuple(json.loads(k)): [(m, None if c is None else tuple(c)) for m, c in v]
            for k, v in data["table"].items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="0.6b,8b")
    ap.add_argument("--rows", default="1,8,32,64,128,256")
    ap.add_argument("--quick", action="store_true", help="0.6B, M = 64 only")
    ap.add_argument("--json", default="decode_linear.json", help="the result's name (a partial sweep: another)")
    a = ap.parse_args()
    shapes, Ms = a.shapes.split(","), [int(m) for m in a.rows.split(",")]
    if a.quick:
        shapes, Ms = ["0.6b"], [64]
    ceil = measure_ceilings()
    copy_Bps = ceil["copy_GBps"] * 1e9
    out = {"ceilings": ceil, "rows": [], "chain": []}
    for shape in shapes:
        cfg = qwen3_06b_config(**SHAPES[shape])
        rows = []
        for op, (N, K) in op_shapes(cfg).items():
            for M in Ms:
                r = {"shape": shape, **run_op(op, N, K, M, cfg)}
                r["bound_ms"] = r["weight_bytes"] / copy_Bps * 1e3
                rows.append(r)
                print(f"{shape:>5} {op:>7} M={M:<4} bound {1e3 * r['bound_ms']:6.2f} us  unfused "
                      f"{1e3 * r['unfused_ms']:6.2f}  heuristic {1e3 * r['heuristic']['ms']:6.2f}  best "
                      f"{1e3 * r['best']['ms']:6.2f} {r['best']['config']}  pdl {1e3 * r['pdl']['ms']:6.2f}  "
                      f"+prefetch {1e3 * r['pdl_prefetch']['ms']:6.2f}" + (
                          f"  reduce kernel {1e3 * r['reduce_kernel']['ms']:6.2f}" if "reduce_kernel" in r else ""),
                      flush=True)
                torch.cuda.empty_cache()
        out["rows"] += rows
        table = table_of(rows)
        for M in Ms:
            c = {"shape": shape, "M": M, "layers": cfg.num_hidden_layers, "unfused_ms": chain(cfg, M, table, None),
                 "fused_ms": chain(cfg, M, table, False), "fused_pdl_ms": chain(cfg, M, table, True)}
            out["chain"].append(c)
            print(f"{shape:>5} chain M={M:<4} unfused {c['unfused_ms']:.3f} ms  fused {c['fused_ms']:.3f}  "
                  f"fused+pdl {c['fused_pdl_ms']:.3f}", flush=True)
            torch.cuda.empty_cache()
        # after each shape, so that a run cut short keeps what it measured
        out["table"] = {json.dumps(list(k)): v for k, v in table_of(out["rows"]).items()}
        write_json(a.json, out)


if __name__ == "__main__":
    main()
