"""Prefill against the training forward, per token (issue 17: "prefill as fast as the training
forward per token"), on the Qwen3-0.6B shape with random bf16 weights, in one process.

The same prompts (bench/generate.py's protocol: 256 prompts of lengths uniform in [100, 1024],
seeded) go through
- the engine: `LLM.generate` with max_tokens=1, so every step is prefill (chunks of at most
  `max_num_batched_tokens` = 8192 tokens, the last token of each prompt sampled); prefill tokens /
  wall second, warm (a first pass of the same prompts compiles and fills caches, and prefix
  caching is off, so the timed pass recomputes everything); its steps replay the prefill graphs
  (engine/prefill_graphs.py), and the same engine with `prefill_graphs=False` runs last, eagerly;
- the trainer's forward without gradients (`Qwen3.hidden_forward_unchecked(grad=False)`, the
  trunk and the final norm: what prefill computes but the cache writes and the sampled rows'
  LM head), on the prompts packed whole into micro-batches of at most 8192 tokens; tokens / wall
  second of the same prompts.

Both are timed by CUDA events around the whole pass, median of `--reps` passes after one
warm-up pass. The device kernels of one pass each (torch.profiler, top by time) say where a gap
comes from. The ratio prefill / forward (tokens per second) is the figure; 1.0 is the target.

    python bench/prefill.py [--reps 5] [--top 10] [--host-profile 25] [--exact]

--exact: the model in exact mode (`Qwen3.exact`: the engine's prefill runs eagerly then).

--host-profile N: also one pass of each under cProfile, its top N functions by own time (where
the host's launch time goes when the device waits for it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import event_ms, qwen3_06b_config, random_prompts, write_json  # noqa: E402
from bench.generate import random_model  # noqa: E402
from bench.profile_engine import _kernels  # noqa: E402

BUDGET = 8192  # tokens a step (the engine) or a micro-batch (the trainer)


def _packs(prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Whole prompts packed greedily in order into micro-batches of at most BUDGET tokens."""
    packs, cur = [], []
    for p in prompts:
        if cur and sum(map(len, cur)) + len(p) > BUDGET:
            packs.append(cur)
            cur = []
        cur.append(p)
    packs.append(cur)
    out = []
    for ps in packs:
        tok = torch.tensor([t for p in ps for t in p], device="cuda")
        cu = torch.tensor([0] + np.cumsum([len(p) for p in ps]).tolist(), device="cuda", dtype=torch.int32)
        out.append((tok, cu, max(map(len, ps))))
    return out


def _profile(fn, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ks = _kernels(prof)
    total = sum(k[1] for k in ks)
    print(f"   device total {total:.1f} ms")
    for k in ks[:top]:
        print(f"   {k[1]:8.2f} ms  x{k[2]:5d}  {k[0][:80]}")
    return {"device_ms_total": total, "top": [{"name": k[0][:90], "ms": k[1], "calls": k[2]} for k in ks[:top]]}


def _host_profile(fn, top: int) -> list[dict]:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    out = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in rows:
        where = f"{Path(file).name}:{line}({func})"
        print(f"   {1e3 * tt:8.1f} ms own {1e3 * ct:8.1f} ms cum x{nc:6d}  {where}")
        out.append({"where": where, "own_ms": 1e3 * tt, "cum_ms": 1e3 * ct, "calls": nc})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N")
    ap.add_argument("--exact", action="store_true", help="the model in exact mode")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/prefill.py needs a CUDA device", file=sys.stderr)
        return 2
    from rlcu.engine import LLM, SamplingParams

    cfg = qwen3_06b_config()
    m = random_model(cfg, "cuda")
    m.exact = a.exact
    rng = np.random.default_rng(1234)
    prompts = random_prompts(rng, cfg.vocab_size, rng.integers(100, 1025, 256))
    n_tok = sum(map(len, prompts))
    llm = LLM(m, max_num_seqs=256, max_num_batched_tokens=BUDGET, gpu_memory_utilization=0.6,
              enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, seed=0)
    reqs = [{"prompt_token_ids": p} for p in prompts]

    def engine():
        llm.generate(reqs, sp, use_tqdm=False)

    packs = _packs(prompts)

    def trainer():
        for tok, cu, mx in packs:
            m.hidden_forward_unchecked(tok, cu, mx, grad=False)

    res = {"what": "prefill (LLM.generate, max_tokens=1) against the training forward without gradients, "
                   "same prompts, tokens per second", "prompts": len(prompts), "prompt_tokens": n_tok,
           "budget_tokens": BUDGET, "micro_batches": len(packs), "exact_mode": m.exact}
    eager_llm = None

    def engine_eager():  # the same engine with its prefill steps launched eagerly (prefill_graphs=False)
        nonlocal eager_llm
        if eager_llm is None:
            llm.sleep()
            eager_llm = LLM(m, max_num_seqs=256, max_num_batched_tokens=BUDGET, gpu_memory_utilization=0.6,
                            enable_prefix_caching=False, prefill_graphs=False)
        eager_llm.generate(reqs, sp, use_tqdm=False)

    res["prefill_graphs"] = sorted(llm.runner.prefill_graphs.graphs)
    for name, fn in (("engine_prefill", engine), ("train_forward", trainer), ("engine_prefill_eager", engine_eager)):
        ms = event_ms(fn, a.reps, warm=1)
        med = statistics.median(ms)
        res[name] = {"ms": med, "ms_all": ms, "tok_per_s": n_tok / med * 1e3}
        if name.startswith("engine_prefill"):  # the last pass's host times (LLM.stats)
            st = (llm if name == "engine_prefill" else eager_llm).stats
            res[name]["steps"] = st["steps"]
            res[name]["host_ms"] = {k[2:]: 1e3 * st[k] for k in ("t_schedule", "t_launch", "t_wait", "t_postprocess")}
            print(f"   {st['steps']} steps; host ms: {res[name]['host_ms']}")
        print(f"{name:<15} {med:8.1f} ms  {n_tok / med * 1e3:>11,.0f} tok/s  (passes {[round(x, 1) for x in ms]})",
              flush=True)
        res[name]["device"] = _profile(fn, a.top)
        if a.host_profile:
            res[name]["host_profile"] = _host_profile(fn, a.host_profile)
    r = res["engine_prefill"]["tok_per_s"] / res["train_forward"]["tok_per_s"]
    re = res["engine_prefill_eager"]["tok_per_s"] / res["train_forward"]["tok_per_s"]
    res["ratio"] = {"prefill_over_forward_tok_per_s": r, "target": ">= 1.0", "met": r >= 1.0,
                    "eager_prefill_over_forward_tok_per_s": re}
    print(f"eager prefill (prefill_graphs=False) / training forward: {re:.3f}")
    print(f"prefill / training forward, tokens per second: {r:.3f} (target >= 1.0)")
    print(f"wrote {write_json('prefill.json', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
