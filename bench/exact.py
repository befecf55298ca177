"""Exact on-policy mode's cost (issue 16, item 4): each case in the default mode and in exact mode
(the case's models built with `exact=True`), in the same run, each side in its own process.
Targets on the H200: GRPO step (protocol A) <= 1.10x the default's time, generation protocol
throughput >= 0.85x, training step throughput >= 0.90x.

Cases:
- kernels: the batch-invariant GEMM against cuBLAS at the model's shapes (M = 8192 training
  rows and M = 256 decode rows) and exact attention against the default kernels (training
  forward, decode), each with its invariance check (a row alone = the row in a batch);
- generate: bench/generate.py's protocol (256 requests, prompt and output lengths uniform in
  [100, 1024], temperature 0.6, EOS ignored) on the 0.6B shape; output tokens / wall second;
- train_step: bench/train_step.py's rlcu_fast step (32 x 1024 tokens, fused head, attention
  checkpointing, AdamW);
- grpo: bench/grpo.py's protocol A (8 prompts x 8 completions, 128 + 256 tokens), rlcu in its
  default memory mode; median seconds per step after warm-up.

    python bench/exact.py                          # every case -> bench/results/exact.json
    python bench/exact.py --cases kernels,grpo     # some of them
    python bench/exact.py --quick                  # short runs (a smoke test of the script)
    python bench/exact.py --cases grpo --repeat 3  # default, exact, default, exact, ...: the
                                                   # ratio of the medians over the repeats

--repeat R runs each case's two modes alternately R times (the GPU's clocks and the host's load
drift between processes: measured 1.08x and 1.17x for the same GRPO tree in two runs), and the
ratio is taken between the medians of the repeats' figures; every repeat is kept (`repeats`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import qwen3_06b_config, random_prompts, write_json

CASES = ("kernels", "generate", "train_step", "grpo")
TARGETS = {"generate": ("tok_per_s", 0.85, "throughput ratio >="), "train_step": ("tok_s", 0.90, "throughput ratio >="),
           "grpo": ("s_per_step", 1.10, "time ratio <=")}


def _timed(fn, reps=12):
    """ms of one call, from CUDA-graph replays of back-to-back calls (bench/exact_tiles.py's
    protocol: no host launch time in the figure)."""
    from bench.exact_tiles import _timed as graph_timed

    return graph_timed(lambda i: fn, 1, inner=reps)


def case_kernels(quick: bool, exact: bool) -> dict:
    """GEMM and attention timings, exact against default, at the 0.6B shape in bf16."""
    from rlcu.ops.attention import attention_fwd
    from rlcu.ops.attention_exact import attention_exact_paged, attention_exact_varlen
    from rlcu.ops.matmul_invariant import mm
    from rlcu.ops.paged_attention import paged_attention

    cfg = qwen3_06b_config()
    d, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=d).manual_seed(0)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, H), "o": (H, cfg.q_size), "gate_up": (2 * I, H),
              "down": (H, I), "lm_head": (V, H)}
    out = {"gemm": {}, "attention": {}}  # the tile sweep and its bit checks: bench/exact_tiles.py
    for M in ((512, 64) if quick else (8192, 256)):
        for name, (N, K) in shapes.items():
            w = torch.randn(N, K, device=d, dtype=bf, generator=g) * 0.02
            x = torch.randn(M, K, device=d, dtype=bf, generator=g)
            t_inv = _timed(lambda x=x, w=w: mm(x, w))
            t_cub = _timed(lambda x=x, w=w: x @ w.t())
            y = mm(x, w)
            inv = all(torch.equal(mm(x[a:b], w), y[a:b]) for a, b in ((0, 1), (5, 6), (3, 40), (M - 7, M)))
            out["gemm"][f"{name} M={M}"] = {"N": N, "K": K, "invariant_ms": t_inv, "cublas_ms": t_cub,
                                            "ratio": t_inv / t_cub, "row_invariant": inv,
                                            "max_abs_vs_cublas": float((y.float() - (x @ w.t()).float()).abs().max())}
    from bench.exact_tiles import packed_qkv

    Hq, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v, B, T = packed_qkv(cfg, quick, g)
    N = B * T
    cu = torch.arange(0, N + 1, T, device=d, dtype=torch.int32)
    sc = D**-0.5
    o, _ = attention_exact_varlen(q, k, v, cu, T, sc)
    alone, _ = attention_exact_varlen(q[T:2 * T], k[T:2 * T], v[T:2 * T], cu[:2], T, sc)
    out["attention"]["train_fwd"] = {"tokens": N,
                                     "exact_ms": _timed(lambda: attention_exact_varlen(q, k, v, cu, T, sc)),
                                     "default_ms": _timed(lambda: attention_fwd(q, k, v, cu, T, sc)),
                                     "seq_alone_equal": torch.equal(alone, o[T:2 * T])}
    from rlcu.ops import attention_exact as ae

    keep = ae.CONFIG["SUB_TRAIN"]
    try:  # sub-tiles a training program: K/V traffic / SUB, the same bits
        for sub in (1, 2, 4):
            ae.CONFIG["SUB_TRAIN"] = sub
            o_s, _ = attention_exact_varlen(q, k, v, cu, T, sc)
            out["attention"][f"train_fwd SUB={sub}"] = {
                "exact_ms": _timed(lambda: attention_exact_varlen(q, k, v, cu, T, sc)),
                "same_bits": torch.equal(o_s, o)}
    finally:
        ae.CONFIG["SUB_TRAIN"] = keep
    # decode: S sequences of context L in a paged cache of 16-token blocks
    (S, L), BS = ((64, 512) if quick else (256, 1024)), 16
    nb = S * L // BS
    kc = torch.randn(nb, BS, Hk, D, device=d, dtype=bf, generator=g)
    vc = torch.randn(nb, BS, Hk, D, device=d, dtype=bf, generator=g)
    tables = torch.randperm(nb, device=d, generator=g).view(S, L // BS).int()
    qd = torch.randn(S, Hq, D, device=d, dtype=bf, generator=g)
    cuq = torch.arange(S + 1, device=d, dtype=torch.int32)
    lens = torch.full((S,), L, device=d, dtype=torch.int32)
    od = attention_exact_paged(qd, kc, vc, tables, cuq, lens, 1, sc)
    od1 = attention_exact_paged(qd[3:4], kc, vc, tables[3:4], cuq[:2], lens[:1], 1, sc)
    out["attention"]["decode"] = {
        "seqs": S, "context": L,
        "exact_ms": _timed(lambda: attention_exact_paged(qd, kc, vc, tables, cuq, lens, 1, sc)),
        "default_ms": _timed(lambda: paged_attention(qd, kc, vc, tables, cuq, lens, 1, L, sc)),
        "seq_alone_equal": torch.equal(od1[0], od[3])}
    keep = dict(ae.CONFIG)
    try:  # one row tile on every path: the decode's cost of the training tile
        for bm in (32, 64):
            ae.CONFIG.update(BM=bm, BM_TRAIN=bm, SUB_TRAIN=1)
            o_b, _ = attention_exact_varlen(q, k, v, cu, T, sc)
            od_b = attention_exact_paged(qd, kc, vc, tables, cuq, lens, 1, sc)
            out["attention"][f"all paths BM={bm}"] = {
                "train_ms": _timed(lambda: attention_exact_varlen(q, k, v, cu, T, sc)),
                "decode_ms": _timed(lambda: attention_exact_paged(qd, kc, vc, tables, cuq, lens, 1, sc)),
                "train_same_bits_as_default_config": torch.equal(o_b, o),
                "decode_same_bits_as_default_config": torch.equal(od_b, od)}
    finally:
        ae.CONFIG.clear()
        ae.CONFIG.update(keep)
    for grp in out.values():
        for name, r in grp.items():
            print(f"  {name:<22} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in r.items()), flush=True)
    return out


def case_generate(quick: bool, exact: bool) -> dict:
    import numpy as np

    from bench.generate import random_model, run_rlcu
    from rlcu.engine import LLM, SamplingParams

    cfg = qwen3_06b_config(num_hidden_layers=4) if quick else qwen3_06b_config()
    n_req, lo, hi = (32, 16, 128) if quick else (256, 100, 1024)
    m = random_model(cfg, "cuda")
    m.exact = exact
    llm = LLM(m, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.6)
    rng = np.random.default_rng(0)
    warm = random_prompts(rng, cfg.vocab_size, rng.integers(lo, hi + 1, 64))
    llm.generate([{"prompt_token_ids": w} for w in warm],
                 SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.capture_graphs(2 * hi + 16)
    rng = np.random.default_rng(1234)
    plens, olens = rng.integers(lo, hi + 1, n_req), rng.integers(lo, hi + 1, n_req)
    prompts = random_prompts(rng, cfg.vocab_size, plens)
    params = [SamplingParams(temperature=0.6, max_tokens=int(o), ignore_eos=True, seed=i) for i, o in enumerate(olens)]
    return run_rlcu(llm, prompts, params, cfg, m.num_params() * 2, 4.3e12, f"protocol {n_req} x [{lo},{hi}]")


def case_train_step(quick: bool, exact: bool) -> dict:
    from bench.train_step import bench_rlcu, fwd_flops_per_token

    cfg = qwen3_06b_config()
    B, T = (4, 512) if quick else (32, 1024)
    r = bench_rlcu(cfg, B, T, 2 if quick else 6, 1 if quick else 2, ckpt="attention", fused=True, exact=exact)
    r.update(tokens=B * T, tok_s=B * T / r["ms"] * 1e3, flops_per_step=3 * fwd_flops_per_token(cfg, T) * B * T)
    return r


def case_grpo(quick: bool, exact: bool) -> dict:
    from bench.grpo import PROTOCOLS, bench_rlcu

    return bench_rlcu(PROTOCOLS["A"], 2 if quick else 3, 1 if quick else 2, False, 16384, "default", exact)


def run_side(case: str, quick: bool, exact: bool) -> dict:
    r = globals()[f"case_{case}"](quick, exact)  # the case's models in exact mode or not
    r = dict(r) if isinstance(r, dict) else {"result": r}
    r["exact_mode"] = exact
    return r


def _side(case: str, mode: str, a) -> dict:
    cmd = ([sys.executable, __file__, "--side", case] + (["--quick"] if a.quick else [])
           + (["--exact"] if mode == "exact" else []))
    print(f"=== {case} ({mode})", flush=True)
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=a.timeout)
        print(p.stdout[-3000:], flush=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        return json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-1500:]}
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.timeout} s"}


def _run_case(case: str, a) -> dict:
    """Both modes (kernels: exact only), alternately `a.repeat` times; the figures of the last
    repeat in place, every repeat under `repeats`, the ratio of the medians."""
    modes = ("exact",) if case == "kernels" else ("default", "exact")
    reps = [{m: _side(case, m, a) for m in modes} for _ in range(max(1, a.repeat))]
    out = dict(reps[-1])
    if case not in TARGETS or any("error" in r.get(m, {"error": 1}) for r in reps for m in ("default", "exact")):
        return out
    key, target, how = TARGETS[case]
    med = {m: statistics.median(r[m][key] for r in reps) for m in ("default", "exact")}
    ratio = med["exact"] / med["default"]
    ok = ratio <= target if how.startswith("time") else ratio >= target
    out["ratio"] = {"metric": key, "exact_over_default": ratio, "target": f"{how} {target}", "met": ok}
    if len(reps) > 1:
        out["repeats"] = [{m: r[m][key] for m in ("default", "exact")} for r in reps]
        out["ratio"]["per_repeat"] = [r["exact"][key] / r["default"][key] for r in reps]
        out["ratio"]["of"] = f"medians of {len(reps)} alternating repeats"
    print(f"{case}: exact / default {key} = {ratio:.3f} (target {how} {target}: {'met' if ok else 'MISSED'})",
          flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per case and mode")
    ap.add_argument("--repeat", type=int, default=1, help="alternate the two modes this many times")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)  # the side's mode
    a = ap.parse_args(argv)
    if a.side:
        print("RESULT " + json.dumps(run_side(a.side, a.quick, a.exact)), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("bench/exact.py: needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    res = {"what": "exact mode (Qwen3.exact) against the default mode, same cases, each side in its own process",
           "quick": a.quick}
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        print(f"--cases: unknown {bad[0]!r} (allowed: {', '.join(CASES)})", file=sys.stderr)
        return 2
    for case in cases:
        res[case] = _run_case(case, a)
    if a.repeat > 1:
        res["repeat"] = a.repeat
    res["wall_s"] = time.time() - t0
    print(f"wrote {write_json('exact_quick.json' if a.quick else 'exact.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
