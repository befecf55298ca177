"""Tile sweeps of two kernel families far from their bound on the H200, in one process and one
short GPU call: the MoE grouped GEMMs (ops/moe_gemm.py) at Qwen3-30B-A3B's expert shape (E = 128,
k = 8, H = 2048, I = 768, T = 8192 tokens) and the grouped LoRA products (ops/lora.py) at
Qwen3-8B's modules (qkv, o, gate_up, down; r = 64, 8 adapters, rows grouped by adapter) at T = 1,
256 and 8192.

Cases, each a table entry the kernels read at call time (`bench.common.overriding` installs a
candidate; the tables in the op files stay the source of truth), swept in this order, a later
case on the earlier winners:
  moe prefill      CONFIGS['prefill']: experts_fwd (sort, gate_up, SwiGLU, down, combine)
  moe prefill_dx   CONFIGS['prefill_dx']: experts_bwd without weight gradients (the dA GEMMs), at
                   the prefill winner's BM (the layout's)
  moe dw           CONFIGS['dw']: the two weight-gradient GEMMs into fp32 buffers
  lora shrink T    CONFIGS['tiles'][row of T][1]: lora_apply over the 4 modules (a layer)
  lora expand T    CONFIGS['tiles'][row of T][2]: the same
  lora fuse T      CONFIGS['fuse_max_t']: the expand adding the split partials, or the reduce's h
Exactness: a candidate's outputs are compared with the current config's on the same inputs.
Where exact mode rests on them (the MoE forward, LoRA's h and y) only bit-equal candidates may
win; the others are dropped untimed ("bits differ"). BM, BN, the warps, stages and program order
never change a row's bits (matmul_invariant's measurement); BK may (the candidates here keep K a
multiple of it), K_SPLIT would and is not swept. The backward's dA GEMMs and dW need no bits of
exact mode: their candidates may win within a relative error of 1e-2 (the bit equality is
reported).

Peer: the current configs (the tables as they stand), the first row of every case, timed in the
same process on the same inputs. Timing: a CUDA graph of back-to-back calls (cycling through
operand copies that exceed L2 where one set would fit), replayed between CUDA events, the median
of 5 after a warm-up (bench.common.graph_ms); on the CPU one timed call. The first call of a
candidate compiles it (0.5-2 s): the candidate lists are short and ordered by likelihood, and a
budget (--budget, shared out by case) skips the rest of a case's list when its share is spent.
The JSON is written after each case, so a run cut short keeps what it measured.

    python3 bench/kernel_tune.py            # on the GPU (< 120 s): bench/results/kernel_tune.json
    python3 bench/kernel_tune.py --quick    # CPU, Triton's interpreter, tiny shapes: nothing written
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

if "--quick" in sys.argv:  # before triton is imported: the interpreter decides at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("RLCU_BACKEND", "triton")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import lora_kernel, moe_kernel  # noqa: E402
from bench.common import event_ms, graph_ms, overriding, rel_err, write_json  # noqa: E402
from rlcu.ops import lora, moe_gemm  # noqa: E402
from rlcu.ops._backend import interpreting  # noqa: E402
from rlcu.ops.lora import lora_apply, lora_shrink  # noqa: E402
from rlcu.ops.moe import experts_bwd, experts_fwd, route_fwd  # noqa: E402
from rlcu.ops.moe_gemm import grouped_dw, grouped_mm, moe_combine_bwd  # noqa: E402
from rlcu.ops.swiglu import swiglu_bwd  # noqa: E402

# candidates after the current config, most likely first (H100/H200 Triton bf16 GEMMs: 64-128 x
# 128-256 tiles at BK 64, 4-8 warps, 3-4 stages; blocks grouped so that A rows are read once)
MOE = {  # (BM, BN, BK, warps, stages, GROUP)
    "prefill": [(64, 128, 64, 4, 3, 8), (128, 128, 64, 8, 3, 8), (64, 256, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8),
                (64, 128, 64, 4, 4, 8), (128, 128, 64, 8, 4, 8), (64, 128, 128, 8, 3, 8), (64, 256, 64, 4, 3, 8),
                (128, 256, 64, 8, 4, 8), (64, 128, 64, 4, 3, 1), (64, 128, 64, 4, 3, 32), (128, 128, 64, 4, 3, 8)],
    "dx": [(128, 64, 4, 3, 8), (256, 64, 8, 3, 8), (128, 128, 8, 3, 8), (128, 64, 4, 4, 8), (128, 64, 8, 3, 8),
           (256, 64, 8, 4, 8), (128, 64, 4, 3, 1)],  # (BN, BK, warps, stages, GROUP) at the prefill winner's BM
    "dw": [(64, 128, 128, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3),  # (BM, BN, BK,
           (64, 128, 128, 8, 4), (128, 128, 64, 8, 4), (64, 64, 128, 4, 4), (128, 128, 128, 8, 2),  # warps, stages)
           (64, 128, 64, 8, 4)],
    # spill-free at sm_90 (ptxas -v); (128, 128, 256, 8, 2), 7% faster at 32768 tokens, spills 160 bytes
    "dw_long": [(128, 128, 128, 8, 3), (64, 128, 128, 8, 2), (128, 256, 64, 8, 3), (128, 128, 64, 8, 3),
                (64, 64, 64, 4, 3)],
}
LORA = {  # T -> shrink's (BK, BM, BR, warps, stages), expand's (BM, BN, warps, stages)
    1: ([(128, 16, 16, 4, 2), (128, 16, 16, 2, 4), (64, 16, 16, 4, 4), (128, 16, 32, 4, 4), (128, 16, 16, 8, 4),
         (64, 16, 16, 4, 6), (128, 16, 16, 4, 3)],
        [(16, 32, 4, 2), (16, 128, 4, 2), (16, 64, 2, 1), (16, 256, 8, 2), (16, 32, 2, 1)]),
    256: ([(128, 32, 32, 4, 4), (128, 64, 64, 4, 3), (64, 32, 32, 4, 4), (128, 16, 32, 4, 4), (128, 64, 32, 4, 4),
           (64, 64, 64, 4, 4), (128, 32, 16, 4, 4)],
          [(32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (16, 128, 4, 2), (32, 32, 4, 2)]),
    8192: ([(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (128, 64, 32, 4, 4), (128, 128, 64, 8, 4),
            (64, 128, 64, 8, 4)],
           [(128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2)]),
}
# every candidate above compiles for sm_90 without spilling (ptxas -v, as tests/support/sm90_launches.py reads it)
# the same under the interpreter (--quick): tiny tiles, one candidate a case that keeps the bits
# and one that changes BK (dropped where bits are required)
MOE_QUICK = {"prefill": [(32, 16, 32, 4, 1, 2)], "dx": [(16, 32, 4, 1, 1)], "dw": [(16, 16, 32, 4, 1)],
             "dw_long": [(16, 16, 32, 4, 1)]}
LORA_QUICK = {1: ([(16, 16, 16, 4, 1)], [(16, 32, 4, 1)]), 24: ([(32, 32, 16, 4, 1)], [(32, 16, 4, 1)])}
QUICK_MODULES = lora_kernel.modules(128, 128, 2, 1, 32)
# shares of the budget: the families', then their cases' (MoE: prefill, dx, dw; LoRA per T:
# shrink, expand, fuse), weighed by their compiles (a MoE candidate compiles two GEMMs)
SHARES = {"moe": 0.55, "lora": 0.45}
CASE_WEIGHTS = {"moe": (0.4, 0.25, 0.35), "lora": (0.4, 0.4, 0.2)}


class Clock:
    """The budget's deadlines: a case ends at the sum of the shares up to and including its
    own, so an early finish leaves its time to the next."""

    def __init__(self, budget: float):
        self.t0, self.budget, self.start = time.perf_counter(), budget, 0.0

    def family(self, share: float, weights) -> list[float]:
        out, total = [], sum(weights)
        for w in weights:
            self.start += share * w / total
            out.append(self.t0 + self.budget * self.start)
        return out

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def time_us(fns, per: int = 1) -> float:
    """Microseconds of `per` calls: the mean call of a graph of fns cycled (bench.common.graph_ms)
    times per; eager passes over fns between CUDA events where a capture fails."""
    inner = len(fns) if len(fns) > 1 else 3
    try:
        return 1e3 * per * graph_ms(fns, inner=inner, reps=5, warm=1)
    except Exception as e:  # not capturable: eager launches (their gaps included)
        print(f"  (graph capture failed, eager timing: {type(e).__name__})", flush=True)
        torch.cuda.synchronize()
        ms = event_ms(lambda: [fns[i % len(fns)]() for i in range(inner)], 5, warm=1)
        return 1e3 * per * sorted(ms)[2] / inner


def sweep(name: str, where: str, current, cands, apply, outputs, fns, exact: bool, deadline: float, cuda: bool,
          per: int = 1) -> dict:
    """Time current then each candidate (installed by apply(cfg)), their outputs() against
    current's; -> the case's record, its best among the eligible (current where current failed:
    its error is in the record, and the later cases go on)."""
    rows, ref = [], None
    for i, cfg in enumerate([current] + [c for c in cands if c != current]):
        row = {"config": cfg}
        rows.append(row)
        if i and time.perf_counter() > deadline:
            row["skipped"] = "budget"
            continue
        try:
            with apply(cfg):
                t = time.perf_counter()
                out = outputs()
                t = time.perf_counter() - t
                if ref is None:
                    ref = out
                else:
                    row["bit_equal"] = all(torch.equal(a, b) for a, b in zip(out, ref))
                    row["rel_err"] = max(rel_err(a, b) for a, b in zip(out, ref))
                    if not (row["bit_equal"] or (not exact and row["rel_err"] < 1e-2)):
                        row["skipped"] = "bits differ" if exact else "error above 1e-2"
                        continue
                row["us"] = time_us(fns(), per) if cuda else 1e6 * t  # CPU: the outputs' call (mechanics only)
        except Exception as e:  # a tile the device cannot hold (shared memory), a compile failure
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if i == 0:
                break
        finally:
            if cuda:
                torch.cuda.synchronize()
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else rows[0]
    rec = {"case": name, "where": where, "exact": exact, "current": rows[0], "best": best,
           "speedup": rows[0]["us"] / best["us"] if timed else None, "candidates": rows}
    DONE.append(rec)
    if SAVE:
        SAVE()  # after each case: a run cut short keeps what it measured
    if not timed:
        print(f"{name:<18} current {fmt(current)} FAILED: {rows[0]['error']}", flush=True)
        return rec
    print(f"{name:<18} current {fmt(current):<26} {rows[0]['us']:9.1f} us   best {fmt(best['config']):<26} "
          f"{best['us']:9.1f} us  x{rec['speedup']:.2f}   ({len(timed)} timed, {len(rows) - len(timed)} dropped, "
          f"{time.perf_counter() - T0:.0f} s)", flush=True)
    return rec


def fmt(cfg) -> str:
    return "(" + ",".join(str(c) for c in cfg) + ")" if isinstance(cfg, (tuple, list)) else str(cfg)


def fwd_out(res) -> list:
    out, sv = res
    return [out, sv.gu[sv.layout.pos.long()]]  # gate_up's rows by pair: the same whatever the layout's BM


def moe_cases(quick: bool, dev: str, clock: Clock, cuda: bool, share: float, tokens: int = 8192,
              dw_only: bool = False) -> list[dict]:
    """The MoE sweeps at `tokens` tokens; dw_only: the weight gradient's alone, on the current
    forward and dA tiles (the sweep of the train step's micro-batch, deeper K sums)."""
    s, T = (dict(E=2, k=2, H=128, I=128), 40) if quick else (moe_kernel.A3B, tokens)  # quick: prefill's too
    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    g = torch.Generator(dev).manual_seed(0)
    wgu, wd = randn(g, E, 2 * I, H) / H**0.5, randn(g, E, H, I) / I**0.5
    x, dout = randn(g, T, H), randn(g, T, H)
    ids, w, _ = route_fwd(randn(g, T, E), k, True)
    table = moe_gemm._INTERPRET if interpreting() else moe_gemm.CONFIGS
    regime = moe_gemm.regime(T, k, E, math.gcd(H, I))
    cands = MOE_QUICK if quick else MOE
    ends = clock.family(share, CASE_WEIGHTS["moe"])
    src = "src/rlcu/ops/moe_gemm.py CONFIGS"
    out = [] if dw_only else [sweep(
        f"moe {regime}", f"{src}[{regime!r}]", table[regime], cands["prefill"],
        lambda c: overriding(table, **{regime: c}), lambda: fwd_out(experts_fwd(x, ids, w, wgu, wd)),
        lambda: [lambda: experts_fwd(x, ids, w, wgu, wd)], True, ends[0], cuda)]
    fwd = table[regime] if dw_only else out[0]["best"]["config"]
    saved = {}

    def fwd_saved():  # the forward's saved tensors at the winner's layout (BM)
        if "s" not in saved:
            with overriding(table, **{regime: fwd}):
                saved["s"] = experts_fwd(x, ids, w, wgu, wd)[1]
        return saved["s"]

    dx_key = f"{regime}_dx"
    bm = fwd[0]
    cur_dx = table[dx_key] if table[dx_key][0] == bm else (bm, *table[dx_key][1:])
    bwd = lambda: experts_bwd(dout, x, w, wgu, wd, fwd_saved(), None, None)  # noqa: E731
    if not dw_only:
        out.append(sweep(f"moe {dx_key}", f"{src}[{dx_key!r}] (BM = {regime}'s)", cur_dx,
                         [(bm, *c) for c in cands["dx"]], lambda c: overriding(table, **{regime: fwd, dx_key: c}),
                         lambda: list(bwd()), lambda: [bwd], False, ends[1], cuda))
    dx = cur_dx if dw_only else out[1]["best"]["config"]
    with overriding(table, **{regime: fwd, dx_key: dx}):
        sv = fwd_saved()
        dy, _ = moe_combine_bwd(dout, sv.y, sv.layout.pos, w)
        dgu = swiglu_bwd(grouped_mm(dy, wd.transpose(1, 2), sv.layout, False, dx_key), sv.gu)
    bufs = (torch.zeros(wd.shape, device=dev), torch.zeros(wgu.shape, device=dev))

    def dw(zero: bool):
        if zero:
            for b in bufs:
                b.zero_()
        grouped_dw(dy, sv.a, sv.layout, False, bufs[0])
        grouped_dw(dgu, x, sv.layout, True, bufs[1])
        return [b.clone() for b in bufs] if zero else None

    key = moe_gemm.dw_regime(sv.layout.pairs.shape[0], E)  # the table's row grouped_dw takes at this depth
    out.append(sweep(f"moe {key} T={T}", f"{src}[{key!r}]", table[key], cands[key],
                     lambda c: overriding(table, **{key: c}), lambda: dw(True), lambda: [lambda: dw(False)], False,
                     ends[2], cuda))
    return out


def randn(g: torch.Generator, *shape) -> torch.Tensor:
    """bf16 normal values made on g's device (the A3B weights would take seconds on the host)."""
    return torch.randn(*shape, generator=g, device=g.device, dtype=torch.bfloat16)


def lora_operands(K, widths, T, n, r, g) -> dict:
    """lora_kernel.operands' tensors, made on g's device: T rows grouped by adapter (T / n each)."""
    S, N = len(widths), sum(widths)
    bounds = [0]
    for wd in widths:
        bounds.append(bounds[-1] + wd)
    return dict(x=randn(g, T, K), a=randn(g, n, S * r, K) / K**0.5, b=randn(g, n, N, r) / r**0.5, y=randn(g, T, N),
                idx=(torch.arange(T, device=g.device) * n // T).to(torch.int32),
                scale=torch.full((n,), 2.0, device=g.device), slices=tuple(zip(bounds[:-1], bounds[1:])))


def lora_sets(quick: bool, T: int, dev: str, cuda: bool):
    """Per module: the operand sets (copies past L2 on the GPU) of T rows grouped by adapter."""
    shapes, n, r = (QUICK_MODULES, 2, 16) if quick else (lora_kernel.QWEN3_8B, 8, 64)
    g = torch.Generator(dev).manual_seed(1)
    sets = {}
    for name, (K, widths) in shapes.items():
        first = lora_operands(K, widths, T, n, r, g)
        per = sum(first[k].numel() * first[k].element_size() for k in ("x", "a", "b", "y"))
        copies = max(1, min(12, -(-lora_kernel.L2_BYTES // per))) if cuda else 1
        sets[name] = [first] + [lora_operands(K, widths, T, n, r, g) for _ in range(copies - 1)]
    return sets


def lora_cases(quick: bool, dev: str, clock: Clock, cuda: bool, share: float) -> list[dict]:
    table = lora._INTERPRET if interpreting() else lora.CONFIGS
    plan = LORA_QUICK if quick else LORA
    ends = iter(clock.family(share, CASE_WEIGHTS["lora"] * len(plan)))
    src = "src/rlcu/ops/lora.py CONFIGS"
    out = []
    for T, (shrinks, expands) in plan.items():
        sets = lora_sets(quick, T, dev, cuda)
        mods = len(sets)
        per = mods  # time_us: a layer's (each module once)
        row = next(i for i, rw in enumerate(table["tiles"]) if rw[0] is None or T <= rw[0])
        y0 = {m: [o["y"].clone() for o in v] for m, v in sets.items()}

        def tiles(shrink=None, expand=None, row=row):
            cur = table["tiles"][row]
            new = (cur[0], shrink or cur[1], expand or cur[2])
            return table["tiles"][:row] + (new,) + table["tiles"][row + 1:]

        def run_y():
            res = []
            for m, v in sets.items():
                o = v[0]
                o["y"].copy_(y0[m][0])
                res.append(lora_apply(o["x"], o["a"], o["b"], o["idx"], o["y"], o["scale"], o["slices"]).clone())
            return res

        def h_and_y():
            return [lora_shrink(v[0]["x"], v[0]["a"], v[0]["idx"]) for v in sets.values()] + run_y()

        def fns():
            return [lambda o=o: lora_apply(o["x"], o["a"], o["b"], o["idx"], o["y"], o["scale"], o["slices"])
                    for v in sets.values() for o in v]

        cur = table["tiles"][row]
        rec = sweep(f"lora shrink T={T}", f"{src}['tiles'][{row}][1]", cur[1], shrinks,
                    lambda c: overriding(table, tiles=tiles(shrink=c)), h_and_y, fns, True, next(ends), cuda, per)
        shrink = rec["best"]["config"]
        out.append(rec)
        rec = sweep(f"lora expand T={T}", f"{src}['tiles'][{row}][2]", cur[2], expands,
                    lambda c: overriding(table, tiles=tiles(shrink, c)), run_y, fns, True, next(ends), cuda, per)
        out.append(rec)
        best = tiles(shrink, rec["best"]["config"])
        fuse = table["fuse_max_t"]  # T <= it: the expand adds the partials; past it the reduce's h
        out.append(sweep(f"lora fuse T={T}", f"{src}['fuse_max_t'] (>= {T}: fused at T)", fuse,
                         [T - 1 if T <= fuse else T], lambda f: overriding(table, tiles=best, fuse_max_t=f), run_y,
                         fns, True, next(ends), cuda, per))
        if cuda:
            torch.cuda.empty_cache()
    return out


T0 = time.perf_counter()
DONE: list[dict] = []  # the cases' records, in order
SAVE = None  # on the GPU: writes DONE to the JSON


def main():
    global SAVE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, Triton's interpreter (CPU), nothing written")
    ap.add_argument("--budget", type=float, help="seconds for the sweeps, compiles included (default 105; --quick 600)")
    ap.add_argument("--only", choices=["moe", "lora", "moe_dw"], help="one family (moe_dw: the weight gradient's)")
    ap.add_argument("--moe-tokens", type=int, default=8192, help="the MoE sweeps' tokens (32768: the train step's)")
    ap.add_argument("--json", default="kernel_tune.json")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.quick
    dev = "cuda" if cuda else "cpu"
    budget = a.budget or (600.0 if a.quick else 105.0)
    clock = Clock(budget)
    if cuda:
        SAVE = lambda: write_json(a.json, {"budget_s": budget, "elapsed_s": clock.elapsed(), "cases": DONE})  # noqa: E731
    if a.only != "lora":
        moe_cases(a.quick, dev, clock, cuda, 1.0 if a.only else SHARES["moe"], a.moe_tokens, a.only == "moe_dw")
    if a.only not in ("moe", "moe_dw"):
        lora_cases(a.quick, dev, clock, cuda, 1.0 if a.only else SHARES["lora"])
    print("\nwinners (paste where `where` says; a config equal to the current one needs no change):")
    for c in DONE:
        if c["speedup"] and c["best"]["config"] != c["current"]["config"]:
            print(f"  {c['where']}: {fmt(c['current']['config'])} -> {fmt(c['best']['config'])}  "
                  f"x{c['speedup']:.2f}")
    print(f"total {clock.elapsed():.0f} s", flush=True)
    if cuda:
        print(SAVE())


if __name__ == "__main__":
    main()
