"""Where a generate step's time goes (a diagnostic for bench/generate.py, same model and engine).

For each case (decode: B requests of prompt 128 / new 256; prefill: long prompts, 2 new
tokens) it reports
- wall ms per step with the usual one-step lookahead, and the host's own ms per step
  (schedule + launch + postprocess measured with async_scheduling off, where the device is
  idle whenever the host works);
- the device: total kernel ms per step from torch.profiler, and the top kernels by time.

    python bench/profile_engine.py [--top 12] [--cases decode64,decode256,decode256x600,prefill]
                                   [--shape qwen2.5-7b]

decodeBxP: B requests of prompt P (default 128); --shape: a bench/common.py SHAPES shape (JSON
profile_engine_<shape>.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, qwen3_06b_config, random_prompts, write_json  # noqa: E402
from bench.generate import random_model  # noqa: E402


def _kernels(prof) -> list[tuple[str, float, int]]:
    """(name, total device ms, count) of every GPU kernel/memcpy in the trace."""
    out = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
        n, c = out.get(e.name, (0.0, 0))
        out[e.name] = (n + t / 1e3, c + 1)
    return sorted(((k, v[0], v[1]) for k, v in out.items()), key=lambda r: -r[1])


def case(llm, prompts, params, top: int, name: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    reqs = [{"prompt_token_ids": p} for p in prompts]
    res = {"case": name}
    for mode in ("async", "sync"):
        llm.async_scheduling = mode == "async"
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(reqs, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        st = llm.stats
        n = st["steps"]
        res[mode] = {"wall_ms_per_step": 1e3 * wall / n, "steps": n,
                     **{k[2:] + "_ms_per_step": 1e3 * st[k] / n
                        for k in ("t_schedule", "t_launch", "t_wait", "t_postprocess")}}
    llm.async_scheduling = True
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(reqs, params, use_tqdm=False)
        torch.cuda.synchronize()
    n = llm.stats["steps"]
    ks = _kernels(prof)
    res["device_ms_per_step"] = sum(k[1] for k in ks) / n
    res["top_kernels"] = [{"name": k[0][:90], "ms_per_step": k[1] / n, "calls_per_step": k[2] / n} for k in ks[:top]]
    a, s = res["async"], res["sync"]
    print(f"\n== {name}: {n} steps; wall {a['wall_ms_per_step']:.2f} ms/step (async), "
          f"{s['wall_ms_per_step']:.2f} (sync); host (sync) schedule {s['schedule_ms_per_step']:.2f} "
          f"launch {s['launch_ms_per_step']:.2f} post {s['postprocess_ms_per_step']:.2f}; "
          f"device kernels {res['device_ms_per_step']:.2f} ms/step", flush=True)
    for k in res["top_kernels"]:
        print(f"   {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:6.1f}  {k['name']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--cases", default="decode64,decode256,prefill")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/profile_engine.py needs a CUDA device", file=sys.stderr)
        return 2
    from rlcu.engine import LLM, SamplingParams

    cfg = qwen3_06b_config(**SHAPES[args.shape])
    m = random_model(cfg, "cuda")
    llm = LLM(m, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.6)
    rng = np.random.default_rng(0)
    warm = random_prompts(rng, cfg.vocab_size, rng.integers(100, 1025, 64))
    llm.generate([{"prompt_token_ids": w} for w in warm], SamplingParams(temperature=0.6, max_tokens=8,
                                                                         ignore_eos=True), use_tqdm=False)
    llm.capture_graphs(2048)
    out = []
    for c in args.cases.split(","):
        if c.startswith("decode"):
            B, _, P = c[6:].partition("x")
            prompts = random_prompts(rng, cfg.vocab_size, [int(P or 128)] * int(B))
            sp = SamplingParams(temperature=0.6, max_tokens=256, ignore_eos=True, seed=7)
        elif c == "prefill":
            prompts = random_prompts(rng, cfg.vocab_size, rng.integers(100, 1025, 64))
            sp = SamplingParams(temperature=0.6, max_tokens=2, ignore_eos=True, seed=7)
        else:
            raise SystemExit(f"--cases: unknown case {c!r} (decodeB or prefill)")
        out.append(case(llm, prompts, sp, args.top, c))
    name = "profile_engine" + ("" if args.shape == "0.6b" else f"_{args.shape}")
    print(f"wrote {write_json(name + '.json', {'shape': args.shape, 'cases': out})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
