"""Multi-turn episodes against single-turn completions (issue 36): LLM.run_episodes over E episodes
of 4 turns whose tools answer 64 tokens after sleeping 50 ms, and LLM.generate over E
single-turn requests with the same tokens (a prompt of the start plus the 3 tool results, and
all 4 turns' tokens as one completion), in the same run, on the Qwen3-0.6B shape with random
bf16 weights. The number that matters is the ratio of their model tokens per second (target
>= 0.8): the engine keeps decoding the other episodes while one waits for its tool, and a
resumed episode prefills its 64 new tokens only.

    python bench/episodes.py [--quick | --tiny] [--episodes 256] [--start 256] [--turn-tokens 128]
                             [--turns 4] [--tool-tokens 64] [--tool-sleep 0.05] [--out-dir DIR]

--quick: a CPU smoke run (a tiny model, 8 episodes; the JSON episodes_quick.json); the JSON goes to
bench/results/ (and $OUT), or to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import meta, qwen3_06b_config, random_prompts, write_json  # noqa: E402
from bench.generate import random_model, sync  # noqa: E402
from rlcu.engine import LLM, SamplingParams  # noqa: E402


def tool(rng_seed: int, vocab: int, turns: int, tool_tokens: int, sleep: float, calls: dict):
    """on_turn: until the episode has had `turns` turns, a tool call that sleeps and answers
    `tool_tokens` tokens (a function of the episode and its turn)."""

    def on_turn(i, turn_ids, reason):
        k = calls[i] = calls.get(i, 0) + 1
        if k >= turns:  # the last turn calls no tool
            return None
        time.sleep(sleep)
        return tool_ids(rng_seed, vocab, i, k, tool_tokens)

    return on_turn


def tool_ids(seed: int, vocab: int, i: int, k: int, n: int) -> list[int]:
    return np.random.default_rng([seed, i, k]).integers(1, vocab, n).tolist()


def run_episodes(llm, starts, sp, args, vocab) -> dict:
    calls: dict = {}
    sync()
    t = time.perf_counter()
    eps = llm.run_episodes(starts, sp, tool(7, vocab, args.turns, args.tool_tokens, args.tool_sleep, calls),
                           max_workers=args.workers)
    sync()
    wall = time.perf_counter() - t
    st = llm.stats
    n_model = sum(e.num_model_tokens for e in eps)
    bad = [e.finish_reason for e in eps if e.turns != args.turns or e.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"episodes ended early: {bad[:5]}")
    return {"episodes": len(eps), "model_tokens": n_model, "env_tokens": st["episodes"]["env_tokens"],
            "wall_s": wall, "tok_per_s": n_model / wall, "steps": st["steps"], "graph_steps": st["graph_steps"],
            "preemptions": st["preemptions"], "prefill_tokens": st["prefill_tokens"],
            "decode_tokens": st["decode_tokens"], "episode_stats": st["episodes"]}


def run_single(llm, starts, sp, args, vocab) -> dict:
    """The same tokens as one turn: the start and the tool results as the prompt, every turn's
    tokens as one completion."""
    prompts = [s + [t for k in range(1, args.turns) for t in tool_ids(7, vocab, i, k, args.tool_tokens)]
               for i, s in enumerate(starts)]
    one = SamplingParams(temperature=sp.temperature, max_tokens=args.turns * args.turn_tokens, ignore_eos=True,
                         seed=sp.seed)
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t
    st = llm.stats
    n = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"requests": len(prompts), "model_tokens": n, "wall_s": wall, "tok_per_s": n / wall,
            "steps": st["steps"], "graph_steps": st["graph_steps"], "preemptions": st["preemptions"],
            "prefill_tokens": st["prefill_tokens"], "decode_tokens": st["decode_tokens"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", "--tiny", action="store_true", dest="quick",
                   help="a CPU smoke run (a tiny model, 8 episodes)")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--start", type=int, default=256, help="tokens of each episode's start")
    p.add_argument("--turn-tokens", type=int, default=128, help="tokens the model samples a turn")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tool-tokens", type=int, default=64)
    p.add_argument("--tool-sleep", type=float, default=0.05, help="seconds each tool call sleeps")
    p.add_argument("--workers", type=int, default=256, help="run_episodes(max_workers=...)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--out-dir", type=Path, default=None, help="write the JSON here (default bench/results/)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("bench/episodes.py: needs a CUDA device (or --quick for a CPU smoke run)", file=sys.stderr)
        return 2
    if args.quick:
        cfg = qwen3_06b_config(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, bos_token_id=None,
                               eos_token_id=None)
        args.episodes, args.start, args.turn_tokens, args.tool_tokens = 8, 32, 16, 16
    else:
        cfg = qwen3_06b_config()
    m = random_model(cfg, "cuda" if cuda else "cpu")
    llm = LLM(m, gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=None if cuda else 1024)
    rng = np.random.default_rng(1234)
    starts = random_prompts(rng, cfg.vocab_size, [args.start] * args.episodes)
    sp = SamplingParams(temperature=0.6, max_tokens=args.turn_tokens, ignore_eos=True, seed=3)

    warm = dict(vars(args), tool_sleep=0.0)  # compile every step kind both runs meet, outside the timings
    run_episodes(llm, starts[:8], sp, argparse.Namespace(**warm), cfg.vocab_size)
    run_single(llm, starts[:8], sp, args, cfg.vocab_size)
    multi = run_episodes(llm, starts, sp, args, cfg.vocab_size)
    single = run_single(llm, starts, sp, args, cfg.vocab_size)
    ratio = multi["tok_per_s"] / single["tok_per_s"]
    print(f"episodes: {multi['model_tokens']} model tokens in {multi['wall_s']:.2f} s = {multi['tok_per_s']:,.0f} "
          f"tok/s ({multi['steps']} steps, {multi['preemptions']} preemptions, waited on tools "
          f"{multi['episode_stats']['env_wait_s']:.2f} s)", flush=True)
    print(f"single turn: {single['model_tokens']} tokens in {single['wall_s']:.2f} s = {single['tok_per_s']:,.0f} "
          f"tok/s ({single['steps']} steps)", flush=True)
    print(f"ratio {ratio:.2f}x (target >= 0.8)", flush=True)
    results = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
               | {"layers": cfg.num_hidden_layers, "params": m.num_params(), "kv_blocks": llm.runner.num_blocks,
                  "cuda_graphs": llm.runner.use_graphs},
               "episodes": multi, "single_turn": single, "ratio": ratio}
    name = "episodes_quick.json" if args.quick else "episodes.json"
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / name
        path.write_text(json.dumps({"meta": meta(), **results}, indent=2, default=float))
    else:
        path = write_json(name, results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
