"""The LM head with the sampler's first pass in its epilogue (ops/head_sample.py) against the two
it replaces, in the same run: cuBLAS's `h @ W.t()` then `sampling.sample` (its pass-1 and row
kernels), on the Qwen3 0.6B and 8B head shapes (V = 151936, K = 1024 / 4096, random bf16), at
1-256 rows, temperature 0.6 (RL's rows) and top-k 50 + top-p 0.9.

Each side is one CUDA graph, timed by CUDA events (median of 30 replays after 5); its bound is
the head's weight bytes at the copy bandwidth and its FLOPs at the bf16 matmul rate, both
measured in the same run. Checked: the fused kernel's tokens are exactly those `sample` draws
from the logits the kernel wrote, and its logits are within bf16 rounding of cuBLAS's.

    python bench/head_sample.py [--shapes 0.6b,8b] [--batches 1,16,64,128,256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import capture, measure_ceilings, replay_ms, write_json  # noqa: E402

V = 151936
HIDDEN = {"0.6b": 1024, "8b": 4096}
CASES = {"temperature 0.6": (0.6, 0, 1.0), "top-k 50 + top-p 0.9": (0.6, 50, 0.9)}


def params(B: int, what: str) -> tuple:
    T, k, p = CASES[what]
    f = torch.ones(B, device="cuda")
    return (f * T, torch.full((B,), k, device="cuda", dtype=torch.int32), f * p, f * 0.0,
            torch.arange(B, device="cuda", dtype=torch.int64) * 7 + 1, torch.full((B,), 5, device="cuda",
                                                                           dtype=torch.int64))


def run_case(K: int, B: int, what: str, ceil: dict) -> dict:
    from rlcu.ops.head_sample import head_sample
    from rlcu.ops.sampling import sample

    g = torch.Generator(device="cuda").manual_seed(B)
    h = torch.randn(B, K, device="cuda", generator=g).bfloat16()
    W = (torch.randn(V, K, device="cuda", generator=g) * 0.05).bfloat16()
    p = params(B, what)
    g_peer, (t_peer, _) = capture(lambda: sample(h @ W.t(), *p))
    g_ours, (t_ours, lp_ours, logits) = capture(lambda: head_sample(h, W, *p))
    ms_peer = replay_ms(g_peer.replay, 30, warm=5)
    ms_ours = replay_ms(g_ours.replay, 30, warm=5)
    t_check, lp_check = sample(logits, *p)
    ref = (h @ W.t()).float()
    bytes_ms = W.numel() * 2 / (ceil["copy_GBps"] * 1e9) * 1e3
    flops_ms = 2 * B * K * V / (ceil["bf16_matmul_TFLOPs"] * 1e12) * 1e3
    return {"K": K, "B": B, "case": what, "cublas_then_sample_ms": ms_peer, "head_sample_ms": ms_ours,
            "speedup": ms_peer / ms_ours, "bound_ms": max(bytes_ms, flops_ms), "weight_bytes_ms": bytes_ms,
            "flops_ms": flops_ms, "tokens_equal_to_sample_of_its_logits": bool(torch.equal(t_ours, t_check)),
            "logprob_max_diff": float((lp_ours - lp_check).abs().max()),
            "logits_rel_err_vs_cublas": float((logits.float() - ref).norm() / ref.norm()),
            "tokens_equal_to_cublas_path": int((t_ours == t_peer).sum())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="0.6b,8b")
    ap.add_argument("--batches", default="1,16,64,128,256")
    a = ap.parse_args()
    ceil = measure_ceilings()
    rows = []
    for shape in a.shapes.split(","):
        for B in map(int, a.batches.split(",")):
            for what in CASES:
                r = {"shape": shape, **run_case(HIDDEN[shape], B, what, ceil)}
                rows.append(r)
                print(f"{shape:>5} B={B:<4} {what:<22} cuBLAS + sample {r['cublas_then_sample_ms'] * 1e3:7.1f} us  "
                      f"head_sample {r['head_sample_ms'] * 1e3:7.1f} us ({r['speedup']:.2f}x)  bound "
                      f"{r['bound_ms'] * 1e3:6.1f} us  tokens == sample(its logits): "
                      f"{r['tokens_equal_to_sample_of_its_logits']}  logits rel err "
                      f"{r['logits_rel_err_vs_cublas']:.1e}",
                      flush=True)
        torch.cuda.empty_cache()
    write_json("head_sample.json", {"ceilings": ceil, "rows": rows})


if __name__ == "__main__":
    main()
