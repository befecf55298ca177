"""Decode attention over the paged KV cache (rlcu.ops.paged_attention) against its own
bandwidth bound, and a sweep of the decode kernels' launch plans.

One decode step of one layer, Qwen3-0.6B shape (16 q heads, 8 KV heads, head_dim 128, bf16,
block size 16): the fewest bytes it must move are the K and V of every cached key, read once,
plus q, o and the block tables:
    bytes = sum_s L_s * Hk * D * 2 (K, V) * 2 B + S * Hq * D * 2 (q, o) * 2 B + table entries,
and bound = bytes / copy bandwidth (measured in the same run, bytes read + written). Cases: the
generation protocol's mid-run state (B = 256, L uniform in [200, 2048]) and B x L = 64 x 1024,
256 x 512, 32 x 4096. max_seqlen_k is what the engine's CUDA graph passes: the context bucket
(1024, 4096, ...; graphs.DecodeGraphs.key), not the batch's longest context.

Each plan is checked against the reference twin (bf16 tolerance of the repo's GPU tests, 1e-2,
the output poisoned with NaN first) and timed as a CUDA graph of a few launches (as the engine
replays it): median of many replays after warm-up. Plans: the split-by-size kernel (the
previous default) at a few tile configs, then the list kernel (decode_plan kernel "list", the
default): first its tile configs at 4 units an SM, then units an SM around the best tile
config of each case (as many as the compiler lets an SM hold, and half and twice that).
Prints a table last; JSON to --out.

    python bench/decode_attention.py [--out decode_attention.json] [--quick]
    python bench/decode_attention.py --splits [--out decode_splits.json]
    python bench/decode_attention.py --list [--out decode_list.json]

--splits times the split kernel under each split policy (decode_splits: the previous rule of
the default of one split for batches of 3 programs an SM, `generate.py --split-cap`'s policy, and
caps of max_part keys a split for any batch) on batches of mixed and of equal lengths.
--list times the list kernel (ops/paged_decode_list.py: a work list a step, longest units
first, the split sequences combined in the kernel) at a few plans on the same batches, against
the default and the split cap, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import capture, meta, rel_err  # noqa: E402

Hq, Hk, D, BS = 16, 8, 128, 16
DEV, DT = "cuda", torch.bfloat16
CASES = {  # name: (B, context lengths: "uniform lo hi" or a fixed length)
    "mid-run B=256 L~U[200,2048]": (256, (200, 2048)),
    "B=64 L=1024": (64, 1024),
    "B=256 L=512": (256, 512),
    "B=32 L=4096": (32, 4096),
}
SPLIT_TILES = [  # (BN, num_warps, num_stages, maxnreg): the first is the previous default
    (64, 4, 3, None), (64, 4, 5, None), (32, 4, 5, None), (64, 8, 5, None), (128, 8, 3, None),
]
LIST_TILES = [
    (64, 4, 3, None), (64, 4, 5, None), (64, 4, 3, 128), (64, 4, 5, 128), (32, 4, 3, None),
    (32, 4, 5, None), (32, 4, 7, None), (64, 8, 3, None), (64, 8, 5, None), (128, 8, 3, None),
    (128, 8, 5, None), (128, 4, 3, None),
]


def graph_bucket(max_k: int) -> int:
    kb = 1024
    while kb < max_k:
        kb *= 4
    return kb


def build(B: int, lens, seed: int = 0):
    """A shuffled paged pool holding B random contexts -> (kernel args, lens list)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    if isinstance(lens, tuple):
        lo, hi = lens
        L = torch.randint(lo, hi + 1, (B,), generator=g, device=DEV)
    else:
        L = torch.full((B,), lens, device=DEV)
    need = (L + BS - 1) // BS
    nb = int(need.sum()) + 8
    perm = torch.randperm(nb, generator=g, device=DEV).int()
    W = int(need.max())
    tables = torch.zeros(B, W, dtype=torch.int32, device=DEV)
    start = torch.cumsum(need, 0) - need
    col = torch.arange(W, device=DEV)
    used = col[None, :] < need[:, None]
    tables[used] = perm[(start[:, None] + col[None, :])[used]]
    kc = torch.randn(nb, BS, Hk, D, generator=g, device=DEV).to(DT)
    vc = torch.randn(nb, BS, Hk, D, generator=g, device=DEV).to(DT)
    q = torch.randn(B, Hq, D, generator=g, device=DEV).to(DT)
    cu = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    return [q, kc, vc, tables, cu, L.int()], L.tolist()


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    a = torch.empty(1 << 29, device=DEV, dtype=torch.float32).uniform_()  # 2 GiB
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * a.numel() * 4 / (ms * 1e-3) / 1e9


def time_graph(fn, reps: int = 5) -> float:
    """ms a call: a CUDA graph of `reps` calls, replayed (median, triton's do_bench)."""
    from triton.testing import do_bench

    g, _ = capture(lambda: [fn() for _ in range(reps)])
    return do_bench(g.replay, warmup=20, rep=80, return_mode="median") / reps


class Case:
    def __init__(self, name, B, lens, sms, max_k=None):
        import rlcu.ops.paged_attention as pa

        self.pa, self.name, self.B, self.sms = pa, name, B, sms
        self.args, self.lens = build(B, lens)
        q, kc, vc, tables, cu, L = self.args
        self.max_k = max_k or graph_bucket(max(self.lens))
        self.scale = D**-0.5
        self.ref = pa.paged_attention_ref(*self.args, 1, self.max_k, self.scale)
        self.kcv, self.vcv = kc.view(-1, Hk, D), vc.view(-1, Hk, D)
        self.o = torch.empty_like(q)
        self.strides = (q.stride(0), q.stride(1), self.kcv.stride(0), self.kcv.stride(1),
                        tables.stride(0), self.o.stride(0), self.o.stride(1))
        keys = sum(self.lens)
        self.bytes = (keys * Hk * D * 2 * 2 + B * Hq * D * 2 * 2
                      + sum(math.ceil(n / BS) for n in self.lens) * 4)

    def launch(self, plan, work=None):
        q, _, _, tables, cu, L = self.args
        return self.pa._decode(q, self.kcv, self.vcv, tables, cu, L, self.o, self.strides,
                               self.scale * self.pa._LOG2E, BS, plan, work)

    def run(self, cfg: dict, copy_gbps: float, shared_work: bool = False) -> dict:
        """One plan: checked, then timed. shared_work (the list kernel): its work list built once
        outside the timed calls, as the engine builds it once a step for every layer."""
        plan = self.pa.decode_plan(self.B, Hk, self.max_k, self.sms, cfg)
        row = dict(case=self.name, cfg={k: v for k, v in cfg.items()},
                   plan={k: v for k, v in plan.items() if k != "kernel"}, kernel=plan["kernel"])
        try:
            work = self.pa.DecodeWork(self.args[4], self.args[5], Hk, plan) if shared_work else None
            self.o.fill_(float("nan"))
            k = self.launch(plan, work)
            if DEV == "cuda":
                torch.cuda.synchronize()
            err = rel_err(self.o, self.ref)
            row.update(err=err, ok=bool(err < 1e-2 and not torch.isnan(self.o).any()))
            row.update(occupancy(k, plan["num_warps"]))
            if work is not None:
                row.update(chunk_keys=int(work.meta[0]), units=int(work.meta[1]))
            ms = time_graph(lambda: self.launch(plan, work)) if DEV == "cuda" else wall(
                lambda: self.launch(plan, work))
        except Exception as e:  # noqa: BLE001 - out of resources etc.: not a candidate
            row.update(error=f"{type(e).__name__}: {str(e)[:200]}", ok=False)
            return row
        gbps = self.bytes / (ms * 1e-3) / 1e9
        row.update(ms=ms, GBps=gbps, frac_copy=gbps / copy_gbps, frac_4800=gbps / 4800)
        return row


def occupancy(k, nw: int) -> dict:
    """Registers, shared memory and programs an SM (H100/H200 limits) of a compiled kernel."""
    try:
        regs, shared = int(k.n_regs), int(k.metadata.shared)
    except Exception:  # noqa: BLE001 - the interpreter, or a triton without n_regs
        return {}
    return dict(regs=regs, shared=shared, fit=min(65536 // max(regs * 32 * nw, 1), 64 // nw, 32,
                                                  232448 // max(shared + 1024, 1)))


def wall(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def tile(t):
    bn, w, st, r = t
    return dict(BN=bn, num_warps=w, num_stages=st, maxnreg=r)


SPLIT_CASES = {  # name: (B, lens, max_k or None: the context bucket of the longest)
    **{f"B={B} L~U[200,2048]": (B, (200, 2048), None) for B in (32, 64, 128, 192, 256)},
    **{f"B={B} L~U[100,1024]": (B, (100, 1024), None) for B in (128, 256)},
    "B=64 L=1024": (64, 1024, None), "B=256 L=512": (256, 512, None),
    "B=128 L~U[200,2048] bucket 16k": (128, (200, 2048), 16384),
}
SPLIT_POLICIES = {  # name: CONFIGS["splits"] updates
    "default": {},  # one split for batches of 3 programs an SM
    "cap 512": dict(max_part=512),  # generate.py --split-cap
    **{f"max_part {mp}": dict(unsplit_per_sm=1 << 30, long_keys=0, long_per_sm=1 << 30, max_part=mp)
       for mp in (2048, 1024, 512, 256)},
}


def policy_sweep(copy: float, sms: int, runs: list[tuple[str, dict, dict]]) -> list[dict]:
    """Every (name, decode_plan overrides, CONFIGS["splits"] updates) of `runs` on each batch of
    SPLIT_CASES. The list kernel's work list is built outside the timed calls (the engine builds
    one a step for all layers), and that build is timed on its own (`work_ms`)."""
    import rlcu.ops.paged_attention as pa

    saved = dict(pa.CONFIGS["splits"])
    base = {**pa.CONFIGS["decode"], **pa.CONFIGS["decode_plan"]}
    out = []
    try:
        for name, (B, lens, max_k) in SPLIT_CASES.items():
            c = Case(name, B, lens, sms, max_k)
            bound_ms = c.bytes / (copy * 1e9) * 1e3
            for pname, upd, splits in runs:
                cfg = dict(base, **upd)
                pa.CONFIGS["splits"] = dict(saved, **splits)
                listed = cfg["kernel"] == "list"
                r = c.run(cfg, copy, shared_work=listed)
                r.update(policy=pname, splits_cfg=pa.CONFIGS["splits"], bound_ms=bound_ms, max_k=c.max_k)
                if listed and r.get("ok"):
                    plan = pa.decode_plan(B, Hk, c.max_k, sms, cfg)
                    cu, lens = c.args[4], c.args[5]
                    r["work_ms"] = time_graph(lambda cu=cu, lens=lens, plan=plan: pa.DecodeWork(cu, lens, Hk, plan))
                out.append(r)
                ms = f"{r['ms']:.4f} ms {r['frac_copy']:.0%}" if "ms" in r else r.get("error", "")
                what = (f" units {r.get('units')} C {r.get('chunk_keys')} work {r['work_ms']:.4f} ms" if "work_ms" in r
                        else f" splits {r['plan'].get('splits')}" if not listed else "")
                print(f"  {name:<32} {pname:<18} err {r.get('err', float('nan')):.1e} "
                      f"{'' if r['ok'] else 'FAIL '}{ms}{what}", flush=True)
            del c
            torch.cuda.empty_cache()
    finally:
        pa.CONFIGS["splits"] = saved
    return out


def split_sweep(copy: float, sms: int) -> list[dict]:
    """The split kernel under each policy of SPLIT_POLICIES (ops/paged_attention.py
    decode_splits; the max_part ones never run unsplit) on batches of mixed and of equal
    lengths: one split a sequence leaves a batch of mixed lengths waiting on its longest
    programs."""
    return policy_sweep(copy, sms, [(n, {"kernel": "split"}, upd) for n, upd in SPLIT_POLICIES.items()])


LIST_PLANS = {  # name: decode_plan of the list kernel (paged_decode_list.py), its work list shared
    f"list u{u} min{mp}{' s5' if st == 5 else ''}": dict(kernel="list", units_per_sm=u, min_part=mp, num_stages=st)
    for u, mp, st in ((2, 256, 3), (4, 256, 3), (8, 256, 3), (4, 128, 3), (4, 512, 3), (4, 256, 5))
}


def list_sweep(copy: float, sms: int) -> list[dict]:
    """The list kernel (a work list a step, longest units first, the combine in the kernel) at
    LIST_PLANS against the split kernel and the split cap of 512 keys, on the cases of --splits."""
    runs = [("split", {"kernel": "split"}, {}), ("split cap 512", {"kernel": "split"}, dict(max_part=512))]
    return policy_sweep(copy, sms, runs + [(n, cfg, {}) for n, cfg in LIST_PLANS.items()])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="defaults and a few plans only")
    ap.add_argument("--budget-s", type=float, default=110.0, help="stop sweeping after this")
    ap.add_argument("--smoke", action="store_true",
                    help="no GPU: tiny cases on the CPU under TRITON_INTERPRET=1, wall-clock")
    ap.add_argument("--splits", action="store_true",
                    help="only the split kernel's max_part policies on mixed-length batches")
    ap.add_argument("--list", action="store_true",
                    help="only the list kernel's plans against the split kernel, on the --splits cases")
    args = ap.parse_args()
    if args.splits or args.list:
        copy = copy_bandwidth()
        sweep = list_sweep if args.list else split_sweep
        rows = sweep(copy, torch.cuda.get_device_properties(0).multi_processor_count)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(meta=meta(), copy_GBps=copy, rows=rows), indent=2,
                                                 default=float))
        return 1 if any(not r.get("ok") for r in rows) else 0
    global DEV, DT, CASES, Hq, Hk, D
    if args.smoke:  # fp32: the interpreter's bf16 dots are not right
        DEV, DT, Hq, Hk, D = "cpu", torch.float32, 4, 2, 32
        CASES = {"smoke B=3 L~U[5,150]": (3, (5, 150)), "smoke B=2 L=40": (2, 40)}
        args.quick = True
    import rlcu.ops.paged_attention as pa

    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 2
    copy = copy_bandwidth() if DEV == "cuda" else 1.0
    print(f"copy bandwidth {copy:.0f} GB/s, {sms} SMs", flush=True)
    rows, summary = [], []
    default_cfg = {**pa.CONFIGS["decode"], **pa.CONFIGS["decode_plan"]}
    for name, (B, lens) in CASES.items():
        c = Case(name, B, lens, sms)
        bound_ms = c.bytes / (copy * 1e9) * 1e3
        print(f"== {name}: {sum(c.lens)} keys, {c.bytes / 1e6:.1f} MB, bound {bound_ms:.4f} ms "
              f"at copy bw, max_seqlen_k {c.max_k}", flush=True)
        case_rows = []

        def go(cfg, tag, c=c, case_rows=case_rows):
            if time.time() - t0 > args.budget_s and tag not in ("default", "previous"):
                return None
            r = c.run(cfg, copy, shared_work=cfg.get("kernel") == "list")  # one list a step, as the engine
            r.update(tag=tag, bound_ms=bound_ms)
            case_rows.append(r)
            ms = f"{r['ms']:.4f} ms {r['frac_copy']:.0%}" if "ms" in r else r.get("error", "")
            print(f"  {tag:<9} {r['kernel']:<6} {json.dumps(r['cfg'])[:95]:<95} "
                  f"err {r.get('err', float('nan')):.1e} {'' if r['ok'] else 'FAIL '}{ms}",
                  flush=True)
            return r

        go(default_cfg, "default")
        go(dict(tile(SPLIT_TILES[0]), kernel="split"), "previous")
        split_tiles = SPLIT_TILES[1:3] if args.quick else SPLIT_TILES[1:]
        for t in split_tiles:
            go(dict(tile(t), kernel="split"), "split")
        list_tiles = LIST_TILES[:4] if args.quick else LIST_TILES
        tiles = []
        for t in list_tiles:
            r = go(dict(tile(t), kernel="list", units_per_sm=4), "tile")
            if r and r.get("ok") and "ms" in r:
                tiles.append((r["ms"], t, r.get("fit") or 4))
        tiles.sort(key=lambda x: x[0])
        for _, t, fit in tiles[:1 if args.quick else 2]:
            for units in sorted({max(1, fit // 2), fit, 2 * fit} - {4}):
                go(dict(tile(t), kernel="list", units_per_sm=units), "units")
        good = [r for r in case_rows if r.get("ok") and "ms" in r]
        best = min(good, key=lambda r: r["ms"]) if good else None
        dflt = next((r for r in case_rows if r["tag"] == "default"), None)
        prev = next((r for r in case_rows if r["tag"] == "previous"), None)
        summary.append(dict(case=name, bound_ms=bound_ms, default=dflt, previous=prev, best=best))
        rows += case_rows
        del c
        if DEV == "cuda":
            torch.cuda.empty_cache()
    fails = [r for r in rows if not r.get("ok") and "error" not in r]
    payload = dict(meta=meta(), copy_GBps=copy, sms=sms, shape=dict(Hq=Hq, Hk=Hk, D=D, BS=BS),
                   default_cfg=default_cfg, summary=summary, rows=rows,
                   wrong_results=len(fails), seconds=time.time() - t0)
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2, default=float))
    print(f"\n{'case':<30} {'bound ms':>9} {'previous':>16} {'default':>16} {'best':>16}  best cfg")
    for s in summary:
        def f(r):
            return f"{r['ms']:.4f} {r['frac_copy']:4.0%}" if r and "ms" in r else "-"
        b = s["best"]
        print(f"{s['case']:<30} {s['bound_ms']:9.4f} {f(s['previous']):>16} {f(s['default']):>16} "
              f"{f(b):>16}  {b['kernel'] if b else ''} {json.dumps(b['cfg']) if b else ''}")
    print(f"wrong results: {len(fails)}; {time.time() - t0:.0f} s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
