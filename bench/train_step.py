"""Training-step benchmark (BENCHMARKS.md section 2): batch 32 x 1024 tokens, next-token loss
on all tokens, AdamW step, Qwen3-0.6B shape with random bf16 weights (--shape 4b | 8b: the
larger published shapes, e.g. 8 x 2048 in the bf16 memory mode; llama3.1-8b | qwen2.5-7b: the
other families'; qwen3-30b-a3b-cut: Qwen3-30B-A3B cut to the 10 layers whose full fine-tuning
fits one H200).

rlcu: bf16 weights, rlcu's FlatAdamW (fp32 master + moments, or the bf16 memory mode), the
fused logprob head, Triton kernels; three sides by gradient checkpointing: full, keeping the
attention outputs, and auto (the fewest checkpointed layers whose estimated peak fits the GPU,
rlcu.memory). Peer (same run): HF transformers' model of the family in bf16, SDPA attention,
torch.optim.AdamW(fused=True), without checkpointing (gradient accumulation if the batch does
not fit) and with it (hf_ckpt); speedups are against the faster of the two.
MFU = 3 x forward FLOPs x tokens / time / 989e12 (recomputation is not counted as work; a MoE's
FLOPs are its active parameters': the router and the k experts each token is routed to).

    python bench/train_step.py [--batch 32 --seqlen 1024 --steps 6 --sides rlcu_auto,hf --profile]
    python bench/train_step.py --shape 4b --batch 8 --seqlen 2048 --memory-mode bf16 \
        --sides rlcu,rlcu_auto,hf,hf_ckpt
    python bench/train_step.py --graph [--cases 32x1024,8x1024,4x512,critic:8x1024]

--profile: one more step of each rlcu side under torch.profiler, its kernels by class.
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

from bench.common import MEMORY_MODES, SHAPES, hf_model, matmul_params, replay_ms, shape_name, write_json  # noqa: E402

PEAK_FLOPS = 989e12


def fwd_flops_per_token(cfg, T: int) -> float:
    """A token's forward FLOPs in a sequence of T: its matmuls (a MoE's active parameters: the
    router and the k experts it is routed to, common.py matmul_params) and causal attention."""
    # causal attention: QK^T and PV, 2 FLOPs per MAC, half the T x T square on average
    attn = cfg.num_hidden_layers * 2 * 2 * cfg.q_size * T / 2
    return 2 * matmul_params(cfg) + attn


KERNEL_CLASSES = (("gemm", ("nvjet", "gemm", "cutlass", "splitkreduce", "cublas")), ("attention", ("_attn_",)),
                  ("lm head", ("logprob",)), ("optimizer", ("adamw", "grad_norm", "_norm_sq")))


def kernel_profile(step, top: int = 20) -> dict:
    """One step under torch.profiler: the device total, by class (GEMMs, attention, the LM head's
    kernels, the optimizer, the rest: the memory-bound ops), and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_engine import _kernels

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ks = _kernels(prof)
    by = {name: 0.0 for name, _ in KERNEL_CLASSES} | {"other": 0.0}
    for name, ms, _ in ks:
        low = name.lower()
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")
        by[cls] += ms
    return {"device_ms": sum(k[1] for k in ks), "by_class_ms": by,
            "top": [{"name": k[0][:90], "ms": k[1], "calls": k[2]} for k in ks[:top]]}


def bench_rlcu(cfg, B, T, steps, warmup, ckpt="full", fused=False, memory_mode="default", profile=False,
               exact=False):
    import rlcu
    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW
    from rlcu.train import sizing

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m = rlcu.Qwen3.from_config(cfg, device="cuda", dtype=torch.bfloat16, seed=0, exact=exact)
    opt = FlatAdamW(m, OptimConfig(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, max_grad_norm=0.0,
                                   **MEMORY_MODES[memory_mode]))
    m.gradient_checkpointing = ckpt
    shape = sizing.run_shape(m, opt, micro_batch_tokens=B * T, fused_head=fused) if ckpt == "auto" else None
    note = sizing.resolve_auto(m, shape) if ckpt == "auto" else None
    m.zero_grad()
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B * T,), generator=g).cuda()
    cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device="cuda")
    N = B * T
    dlp = torch.full((N,), -1.0 / (N - B), device="cuda")  # d(mean NLL)/d lp
    state = {"loss": None}

    def step():
        m.zero_grad()
        if fused:  # the head's gradient is taken in the same sweep as its forward
            lp = m.forward_backward(tokens, cu, lambda lp_c, ent_c, idx: (dlp[idx], None))
        else:
            lp = m.forward(tokens, cu)
            m.backward(dlp)
        opt.step(1e-5)
        state["loss"] = lp

    ms = replay_ms(step, steps, warm=warmup)
    loss = float(-state["loss"].sum() / (N - B))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    out = {"ms": ms, "peak_GiB": peak, "loss": loss, "gradient_checkpointing": m.gradient_checkpointing}
    if note:
        out["note"] = note
    if profile:
        out["profile"] = kernel_profile(step)
    m = opt = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_hf(cfg, B, T, steps, warmup, checkpointing=False):
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = hf_model(cfg).to("cuda", torch.bfloat16)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
    for micro in (1, 2, 4, 8):  # the whole batch at once if it fits, else gradient accumulation
        if micro > B:
            break
        try:
            torch.cuda.reset_peak_memory_stats()
            ms = replay_ms(make_step(micro), steps, warm=warmup)
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
         "rlcu_auto": "rlcu, checkpointing auto (the fewest checkpointed layers whose estimated peak fits the GPU; "
                      "every activation of the others kept), fused head forward+backward",
         "hf": "HF transformers + PyTorch, no checkpointing (gradient accumulation where the batch does not fit)",
         "hf_ckpt": "HF transformers + PyTorch, gradient checkpointing (non-reentrant), the whole batch"}
RLCU_SIDES = {"rlcu": ("full", False), "rlcu_fast": ("attention", True), "rlcu_auto": ("auto", True)}


def run_side(side, args):
    """Each side runs in its own process, so that one's allocator state cannot starve the other."""
    from rlcu.model.config import Qwen3Config

    cfg = Qwen3Config(**SHAPES[args.shape])
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
    if side in ("hf", "hf_ckpt"):
        r = bench_hf(cfg, B, T, args.steps, args.warmup, checkpointing=side == "hf_ckpt")
    else:
        ckpt, fused = RLCU_SIDES[side]
        r = bench_rlcu(cfg, B, T, args.steps, args.warmup, ckpt=ckpt, fused=fused, memory_mode=args.memory_mode,
                       profile=args.profile)
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
    ap.add_argument("--sides", default="rlcu,rlcu_fast,rlcu_auto,hf")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b", help="a published shape (common.py SHAPES)")
    ap.add_argument("--memory-mode", choices=sorted(MEMORY_MODES), default="default",
                    help="rlcu's optimizer precisions (bf16: no master, bf16 m, v and gradients)")
    ap.add_argument("--profile", action="store_true", help="rlcu sides: the kernels of one more step, by class")
    ap.add_argument("--graph", action="store_true", help="CUDA-graph step against the eager step, per case")
    ap.add_argument("--cases", default="32x1024,8x1024,4x512,critic:8x1024", help="with --graph: [critic:]BxT,...")
    ap.add_argument("--ckpt", default="full", help="with --graph: gradient checkpointing (full | attention)")
    ap.add_argument("--json", help="the result's file name (default: train_step[_<shape>].json)")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print("RESULT " + json.dumps(run_side(args.side, args)))
        return
    if args.graph:
        return main_graph(args)
    t0 = time.time()
    res = {"protocol": f"{args.batch} x {args.seqlen} tokens, next-token loss on all tokens, AdamW step, "
                       f"{shape_name(args.shape)} shape, random bf16 weights, rlcu's optimizer in the "
                       f"{args.memory_mode} memory mode; median of timed steps after warm-up; each side in its "
                       "own process", "shape": args.shape, "memory_mode": args.memory_mode}
    for side in args.sides.split(","):
        cmd = [sys.executable, __file__, "--side", side, "--batch", str(args.batch), "--seqlen", str(args.seqlen),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--shape", args.shape,
               "--memory-mode", args.memory_mode] + (["--profile"] if args.profile else [])
        env = dict(os.environ)
        if side.startswith("hf"):  # the peer at its best: less fragmentation of its large activations
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        res[side] = json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-600:]}
        res[side]["what"] = SIDES[side]
    peers = [res[k] for k in ("hf", "hf_ckpt") if "ms" in res.get(k, {})]
    hf = min(peers, key=lambda r: r["ms"]) if peers else {}
    for side in RLCU_SIDES:
        if "ms" in res.get(side, {}) and hf:  # against the faster of the peer's two forms
            res[side]["speedup_vs_hf"] = hf["ms"] / res[side]["ms"]
            res[side]["memory_ratio_vs_hf"] = res[side]["peak_GiB"] / hf["peak_GiB"]
    res["wall_s"] = time.time() - t0
    write_json(args.json or ("train_step.json" if args.shape == "0.6b" else f"train_step_{args.shape}.json"), res)
    print(f"\n{'train step':<12} {'ms':>8} {'tok/s':>9} {'MFU':>6} {'peak GiB':>9} {'vs HF':>6}")
    for k in SIDES:
        r = res.get(k)
        if r and "ms" in r:
            sp = f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else ""
            print(f"{k:<12} {r['ms']:>8.1f} {r['tok_s']:>9.0f} {r['mfu']:>6.1%} {r['peak_GiB']:>9.1f} {sp:>6}")
            if "profile" in r:
                by = "  ".join(f"{c} {v:.0f}" for c, v in r["profile"]["by_class_ms"].items())
                print(f"{'':<12} device {r['profile']['device_ms']:.0f} ms: {by}")
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
