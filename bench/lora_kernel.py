"""ops/lora.py's grouped LoRA products (shrink + expand of one module) at Qwen3-8B's module shapes,
8 adapters, r = 64: decode (T = 1..256) and prefill (T = 8192), against the bytes' bound and
torch's peers.

Per (module, T, layout):
  rlcu        lora_shrink + lora_expand, one launch each (+ the split reduce)
  rlcu_order  the same with `order` (idx.argsort, made once a step outside the timing), for the
              unsorted layout
  loop        torch's per-adapter loop: x[rows_j] a_j^T, then y.index_add_ of scale h_j b_j^T, the
              row lists made on the host beforehand (as a peer that knows its batch would)
  bmm         decode only: a[idx] and b[idx] gathered per row, then torch.bmm (punica's baseline)
  bound_us    (a and b bytes of the adapters the rows use + x + y read and written + h written and
              read) / 4.3e12 B/s
Layouts: `grouped` (rows sorted by adapter, T/8 each: what prefill's runs and an engine that
groups its batch give), `random` (decode: each row a random adapter, some -1). Timing: a CUDA
graph of 12 calls cycling through operand copies that exceed L2 (bench.common.graph_ms), so each
call reads its adapters from HBM as a model's layers do. The kernel's y and the loop's against
float64 (the update's relative error, y rounded to bf16 in both).

    python3 bench/lora_kernel.py                    # on the GPU: bench/results/lora_kernel.json
    python3 bench/lora_kernel.py --quick            # a CPU smoke test: tiny shapes, nothing written
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, rel_err, write_json  # noqa: E402
from rlcu.ops.lora import lora_expand, lora_shrink  # noqa: E402

HBM_BPS = 4.3e12
L2_BYTES = 120 << 20


def modules(H: int, I: int, Hq: int, Hk: int, D: int) -> dict:
    """name -> (K, slices' widths) of a Qwen3 layer's LoRA targets."""
    return {"qkv": (H, (Hq * D, Hk * D, Hk * D)), "o": (Hq * D, (H,)), "gate_up": (H, (I, I)), "down": (I, (H,))}


QWEN3_8B = modules(4096, 12288, 32, 8, 128)
TINY = modules(256, 512, 4, 2, 32)


def ids_for(T: int, n: int, layout: str, g: torch.Generator) -> torch.Tensor:
    if layout == "grouped":
        return (torch.arange(T) * n // T).to(torch.int32)
    ids = torch.randint(0, n, (T,), generator=g, dtype=torch.int32)
    ids[torch.rand(T, generator=g) < 0.1] = -1  # some rows without adapter
    return ids


def operands(K, widths, T, n, r, ids, dev, g):
    S, N = len(widths), sum(widths)
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    return dict(x=torch.randn(T, K, generator=g).to(dev, torch.bfloat16),
                a=(torch.randn(n, S * r, K, generator=g) / K**0.5).to(dev, torch.bfloat16),
                b=(torch.randn(n, N, r, generator=g) / r**0.5).to(dev, torch.bfloat16),
                y=torch.randn(T, N, generator=g).to(dev, torch.bfloat16), idx=ids.to(dev),
                scale=torch.full((n,), 2.0, device=dev), slices=tuple(zip(bounds[:-1], bounds[1:])))


def bound_bytes(o) -> int:
    used = torch.unique(o["idx"][o["idx"] >= 0]).numel()
    a, b, x, y = o["a"], o["b"], o["x"], o["y"]
    h = x.shape[0] * a.shape[1] * 4
    return used * (a[0].numel() + b[0].numel()) * 2 + x.numel() * 2 + 2 * y.numel() * 2 + 2 * h


def rlcu_fn(o, order=None):
    def f():
        h = lora_shrink(o["x"], o["a"], o["idx"], order)
        return lora_expand(h, o["b"], o["idx"], o["y"], o["scale"], o["slices"], order)
    return f


def loop_fn(o):
    """torch's per-adapter loop, its row lists made here (host), once."""
    r = o["b"].shape[2]
    groups = [(j, (o["idx"] == j).nonzero().flatten()) for j in range(o["a"].shape[0])]
    groups = [(j, rows) for j, rows in groups if len(rows)]
    scales = o["scale"].tolist()  # on the host beforehand: a read inside f would sync (and break a capture)

    def f():
        for j, rows in groups:
            h = o["x"].index_select(0, rows) @ o["a"][j].t()
            out = torch.cat([(h[:, s * r:(s + 1) * r] @ o["b"][j, c0:c1].t()) for s, (c0, c1) in
                             enumerate(o["slices"])], 1)
            o["y"].index_add_(0, rows, out, alpha=scales[j])
        return o["y"]
    return f


def bmm_fn(o):
    """Every row's adapter gathered, then batched products (rows without adapter masked)."""
    r, keep = o["b"].shape[2], (o["idx"] >= 0)
    ids = o["idx"].clamp(min=0).long()

    def f():
        h = torch.bmm(o["a"][ids], o["x"][:, :, None])[:, :, 0]  # [T, R]
        bs = o["b"][ids]  # [T, N, r]
        out = torch.cat([torch.bmm(bs[:, c0:c1], h[:, s * r:(s + 1) * r, None])[:, :, 0]
                         for s, (c0, c1) in enumerate(o["slices"])], 1)
        o["y"].add_(out * (o["scale"][ids] * keep)[:, None])
        return o["y"]
    return f


def timed(fns, cuda: bool) -> float:
    """Microseconds a call: graph replays over the operand copies' calls (GPU), else one timed call (CPU)."""
    if cuda:
        return 1e3 * graph_ms(fns)
    fns[0]()
    t = time.perf_counter()
    fns[0]()
    return 1e6 * (time.perf_counter() - t)


def run(name, K, widths, T, n, r, layout, cuda, seed=0):
    dev = "cuda" if cuda else "cpu"
    g = torch.Generator().manual_seed(seed)
    ids = ids_for(T, n, layout, g)
    first = operands(K, widths, T, n, r, ids, dev, g)
    per = sum(t.numel() * t.element_size() for t in (first["x"], first["a"], first["b"], first["y"]))
    copies = max(1, min(12, -(-L2_BYTES // per))) if cuda else 1
    sets = [first] + [operands(K, widths, T, n, r, ids, dev, g) for _ in range(copies - 1)]
    y0 = first["y"].clone()
    row = {"module": name, "T": T, "layout": layout, "K": K, "N": sum(widths), "slices": len(widths), "r": r,
           "adapters": n, "bound_us": bound_bytes(first) / HBM_BPS * 1e6}
    row["rlcu_us"] = timed([rlcu_fn(o) for o in sets], cuda)
    if layout == "random":
        row["rlcu_order_us"] = timed([rlcu_fn(o, o["idx"].argsort(stable=True).to(torch.int32)) for o in sets], cuda)
    row["loop_us"] = timed([loop_fn(o) for o in sets], cuda)
    if T <= 256:
        row["bmm_us"] = timed([bmm_fn(o) for o in sets], cuda)
    exact = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in first.items()}
    exact["y"] = y0.double()
    want = loop_fn(exact)() - y0.double()  # the update in float64
    for name, make in (("rlcu", rlcu_fn), ("loop", loop_fn)):
        first["y"].copy_(y0)
        row[f"{name}_rel_err"] = rel_err(make(first)().double() - y0.double(), want)  # the update's, y rounded
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32,64,128,256", help="decode's T")
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--r", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test), nothing written")
    ap.add_argument("--json", default="lora_kernel.json")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    shapes, rows, prefill, r = QWEN3_8B, [int(t) for t in a.rows.split(",")], a.prefill, a.r
    if a.quick:
        shapes, rows, prefill, r = TINY, [1, 16], 64, 16
    out = {"hbm_Bps": HBM_BPS, "rows": [], "layer": []}
    for T, layouts in [(t, ("grouped", "random")) for t in rows] + [(prefill, ("grouped",))]:
        for layout in layouts:
            layer = {"T": T, "layout": layout}
            for name, (K, widths) in shapes.items():
                row = run(name, K, widths, T, a.adapters, r, layout, cuda)
                out["rows"].append(row)
                for k in ("bound_us", "rlcu_us", "rlcu_order_us", "loop_us", "bmm_us"):
                    if k in row:
                        layer[k] = layer.get(k, 0.0) + row[k]
                print(f"{name:>8} T={T:<5} {layout:>8}  bound {row['bound_us']:8.2f} us  rlcu {row['rlcu_us']:8.2f}"
                      + (f"  +order {row['rlcu_order_us']:8.2f}" if "rlcu_order_us" in row else "")
                      + f"  loop {row['loop_us']:8.2f}" + (f"  bmm {row['bmm_us']:8.2f}" if "bmm_us" in row else "")
                      + f"  err {row['rlcu_rel_err']:.1e} (loop {row['loop_rel_err']:.1e})", flush=True)
                if cuda:
                    torch.cuda.empty_cache()
            out["layer"].append(layer)
            print(f"   layer T={T:<5} {layout:>8}  " + "  ".join(f"{k} {v:.2f}" for k, v in layer.items()
                                                              if k.endswith("_us")), flush=True)
        if cuda and not a.quick:
            write_json(a.json, out)  # after each T, so that a run cut short keeps what it measured


if __name__ == "__main__":
    main()
