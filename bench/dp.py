"""Data-parallel benchmark (BENCHMARKS.md section 8): the training step and the GRPO step at N
GPUs against one, in the same run, with the NCCL bus bandwidth of reduce-scatter and all-gather
measured by the same N-rank job as the ceiling.

Strong scaling: the global batch is the same at every N (the training step: --batch sequences
of --seqlen tokens, next-token loss on all tokens, AdamW; the GRPO step: --prompts prompts x
--group samples, 128 + 256 tokens, EOS ignored, one optimizer step), each rank taking 1/N of
it; scaling efficiency = t(1) / (N t(N)) (= throughput at N over N times one GPU's). Per-rank
peak memory is the largest over the ranks. Each N runs as its own `torchrun --nproc-per-node N`
job (one process a GPU, NCCL); N = 1 is a plain run (no process group). Random bf16 weights of
a published Qwen3 shape (--shape 0.6b | 4b | 8b); the memory mode is the bf16 one (no master,
bf16 m, v and gradients) unless --memory-mode default.

Bus bandwidth (nccl-tests' convention): a reduce-scatter of S input bytes or an all-gather of S
output bytes over N ranks moves busbw = S / t x (N - 1) / N; sizes are a decoder layer's bucket
of the shape (what the sharded optimizer sends) and 256 MiB.

    python bench/dp.py --gpus 8                 # N = 1 and 8, 8B shape
    python bench/dp.py --gpus 2 --shape 0.6b    # a quick check on two GPUs
    python bench/dp.py --gpus 2 --tiny          # a tiny model on the CPU (gloo): a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import MEMORY_MODES, SHAPES  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)


def _ckpt(value: str):
    """--ckpt as Qwen3.gradient_checkpointing takes it: a mode name or a number of layers."""
    return int(value) if value.isdigit() else {"full": True, "none": False}.get(value, value)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _model_cfg(a):
    from rlcu.model.config import Qwen3Config

    return Qwen3Config(**TINY, eos_token_id=1, bos_token_id=None) if a.tiny else Qwen3Config(**SHAPES[a.shape])


# ---------------------------------------------------------------- one rank (under torchrun)
def _bus_bandwidth(sizes: list[int], reps: int) -> dict:
    """busbw GB/s of reduce-scatter and all-gather at each size (bytes, bf16), rank 0's timing."""
    import torch.distributed as dist

    from rlcu.parallel.buckets import all_gather, reduce_scatter
    from rlcu.parallel.comm import world

    w = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if w.backend == "nccl" else torch.device("cpu")
    out = {}
    for S in sizes:
        n = S // 2 // w.size * w.size
        big = torch.ones(n, device=dev, dtype=torch.bfloat16)
        small = torch.ones(n // w.size, device=dev, dtype=torch.bfloat16)
        row = {}
        ops = (("reduce_scatter", lambda: reduce_scatter(small, big)), ("all_gather", lambda: all_gather(big, small)))
        for name, fn in ops:
            fn()
            _sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            _sync()
            t = (time.perf_counter() - t0) / reps
            row[name + "_busbw_GBps"] = n * 2 / t * (w.size - 1) / w.size / 1e9
        out[f"{n * 2 / 2**20:.0f}MiB"] = row
    return out


def _peak_GiB() -> float:
    from rlcu.parallel.comm import all_max

    return all_max(torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0)


def _train_step(a, cfg) -> dict:
    """The SFT-style step on this rank's share of the global batch (--batch x --seqlen)."""
    from rlcu.config import OptimConfig
    from rlcu.model.causal_lm import Qwen3
    from rlcu.parallel.comm import all_sum, world
    from rlcu.parallel.zero import make_optimizer

    w = world()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = Qwen3.from_config(cfg, device=dev, dtype=dtype, seed=0)
    opt = make_optimizer(model, OptimConfig(lr=1e-5, **MEMORY_MODES[a.memory_mode]))
    model.gradient_checkpointing = _ckpt(a.ckpt)
    if model.gradient_checkpointing == "auto":
        from rlcu.train import sizing

        shape = sizing.run_shape(model, opt, micro_batch_tokens=a.micro_batch_tokens, fused_head=True)
        print(sizing.resolve_auto(model, shape), file=sys.stderr)
    B, T = a.batch, a.seqlen
    if B % w.size:
        raise SystemExit(f"--batch {B} must be a multiple of the number of GPUs {w.size}")
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, cfg.vocab_size, (B, T), generator=g)[w.rank :: w.size].to(dev)
    per_mb = max(1, a.micro_batch_tokens // T)
    times = []
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for s in range(a.warmup + a.steps):
        _sync()
        t0 = time.perf_counter()
        model.zero_grad()
        for i in range(0, seqs.shape[0], per_mb):
            x = seqs[i : i + per_mb]
            cu = torch.arange(0, (x.shape[0] + 1) * T, T, device=dev, dtype=torch.int32)
            model.forward_backward(x.reshape(-1), cu, lambda lp_c, ent_c, idx: (torch.full_like(lp_c, -1.0 / (B * T)),
                                                                                None))
        opt.step(1e-5, loss=all_sum(0.0))
        _sync()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    res = {"s_per_step": statistics.median(times), "tokens_per_step": B * T, "peak_GiB_per_rank": _peak_GiB(),
           "gradient_checkpointing": model.gradient_checkpointing}
    if a.check and w.distributed:
        res["rel_diff_vs_one_process"] = _check_one_process(a, cfg, model.flat, per_mb)
    del model, opt
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return res


def _check_one_process(a, cfg, flat: torch.Tensor, per_mb: int) -> float:
    """||w_N - w_1|| / ||w_1 - w_0||: rank 0 replays the steps on the whole batch with FlatAdamW
    (no collectives) and compares its weights with the N-rank run's (the same on every rank)."""
    from rlcu.config import OptimConfig
    from rlcu.model.causal_lm import Qwen3
    from rlcu.optim import FlatAdamW
    from rlcu.parallel.comm import all_max, world

    out = 0.0
    if world().is_main:
        dev, B, T = flat.device, a.batch, a.seqlen
        m = Qwen3.from_config(cfg, device=dev, dtype=flat.dtype, seed=0)
        m.gradient_checkpointing = True
        w0 = m.flat.float().clone()
        opt = FlatAdamW(m, OptimConfig(lr=1e-5, **MEMORY_MODES[a.memory_mode]))
        seqs = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).to(dev)
        order = [i for r in range(world().size) for i in range(r, B, world().size)]  # the ranks' sequences
        for _ in range(a.warmup + a.steps):
            m.zero_grad()
            for i in range(0, B, per_mb):
                x = seqs[order[i : i + per_mb]]
                cu = torch.arange(0, (x.shape[0] + 1) * T, T, device=dev, dtype=torch.int32)
                m.forward_backward(x.reshape(-1), cu, lambda lp_c, ent_c, idx: (torch.full_like(lp_c, -1.0 / (B * T)),
                                                                                None))
            opt.step(1e-5, loss=0.0)
        out = float((flat.float() - m.flat.float()).norm() / (m.flat.float() - w0).norm())
        del m, opt
    return all_max(out)


def _grpo_step(a, cfg) -> dict:
    from bench.grpo import _prompts, _word_tokenizer, hash_reward
    from rlcu.config import GRPOConfig, _build
    from rlcu.model.causal_lm import Qwen3
    from rlcu.train.grpo import GRPOTrainer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    Lp, Lc = (8, 8) if a.tiny else (128, 256)
    P, G = a.prompts, a.group
    model = Qwen3.from_config(cfg, device=dev, dtype=dtype, seed=0)
    model.gradient_checkpointing = _ckpt(a.ckpt)  # 'auto': the trainer decides at its first update
    total = a.warmup + a.steps
    rows = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size, P * total, Lp)]
    block = 16
    kv_blocks = P * G * (-(-(Lp + Lc + 1) // block)) + 64
    gcfg = _build(GRPOConfig, dict(
        steps=total, prompts_per_step=P, group_size=G, max_new_tokens=Lc, temperature=1.0, stop_at_eos=False,
        mu=1, micro_batch_tokens=a.micro_batch_tokens, optim=dict(lr=1e-6, **MEMORY_MODES[a.memory_mode]),
        data=dict(shuffle=False),
        engine=dict(max_num_seqs=P * G, block_size=block, num_kv_blocks=kv_blocks,
                    max_num_batched_tokens=max(8192, P * Lp)),
        log=dict(out_dir=tempfile.mkdtemp(prefix="rlcu-bench-dp-"), progress=False, tensorboard=False, plot=False),
        checkpoint=dict(save_at_end=False)))
    tr = GRPOTrainer(gcfg, rows, [hash_reward], model=model, tokenizer=_word_tokenizer(cfg.vocab_size))
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, phases = [], []
    for s in range(total):
        _sync()
        t0 = time.perf_counter()
        m = tr.train_step(s)
        _sync()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
            phases.append({k[5:]: m[k] for k in ("time/generate", "time/train") if k in m})
    res = {"s_per_step": statistics.median(times), "tokens_per_step": P * G * (Lp + Lc),
           "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
           "peak_GiB_per_rank": _peak_GiB(), "gradient_checkpointing": model.gradient_checkpointing}
    del tr, model
    return res


def worker(a) -> None:
    from rlcu.parallel import comm

    w = comm.init_from_env()
    try:
        cfg = _model_cfg(a)
        res = {"gpus": w.size}
        if w.distributed:
            import types

            from rlcu.model.layout import ParamLayout
            from rlcu.parallel.buckets import Buckets, bucket_bounds

            lay = ParamLayout(cfg)
            bk = Buckets(bucket_bounds(types.SimpleNamespace(layout=lay, cfg=cfg)), 0, w.size)
            layer = max(c * w.size for c in bk.chunk[1:-1]) * 2
            res["bus_bandwidth"] = _bus_bandwidth([layer, 256 << 20] if not a.tiny else [1 << 20], a.bw_reps)
        if "train" in a.what:
            res["train_step"] = _train_step(a, cfg)
        if "grpo" in a.what:
            res["grpo_step"] = _grpo_step(a, cfg)
        if w.is_main:
            Path(a.result).write_text(json.dumps(res))
    except BaseException as e:
        comm.report_failure(e)
        raise
    comm.shutdown()


# ---------------------------------------------------------------- the driver
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=8, help="N (compared with one GPU)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--what", default="train,grpo", help="train, grpo or both")
    ap.add_argument("--batch", type=int, default=8, help="training step: sequences in the global batch")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=32, help="GRPO step: prompts in the global batch")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--memory-mode", choices=sorted(MEMORY_MODES), default="bf16")
    ap.add_argument("--ckpt", default="full",
                    help="gradient checkpointing: full | attention | none | auto | a number of checkpointed layers")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bw-reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (gloo): a smoke test")
    ap.add_argument("--check", action="store_true",
                    help="also replay the training steps in one process on rank 0 and report the weights' difference")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        a.batch, a.seqlen, a.prompts, a.group, a.micro_batch_tokens = 4, 32, 4, 2, 64
    if a.worker:
        worker(a)
        return
    from bench.common import write_json

    t0 = time.time()
    res = {"method": __doc__.split("\n\n")[1].replace("\n", " "), "shape": "tiny" if a.tiny else a.shape,
           "memory_mode": a.memory_mode, "checkpointing": a.ckpt, "train_batch": [a.batch, a.seqlen],
           "grpo_batch": [a.prompts, a.group]}
    passthrough = []
    for k in ("shape", "what", "batch", "seqlen", "prompts", "group", "micro_batch_tokens", "memory_mode", "ckpt",
              "steps", "warmup", "bw_reps"):
        passthrough += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    passthrough += [f for f, on in (("--tiny", a.tiny), ("--check", a.check)) if on]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    for n in sorted({1, a.gpus}):
        out = Path(tempfile.mkdtemp(prefix="rlcu-bench-dp-")) / "result.json"
        launch = ([sys.executable] if n == 1 else
                  [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"])
        cmd = launch + [__file__, "--worker", "--result", str(out)] + passthrough
        try:
            pr = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
            res[f"n{n}"] = (json.loads(out.read_text()) if out.exists()
                            else {"error": (pr.stderr or pr.stdout)[-1500:]})
        except subprocess.TimeoutExpired:
            res[f"n{n}"] = {"error": f"timed out after {a.timeout} s"}
    N = a.gpus
    for step in ("train_step", "grpo_step"):
        one, many = res.get("n1", {}).get(step), res.get(f"n{N}", {}).get(step)
        if one and many and N > 1:
            res[f"{step}_scaling_efficiency"] = one["s_per_step"] / (N * many["s_per_step"])
    res["wall_s"] = time.time() - t0
    ckpt = "" if a.ckpt == "full" else f"_ckpt-{a.ckpt}"
    path = write_json(f"dp_{'tiny' if a.tiny else a.shape}_{N}gpu{ckpt}.json", res)
    print(f"\n{'step':<12} {'GPUs':>4} {'s/step':>8} {'tok/s':>10} {'peak GiB/rank':>14} {'efficiency':>10}")
    for step in ("train_step", "grpo_step"):
        for n in sorted({1, N}):
            r = res.get(f"n{n}", {}).get(step)
            if r:
                eff = res.get(f"{step}_scaling_efficiency") if n == N and N > 1 else None
                print(f"{step:<12} {n:>4} {r['s_per_step']:>8.3f} {r['tokens_per_step'] / r['s_per_step']:>10.0f} "
                      f"{r['peak_GiB_per_rank']:>14.2f} {'' if eff is None else f'{eff:.2f}':>10}")
    for n in sorted({1, N}):
        if "error" in res.get(f"n{n}", {}):
            print(f"N={n}: {res[f'n{n}']['error']}")
    bw = res.get(f"n{N}", {}).get("bus_bandwidth", {})
    for size, row in bw.items():
        print(f"bus bandwidth {size}: reduce-scatter {row['reduce_scatter_busbw_GBps']:.1f} GB/s, "
              f"all-gather {row['all_gather_busbw_GBps']:.1f} GB/s")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
