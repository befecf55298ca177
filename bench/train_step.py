"""Training-step benchmark (BENCHMARKS.md section 2): batch 32 x 1024 tokens, next-token loss
on all tokens, AdamW step, Qwen3-0.6B shape with random bf16 weights.

rlcu: bf16 weights, fp32 master + moments, gradient checkpointing by layer, the fused
logprob head, Triton kernels. Peer (same run): HF transformers Qwen3ForCausalLM in bf16,
SDPA attention, torch.optim.AdamW(fused=True), no checkpointing.
MFU = 3 x forward FLOPs x tokens / time / 989e12.

    python bench/train_step.py [--batch 32 --seqlen 1024 --steps 6 --no-hf]
    python bench/train_step.py --graph [--cases 32x1024,8x1024,4x512,critic:8x1024]

--graph: the step replayed as CUDA graphs against the same step eager, per case, each case in
its own process (bench/train_graph.py; train_graph.json).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import qwen3_06b_config, write_json  # noqa: E402

PEAK_FLOPS = 989e12


def fwd_flops_per_token(cfg, T: int) -> float:
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_layer = H * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * H + 2 * I * H + I * H
    matmul_params = cfg.num_hidden_layers * per_layer + V * H
    # causal attention: QK^T and PV, 2 FLOPs per MAC, half the T x T square on average
    attn = cfg.num_hidden_layers * 2 * 2 * cfg.q_size * T / 2
    return 2 * matmul_params + attn


def timed(step, steps, warmup):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def bench_rlcu(cfg, B, T, steps, warmup, ckpt="full", fused=False):
    import rlcu
    from rlcu.ops.adamw import adamw_step

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m = rlcu.Qwen3.from_config(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    m.gradient_checkpointing = ckpt
    master = m.flat.float()
    mom = torch.zeros_like(master)
    var = torch.zeros_like(master)
    m.zero_grad()
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B * T,), generator=g).cuda()
    cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device="cuda")
    N = B * T
    dlp = torch.full((N,), -1.0 / (N - B), device="cuda")  # d(mean NLL)/d lp
    state = {"step": 0, "loss": None}

    def step():
        m.zero_grad()
        if fused:  # the head's gradient is taken in the same sweep as its forward
            lp = m.forward_backward(tokens, cu, lambda lp_c, ent_c, idx: (dlp[idx], None))
        else:
            lp = m.forward(tokens, cu)
            m.backward(dlp)
        state["step"] += 1
        adamw_step(master, m.grad_flat, mom, var, m.flat, lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8,
                   weight_decay=0.0, step=state["step"], grad_scale=1.0)
        state["loss"] = lp

    ms = timed(step, steps, warmup)
    loss = float(-state["loss"].sum() / (N - B))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    m = master = mom = var = None
    gc.collect()
    torch.cuda.empty_cache()
    return {"ms": ms, "peak_GiB": peak, "loss": loss}


def bench_hf(cfg, B, T, steps, warmup):
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    hcfg = HFConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                       if k not in ("architectures", "model_type", "torch_dtype")})
    hcfg._attn_implementation = "sdpa"
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = Qwen3ForCausalLM(hcfg).to("cuda", torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=True)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")

    def make_step(micro):
        def step():
            opt.zero_grad(set_to_none=True)
            for part in ids.chunk(micro):
                out = model(input_ids=part, labels=part)
                (out.loss / micro).backward()
                del out
            opt.step()
        return step

    res = {}
    for micro in (1, 2, 4):  # the whole batch at once if it fits, else gradient accumulation
        try:
            torch.cuda.reset_peak_memory_stats()
            ms = timed(make_step(micro), steps, warmup)
            res = {"ms": ms, "peak_GiB": (torch.cuda.max_memory_allocated() - base) / 2**30,
                   "micro_batches": micro}
            break
        except torch.OutOfMemoryError as e:
            res = {"error": f"out of memory with {micro} micro-batch(es): {str(e)[:200]}"}
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
    model = opt = None
    gc.collect()
    torch.cuda.empty_cache()
    return res


SIDES = {"rlcu": "rlcu, full checkpointing, forward then backward",
         "rlcu_fast": "rlcu, checkpointing that keeps attention outputs, fused head forward+backward",
         "hf": "HF transformers + PyTorch"}


def run_side(side, args):
    """Each side runs in its own process, so that one's allocator state cannot starve the other."""
    cfg = qwen3_06b_config()
    B, T = args.batch, args.seqlen
    if side in ("graph", "graph_critic"):
        from bench.train_graph import ARMS, bench_graph

        critic = side == "graph_critic"
        r = bench_graph(cfg, B, T, args.steps, args.warmup, critic=critic, ckpt=args.ckpt)
        head = 0 if critic else 2 * cfg.vocab_size * cfg.hidden_size  # the critic has no LM head
        flops = 3 * (fwd_flops_per_token(cfg, T) - head) * B * T
        for arm in ARMS:
            r[arm].update(tok_s=B * T / r[arm]["ms"] * 1e3, mfu=flops / (r[arm]["ms"] * 1e-3) / PEAK_FLOPS)
        return r
    if side == "hf":
        r = bench_hf(cfg, B, T, args.steps, args.warmup)
    else:
        fast = side == "rlcu_fast"
        r = bench_rlcu(cfg, B, T, args.steps, args.warmup, ckpt="attention" if fast else "full", fused=fast)
    if "ms" in r:
        flops = 3 * fwd_flops_per_token(cfg, T) * B * T
        r.update(tok_s=B * T / r["ms"] * 1e3, mfu=flops / (r["ms"] * 1e-3) / PEAK_FLOPS)
    return r


def main():
    import json
    import subprocess

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sides", default="rlcu,rlcu_fast,hf")
    ap.add_argument("--graph", action="store_true", help="CUDA-graph step against the eager step, per case")
    ap.add_argument("--cases", default="32x1024,8x1024,4x512,critic:8x1024", help="with --graph: [critic:]BxT,...")
    ap.add_argument("--ckpt", default="full", help="with --graph: gradient checkpointing (full | attention)")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print("RESULT " + json.dumps(run_side(args.side, args)))
        return
    if args.graph:
        return main_graph(args)
    t0 = time.time()
    res = {"protocol": f"{args.batch} x {args.seqlen} tokens, next-token loss on all tokens, AdamW step, "
                       "Qwen3-0.6B shape, random bf16 weights; median of timed steps after warm-up; "
                       "each side in its own process"}
    for side in args.sides.split(","):
        cmd = [sys.executable, __file__, "--side", side, "--batch", str(args.batch), "--seqlen", str(args.seqlen),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        env = dict(os.environ)
        if side == "hf":  # the peer at its best: less fragmentation of its large activations
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        res[side] = json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-600:]}
        res[side]["what"] = SIDES[side]
    hf = res.get("hf", {})
    for side in ("rlcu", "rlcu_fast"):
        if "ms" in res.get(side, {}) and "ms" in hf:
            res[side]["speedup_vs_hf"] = hf["ms"] / res[side]["ms"]
            res[side]["memory_ratio_vs_hf"] = res[side]["peak_GiB"] / hf["peak_GiB"]
    res["wall_s"] = time.time() - t0
    write_json("train_step.json", res)
    print(f"\n{'train step':<12} {'ms':>8} {'tok/s':>9} {'MFU':>6} {'peak GiB':>9} {'vs HF':>6}")
    for k in SIDES:
        r = res.get(k)
        if r and "ms" in r:
            sp = f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else ""
            print(f"{k:<12} {r['ms']:>8.1f} {r['tok_s']:>9.0f} {r['mfu']:>6.1%} {r['peak_GiB']:>9.1f} {sp:>6}")
        elif r:
            print(f"{k:<12} {r['error'][-300:]}")


def main_graph(args):
    import json
    import subprocess

    t0 = time.time()
    res = {"protocol": "per case: eager (the library's step), static (the graph's code, uncaptured) and graph "
                       "(captured, replayed) from the same initial state and batch, Qwen3-0.6B shape, random bf16 "
                       f"weights, FlatAdamW with clipping, checkpointing {args.ckpt}; median of {args.steps} timed "
                       f"steps after {args.warmup}; each case in its own process", "cases": {}}
    for case in args.cases.split(","):
        critic = case.startswith("critic:")
        B, T = (int(x) for x in case.split(":")[-1].split("x"))
        cmd = [sys.executable, __file__, "--side", "graph_critic" if critic else "graph", "--batch", str(B),
               "--seqlen", str(T), "--steps", str(args.steps), "--warmup", str(args.warmup), "--ckpt", args.ckpt]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        res["cases"][case] = json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-1500:]}
    res["wall_s"] = time.time() - t0
    write_json("train_graph.json", res)
    print(f"\n{'case':<16} {'eager ms':>9} {'static ms':>10} {'graph ms':>9} {'MFU e/g':>12} {'x vs eager':>10} "
          f"{'bitwise':>8} {'rerun':>6} {'eager rel':>9}")
    for case, r in res["cases"].items():
        if "error" in r:
            print(f"{case:<16} {r['error'][-600:]}")
            continue
        ok, again = (r[k]["losses_equal"] and all(d["equal"] for d in r[k]["state"].values())
                     for k in ("graph_vs_static", "static_vs_static"))
        print(f"{case:<16} {r['eager']['ms']:>9.1f} {r['static']['ms']:>10.1f} {r['graph']['ms']:>9.1f} "
              f"{r['eager']['mfu']:>5.1%}/{r['graph']['mfu']:<6.1%} {r['speedup_graph_vs_eager']:>9.2f}x "
              f"{str(ok):>8} {str(again):>6} {r['eager_vs_static']['loss_max_rel']:>9.1e}")


if __name__ == "__main__":
    main()
