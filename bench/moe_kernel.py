"""Qwen3-MoE's kernels (ops/moe.py) at Qwen3-30B-A3B's expert shape (E = 128, k = 8, H = 2048,
I = 768, bf16): decode (T = 1..256) against the bytes' bound, and training (T = 8192, forward and
backward) against the bf16 tensor-core peak on the active parameters; torch's per-expert loop
as the peer in both.

Decode, per T (random routing, a fresh one for each of the graph's calls, so that the experts
each call touches are read from HBM as a model's layers' are):
  rlcu_us          route_fwd + experts_fwd (softmax, top-k, sort, gate_up, SwiGLU, down, combine)
  rlcu_experts_us  experts_fwd alone (ids given)
  loop_us          torch's per-expert loop over the touched experts (rows listed on the host
                   beforehand; its routing not timed): x[rows] W1_e^T, silu * up, W2_e, index_add
  bound_us         (3 I H bytes x2 of each touched expert + x, out and the logits) / 4.3e12 B/s
Training (T = 8192): fwd_us, bwd_us (experts_bwd + route_bwd, dW into fp32 buffers) and the
loop's (its backward by autograd), MFU = 2 T k 3 I H (x3 with the backward) / time / 989e12.
Timing: CUDA graphs of 12 calls (bench.common.graph_ms) for decode; median CUDA-event times for
training. rel_err: rlcu's output against the loop's (both bf16).

    python3 bench/moe_kernel.py              # on the GPU: bench/results/moe_kernel.json
    python3 bench/moe_kernel.py --quick      # a CPU smoke test: tiny shapes, nothing written
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import event_ms, graph_ms, rel_err, write_json  # noqa: E402
from rlcu.ops.moe import experts_bwd, experts_fwd, route_bwd, route_fwd  # noqa: E402

HBM_BPS = 4.3e12
PEAK_FLOPS = 989e12
A3B = dict(E=128, k=8, H=2048, I=768)
TINY = dict(E=8, k=2, H=64, I=32)


def weights(s, dev, g):
    E, H, I = s["E"], s["H"], s["I"]
    return ((torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dev, torch.bfloat16),
            (torch.randn(E, H, I, generator=g) / I**0.5).to(dev, torch.bfloat16))


def inputs(s, T, dev, g):
    return torch.randn(T, s["H"], generator=g).to(dev, torch.bfloat16), torch.randn(T, s["E"], generator=g).to(dev)


def loop_fn(x, ids, w, wgu, wd):
    """torch's per-expert loop (transformers' Qwen3MoeExperts), the rows listed on the host here."""
    I = wd.shape[2]
    groups = []
    for e in torch.unique(ids).tolist():
        t, s = (ids == e).nonzero(as_tuple=True)
        groups.append((e, t, s))

    def f():
        out = torch.zeros_like(x)
        for e, t, s in groups:
            gu = x.index_select(0, t) @ wgu[e].t()
            a = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            out.index_add_(0, t, ((a @ wd[e].t()) * w[t, s, None]).to(x.dtype))
        return out
    return f


def timed(fns, cuda: bool) -> float:
    if cuda:
        return 1e3 * graph_ms(fns)
    fns[0]()
    t = time.perf_counter()
    fns[0]()
    return 1e6 * (time.perf_counter() - t)


def decode_row(s, T, wgu, wd, cuda, g):
    dev = wgu.device
    sets = [inputs(s, T, dev, g) for _ in range(12 if cuda else 1)]
    routed = [route_fwd(lg, s["k"], True) for _, lg in sets]
    touched = sum(torch.unique(ids).numel() for ids, _, _ in routed) / len(routed)
    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    row = {"T": T, "experts_touched": touched,
           "bound_us": (touched * 3 * I * H * 2 + 2 * T * H * 2 + T * E * 4) / HBM_BPS * 1e6}
    row["rlcu_us"] = timed([lambda x=x, lg=lg: experts_fwd(x, *route_fwd(lg, k, True)[:2], wgu, wd)[0]
                            for x, lg in sets], cuda)
    row["rlcu_experts_us"] = timed([lambda x=x, r=r: experts_fwd(x, r[0], r[1], wgu, wd)[0]
                                    for (x, _), r in zip(sets, routed)], cuda)
    row["loop_us"] = timed([loop_fn(x, r[0], r[1], wgu, wd) for (x, _), r in zip(sets, routed)], cuda)
    row["fraction_of_bound"] = row["bound_us"] / row["rlcu_us"]
    x, (ids, w, _) = sets[0][0], routed[0]
    row["rel_err"] = rel_err(experts_fwd(x, ids, w, wgu, wd)[0], loop_fn(x, ids, w, wgu, wd)())
    return row


def med_us(fn, cuda: bool) -> float:
    if cuda:
        return 1e3 * sorted(event_ms(fn, 7, warm=2))[3]
    fn()
    t = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - t)


def train_row(s, T, wgu, wd, cuda, g):
    k, H, I = s["k"], s["H"], s["I"]
    x, lg = inputs(s, T, wgu.device, g)
    dout = torch.randn_like(x)
    dgu, dd = torch.zeros(wgu.shape, device=wgu.device), torch.zeros(wd.shape, device=wgu.device)
    ids, w, p = route_fwd(lg, k, True)
    out, saved = experts_fwd(x, ids, w, wgu, wd)

    def fwd():
        i, ww, _ = route_fwd(lg, k, True)
        return experts_fwd(x, i, ww, wgu, wd)

    def bwd():
        dx, dw = experts_bwd(dout, x, w, wgu, wd, saved, dgu, dd)
        return route_bwd(dw, p, ids, w, True, None)

    flops = 2 * T * k * 3 * I * H
    row = {"T": T, "fwd_us": med_us(fwd, cuda), "bwd_us": med_us(bwd, cuda)}
    row["fwd_mfu"] = flops / (row["fwd_us"] * 1e-6) / PEAK_FLOPS
    row["bwd_mfu"] = 2 * flops / (row["bwd_us"] * 1e-6) / PEAK_FLOPS
    row["step_mfu"] = 3 * flops / ((row["fwd_us"] + row["bwd_us"]) * 1e-6) / PEAK_FLOPS
    Wg, Wd = wgu.detach().clone().requires_grad_(), wd.detach().clone().requires_grad_()
    peer = loop_fn(x, ids, w, Wg, Wd)
    row["loop_fwd_us"] = med_us(lambda: peer(), cuda)
    row["loop_fwd_bwd_us"] = med_us(lambda: peer().backward(dout), cuda)
    row["rel_err"] = rel_err(out, peer().detach())
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="decode's T")
    ap.add_argument("--train", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test), nothing written")
    ap.add_argument("--json", default="moe_kernel.json")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    s, rows, train = A3B, [int(t) for t in a.rows.split(",")], a.train
    if a.quick:
        s, rows, train = TINY, [1, 16], 64
    g = torch.Generator().manual_seed(0)
    wgu, wd = weights(s, "cuda" if cuda else "cpu", g)
    out = {"shape": s, "hbm_Bps": HBM_BPS, "peak_flops": PEAK_FLOPS, "decode": [], "train": []}
    for T in rows:
        row = decode_row(s, T, wgu, wd, cuda, g)
        out["decode"].append(row)
        print(f"decode T={T:<4} touched {row['experts_touched']:6.1f}  bound {row['bound_us']:8.2f} us  rlcu "
              f"{row['rlcu_us']:8.2f} ({row['fraction_of_bound']:.0%})  experts {row['rlcu_experts_us']:8.2f}  "
              f"loop {row['loop_us']:9.2f}  err {row['rel_err']:.1e}", flush=True)
    row = train_row(s, train, wgu, wd, cuda, g)
    out["train"].append(row)
    print(f"train  T={train}  fwd {row['fwd_us']:9.1f} us (MFU {row['fwd_mfu']:.0%})  bwd {row['bwd_us']:9.1f} us "
          f"(MFU {row['bwd_mfu']:.0%})  step MFU {row['step_mfu']:.0%}  loop fwd {row['loop_fwd_us']:9.1f} "
          f"fwd+bwd {row['loop_fwd_bwd_us']:9.1f}  err {row['rel_err']:.1e}", flush=True)
    if cuda and not a.quick:
        print(write_json(a.json, out))


if __name__ == "__main__":
    main()
