"""Generation with LoRA adapters (issue 35): the generation protocol (bench/generate.py: requests
with prompt and output lengths uniform in [100, 1024], temperature 0.6, EOS ignored, all at once)
on one engine, with no adapters and with N random adapters of rank R (all-linear) spread round
robin over the requests, the same prompts and seeds in the same call -> tokens/s of each and the
overhead of the adapters (1 - with / without). With adapters the engine runs the plain schedule
(never the fused small-step one, engine/paged_forward.py `schedule`) plus one shrink and one
expand launch per adapted module; a case with every request on adapter 0 (one adapter, --lora 1)
separates the grouped kernels' cost from the mixing.

    python bench/generate_lora.py [--lora 8] [--lora-rank 64] [--shape 0.6b|8b] [--requests 256] [--quick]

JSON: bench/results/generate_lora_<shape>_n<N>_r<R>.json (generate_lora_quick.json with --quick).
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
from bench.generate import random_model, sync  # noqa: E402


def adapters(m, n: int, r: int, seed: int = 0) -> dict:
    """n adapters of rank r over all seven linears, A and B N(0, 0.01) (B nonzero: a real product)."""
    from rlcu.model.lora import LoraAdapters, LoraConfig

    out = {}
    for k in range(n):
        ad = LoraAdapters.create(m.cfg, LoraConfig(r=r, alpha=2 * r, target_modules="all-linear", seed=k), m.device,
                                 m.dtype)
        g = torch.Generator(device=m.device).manual_seed(seed + k)
        ad.flat.normal_(0.0, 0.01, generator=g)
        out[f"lora{k}"] = ad
    return out


def timed(llm, prompts, params, names, case: str) -> dict:
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora=names)
    sync()
    wall = time.perf_counter() - t
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    st = llm.stats
    r = {"case": case, "requests": len(prompts), "output_tokens": n_out, "wall_s": wall, "tok_per_s": n_out / wall,
         "steps": st["steps"], "graph_steps": st["graph_steps"]}
    print(f"{case:<28} {n_out:>8} tok {wall:7.2f} s {r['tok_per_s']:>9,.0f} tok/s  steps {st['steps']} "
          f"(graph {st['graph_steps']})", flush=True)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lora", type=int, default=8, help="adapters, spread round robin over the requests")
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--quick", action="store_true", help="a short smoke run (a tiny model on the CPU)")
    args = p.parse_args(argv)
    from rlcu.engine import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("bench/generate_lora.py: needs a CUDA device (or --quick for a CPU smoke run)", file=sys.stderr)
        return 2
    if args.quick:
        cfg = qwen3_06b_config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, bos_token_id=None,
                               eos_token_id=None)
        n_req, lo, hi = min(args.requests, 6), 4, 12
    else:
        cfg = qwen3_06b_config(**SHAPES[args.shape])
        n_req, lo, hi = args.requests, 100, 1024
    m = random_model(cfg, "cuda" if cuda else "cpu")
    if not cuda:
        m = type(m)(cfg, m.flat.float())
    ads = adapters(m, args.lora, args.lora_rank)
    llm = LLM(m, lora=ads, gpu_memory_utilization=args.gpu_memory_utilization,
              num_kv_blocks=None if cuda else 256)
    rng = np.random.default_rng(1234)
    plens, olens = rng.integers(lo, hi + 1, n_req), rng.integers(lo, hi + 1, n_req)
    prompts = random_prompts(rng, cfg.vocab_size, plens)
    params = [SamplingParams(temperature=0.6, max_tokens=int(o), ignore_eos=True, seed=i) for i, o in enumerate(olens)]
    names = list(ads)
    warm = random_prompts(rng, cfg.vocab_size, rng.integers(lo, hi + 1, 16 if cuda else 2))
    for lora in ("base", names):  # compile both paths outside the timings
        llm.generate([{"prompt_token_ids": w} for w in warm], SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False, lora=lora if isinstance(lora, str) else [names[k % len(names)]
                                                                               for k in range(len(warm))])
    cases = [timed(llm, prompts, params, "base", "no adapters (plain engine)"),
             timed(llm, prompts, params, [names[0]] * n_req, "one adapter, every request"),
             timed(llm, prompts, params, [names[k % len(names)] for k in range(n_req)],
                   f"{len(names)} adapters round robin")]
    llm.sleep()
    del llm
    plain = LLM(m, gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=None if cuda else 256)
    cases.append(timed(plain, prompts, params, None, "engine without LoRA slots"))
    ref = cases[-1]["tok_per_s"]
    for c in cases[:-1]:
        c["overhead_vs_no_lora"] = 1 - c["tok_per_s"] / ref
        print(f"{c['case']:<28} overhead vs an engine without adapters: {100 * c['overhead_vs_no_lora']:.1f}%")
    name = ("generate_lora_quick.json" if args.quick
            else f"generate_lora_{args.shape}_n{args.lora}_r{args.lora_rank}.json")
    path = write_json(name, {"config": {"shape": args.shape, "layers": cfg.num_hidden_layers, "adapters": args.lora,
                                        "rank": args.lora_rank, "requests": n_req, "lengths": [lo, hi],
                                        "quick": args.quick}, "cases": cases})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
