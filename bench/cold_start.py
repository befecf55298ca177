"""The first generate of a process against the next one (BENCHMARKS.md section 6, "first call
of a process"): each case runs in a fresh process that builds the Qwen3-0.6B-shaped random
model, times the engine's construction (its start: sizing, and with warm-up the compiles and
graph captures of engine/warmup.py), then the generation protocol twice (the same 256
requests, prompt and output lengths uniform in [100, 1024], temperature 0.6, EOS ignored): the
first call and a warm one. Reported per case: engine start seconds, both calls' tok/s, their
ratio (first / warm wall time), and the kernels compiled and graphs captured inside each call.

Cases (--cases, in order):
  fresh    warm-up on, an empty Triton cache (TRITON_CACHE_DIR in a temp folder): the compile
           cost is paid at the engine's start;
  cached   warm-up on, the cache `fresh` filled (Triton's persistent disk cache: a second
           process on the machine loads the kernels);
  off      warm-up off, an empty cache: compiles and captures land in the first generate
           (the behaviour before the warm-up);
  default  warm-up on, Triton's cache as the environment gives it (~/.triton/cache).

    python bench/cold_start.py [--cases fresh,cached,off] [--requests 256] [--out cold.json]
    python bench/cold_start.py --quick --cases fresh,off     # 2 layers, 32 requests
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("fresh", "cached", "off", "default")


def _protocol(n_req: int, lo: int, hi: int, V: int):
    import numpy as np

    from bench.common import random_prompts
    from rlcu.engine import SamplingParams

    rng = np.random.default_rng(1234)  # bench/generate.py's protocol draw
    plens, olens = rng.integers(lo, hi + 1, n_req), rng.integers(lo, hi + 1, n_req)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(rng, V, plens)]
    params = [SamplingParams(temperature=0.6, max_tokens=int(o), ignore_eos=True, seed=i) for i, o in enumerate(olens)]
    return prompts, params


def _timed_generate(llm, prompts, params) -> dict:
    import torch

    from rlcu.ops._backend import compiled_variants

    k0, c0 = compiled_variants(), llm.runner.num_captures
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    k1 = compiled_variants()
    st = llm.stats
    n = sum(len(c.token_ids) for o in outs for c in o.outputs)
    prefill = sum(dt for ntok, nseq, _c, _g, dt in st["step_log"] if ntok != nseq)
    return {"wall_s": wall, "output_tokens": n, "tok_per_s": n / wall, "steps": st["steps"],
            "graph_steps": st["graph_steps"], "prefill_time_s": prefill,
            "compiled": {k: v - k0.get(k, 0) for k, v in k1.items() if v != k0.get(k, 0)},
            "captures": llm.runner.num_captures - c0}


def child(args) -> dict:
    """One case, in this (fresh) process."""
    t_proc = time.perf_counter()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    import torch

    from bench.common import qwen3_06b_config
    from bench.generate import random_model
    from rlcu.engine import LLM

    own = os.environ.get("TRITON_CACHE_DIR")
    out = {"case": args.case, "triton_cache_dir": "a folder of its own (TRITON_CACHE_DIR)" if own else "(default)",
           "import_s": time.perf_counter() - t_proc}
    t = time.perf_counter()
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    out["cuda_context_s"] = time.perf_counter() - t
    cfg = qwen3_06b_config(num_hidden_layers=2) if args.quick else qwen3_06b_config()
    m = random_model(cfg, "cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm = LLM(m, gpu_memory_utilization=args.gpu_memory_utilization, warmup=args.case != "off")
    torch.cuda.synchronize()
    out["engine_start_s"] = time.perf_counter() - t
    out["startup"] = llm.startup
    out["memory_probe"] = llm.runner.memory_probe
    out["kv_blocks"], out["max_model_len"] = llm.runner.num_blocks, llm.max_model_len
    prompts, params = _protocol(args.requests, 16 if args.quick else 100, 128 if args.quick else 1024,
                                cfg.vocab_size)
    out["first"] = _timed_generate(llm, prompts, params)
    out["warm"] = _timed_generate(llm, prompts, params)
    out["first_over_warm"] = out["first"]["wall_s"] / out["warm"]["wall_s"]
    free, total = torch.cuda.mem_get_info()
    out["device_used_fraction"] = (total - free) / total
    return out


def _run_case(case: str, args, cache_dirs: dict) -> dict:
    env = dict(os.environ)
    if case in ("fresh", "off"):
        cache_dirs[case] = tempfile.mkdtemp(prefix=f"rlcu-triton-{case}-")
        env["TRITON_CACHE_DIR"] = cache_dirs[case]
    elif case == "cached":
        if "fresh" not in cache_dirs:
            cache_dirs["fresh"] = tempfile.mkdtemp(prefix="rlcu-triton-fresh-")  # (filled by nothing yet)
        env["TRITON_CACHE_DIR"] = cache_dirs["fresh"]
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", case, "--child-out", f.name, "--requests", str(args.requests),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)] + (["--quick"] if args.quick else [])
        t = time.perf_counter()
        p = subprocess.run(cmd, env=env, cwd=ROOT)
        if p.returncode:
            return {"case": case, "error": f"exit {p.returncode}"}
        r = json.loads(Path(f.name).read_text())
    r["process_s"] = time.perf_counter() - t
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="fresh,cached,off", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--quick", action="store_true", help="2 layers, prompts/outputs in [16, 128]")
    ap.add_argument("--out", default=None, help="the JSON's path (default: bench/results/cold_start.json)")
    ap.add_argument("--child", choices=CASES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.case = args.child
        Path(args.child_out).write_text(json.dumps(child(args), default=float))
        return 0
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    import torch

    if not torch.cuda.is_available():
        print("bench/cold_start.py: needs a CUDA device", file=sys.stderr)
        return 2
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"--cases: unknown {bad}; allowed: {', '.join(CASES)}")
    cache_dirs, rows = {}, []
    for c in cases:
        r = _run_case(c, args, cache_dirs)
        rows.append(r)
        if "error" in r:
            print(f"{c:<8} failed: {r['error']}", flush=True)
            continue
        f, w, wu = r["first"], r["warm"], (r["startup"] or {}).get("warmup") or {}
        print(f"{c:<8} engine start {r['engine_start_s']:6.2f} s (warm-up {wu.get('seconds', 0):.2f} s, "
              f"{wu.get('graphs', 0)} graphs)  first {f['tok_per_s']:>8,.0f} tok/s ({f['wall_s']:.2f} s, prefill "
              f"{f['prefill_time_s']:.2f} s, {sum(f['compiled'].values())} compiles, {f['captures']} captures)  "
              f"warm {w['tok_per_s']:>8,.0f} tok/s ({w['wall_s']:.2f} s, prefill {w['prefill_time_s']:.2f} s)  "
              f"first/warm {r['first_over_warm']:.2f}x", flush=True)
    from bench.common import meta

    payload = {"meta": meta(), "config": {"requests": args.requests, "quick": args.quick,
                                          "gpu_memory_utilization": args.gpu_memory_utilization}, "cases": rows}
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / "cold_start.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
