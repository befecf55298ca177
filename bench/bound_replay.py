"""A CPU replay of the generation protocol's step log, and both bandwidth bounds from it, per shape.

Protocol (bench/generate.py's): 256 requests, prompt and output lengths uniform in [100, 1024]
(numpy seed 1234, drawn as generate.py draws them), EOS ignored, max_num_seqs 256,
max_num_batched_tokens 8192, block size 16, one-step lookahead (async scheduling), the KV pool
of the H200 run (its JSON's config.kv_blocks). With EOS ignored the engine's steps depend only on
the lengths and the pool, so the real scheduler and step loop (engine/scheduler.py,
engine/step_loop.py) run here with a runner that computes nothing: it hands back token 0 for
each sampled row. The step log it records is the engine's (tokens, sequences, context tokens
after the step), without the device's seconds.

Per shape it checks the replay's step count against the H200 run's (bench/results/
generate_<shape>_protocol.json) and computes from the replayed log bench/generate.py's bound
(`bound_seconds`: the GEMMs' FLOPs overlap attention's K/V reads) and its per-kernel-class
split bound (`bound_split_seconds`: GEMM max(bytes, FLOPs) + attention's K/V bytes), each
against the H200 run's wall. This is a replay, not a measurement: no device ran here; the
walls are the recorded runs'.

    python bench/bound_replay.py [--shapes 8b qwen2.5-7b ...]   (JSON bench/results/bound_replay.json)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, matmul_params, qwen3_06b_config, random_prompts, shape_name, write_json  # noqa: E402
from bench.generate import (  # noqa: E402
    MATMUL_PEAK,
    bound_seconds,
    bound_split_seconds,
    split_step_seconds,
    step_weight_bytes,
)

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SHAPES = ("8b", "llama3.1-8b", "qwen2.5-7b", "qwen3-30b-a3b")
PROTOCOL = dict(requests=256, lo=100, hi=1024, seed=1234, max_num_seqs=256, max_num_batched_tokens=8192,
                block_size=16, lookahead=True)


class _NullRunner:
    """A runner for StepLoop that computes nothing: a launch is its batch, and its samples are
    token 0 (never a stop token: the protocol ignores EOS) for each row."""

    def launch(self, batch):
        return batch, True

    def collect(self, batch):
        rows = sum(batch.num_samples)
        return [0] * rows, [0.0] * rows


def protocol_requests(vocab_size: int, n: int, lo: int, hi: int, seed: int):
    """The protocol's prompts and output lengths, drawn in generate.py's order."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(lo, hi + 1, n)
    olens = rng.integers(lo, hi + 1, n)
    return random_prompts(rng, vocab_size, plens), [int(o) for o in olens]


def replay(prompts, out_lens, *, num_blocks: int, max_model_len: int, block_size: int = 16,
           max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, lookahead: bool = True) -> dict:
    """Run the engine's scheduler and step loop over the requests on a pool of num_blocks ->
    GenerateStats.as_dict() (steps, step_log, preemptions, output_tokens)."""
    from rlcu.engine import requests
    from rlcu.engine.block_manager import BlockManager
    from rlcu.engine.params import SamplingParams
    from rlcu.engine.scheduler import Scheduler
    from rlcu.engine.step_loop import StepLoop

    sch = Scheduler(BlockManager(num_blocks, block_size, True), max_num_seqs, max_num_batched_tokens,
                    min(max_model_len, num_blocks * block_size))
    resolved = [(p, p, None) for p in prompts]
    checked = {i: SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=i)
               for i, o in enumerate(out_lens)}
    for s in requests.make_sequences(resolved, checked, frozenset()):
        sch.add(s)
    loop = StepLoop(sch, _NullRunner(), {i: 1 for i in checked}, lookahead=lookahead)
    loop.run()
    return loop.stats.as_dict()


def param_count(cfg) -> int:
    from rlcu.model.layout import ParamLayout

    return ParamLayout(cfg).numel


def replay_shape(shape: str, measured: dict) -> dict:
    """One shape's row: the replay checked against the H200 run, both bounds and fractions."""
    cfg = qwen3_06b_config(**SHAPES[shape])
    conf, run = measured["config"], measured["rlcu"][0]
    if "kv_blocks" not in conf:
        raise ValueError(f"{shape}: the protocol JSON's config has no kv_blocks: the replay needs the run's pool")
    P = PROTOCOL
    prompts, olens = protocol_requests(cfg.vocab_size, P["requests"], P["lo"], P["hi"], P["seed"])
    st = replay(prompts, olens, num_blocks=conf["kv_blocks"], max_model_len=cfg.max_position_embeddings,
                block_size=conf["block_size"], max_num_seqs=conf["max_num_seqs"],
                max_num_batched_tokens=conf["max_num_batched_tokens"], lookahead=conf.get("async_scheduling", True))
    n = param_count(cfg)
    if n != conf["params"]:
        raise ValueError(f"{shape}: {n} parameters here, {conf['params']} in the H200 run's JSON")
    bw, wall, dec_t = conf["bandwidth_Bps"], run["wall_s"], run["decode"]["time_s"]
    bound, dec_bound, _, _ = bound_seconds(st, cfg, 2 * n, bw)
    split, dec_split = bound_split_seconds(st, cfg, 2 * n, bw)
    parts = decode_parts(st, cfg, 2 * n, bw)
    return {
        "shape": shape, "model": shape_name(shape), "kv_blocks": conf["kv_blocks"], "params": n,
        "steps_replay": st["steps"], "steps_h200": run["steps"], "steps_match": st["steps"] == run["steps"],
        "decode_steps_replay": parts["steps"], "preemptions_replay": st["preemptions"],
        "output_tokens_replay": st["output_tokens"], "output_tokens_h200": run["output_tokens"],
        "wall_s_h200": wall, "bound_s": bound, "bound_fraction": bound / wall,
        "bound_s_h200_json": run["bound_s"], "bound_split_s": split, "bound_split_fraction": split / wall,
        "decode": {"time_s_h200": dec_t, "bound_s": dec_bound, "bound_fraction": dec_bound / dec_t,
                   "bound_split_s": dec_split, "bound_split_fraction": dec_split / dec_t, **parts,
                   "unexplained_ms_per_step": 1e3 * (dec_t - dec_split) / parts["steps"]},
    }


def decode_parts(stats, cfg, weight_bytes, bandwidth) -> dict:
    """The decode steps' split bound by class: GEMM and attention seconds, how many steps'
    GEMMs are compute-bound, and how much K/V time the overlapping bound hides under their
    FLOPs (what the split bound adds back, before it drops the untied embedding table)."""
    kv_tok = 2 * cfg.num_hidden_layers * cfg.kv_size * 2
    out = dict(steps=0, gemm_s=0.0, attention_s=0.0, compute_bound_steps=0, kv_hidden_by_flops_s=0.0)
    for ntok, nseq, ctx, *_ in stats["step_log"]:
        if ntok != nseq:
            continue
        g, a = split_step_seconds(cfg, weight_bytes, ntok, nseq, ctx, bandwidth)
        flops = 2 * matmul_params(cfg) * ntok / MATMUL_PEAK
        mem = step_weight_bytes(cfg, weight_bytes, ntok) / bandwidth
        out["steps"] += 1
        out["gemm_s"] += g
        out["attention_s"] += a
        out["compute_bound_steps"] += flops > mem
        out["kv_hidden_by_flops_s"] += min(max(flops - mem, 0.0), ctx * kv_tok / bandwidth)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=sorted(SHAPES))
    args = p.parse_args(argv)
    rows = []
    for shape in args.shapes:
        path = RESULTS / f"generate_{shape}_protocol.json"
        if not path.exists():
            print(f"{shape}: no {path.name}, skipped", file=sys.stderr)
            continue
        r = replay_shape(shape, json.loads(path.read_text()))
        rows.append(r)
        print(f"{r['model']:<16} steps {r['steps_replay']} (H200 {r['steps_h200']})  wall {r['wall_s_h200']:6.2f} s  "
              f"bound {r['bound_s']:6.2f} s ({100 * r['bound_fraction']:.1f}%)  split {r['bound_split_s']:6.2f} s "
              f"({100 * r['bound_split_fraction']:.1f}%)  decode {100 * r['decode']['bound_fraction']:.1f}% / "
              f"{100 * r['decode']['bound_split_fraction']:.1f}%", flush=True)
    out = {"replay": True,
           "protocol": dict(PROTOCOL, note="bench/generate.py's protocol case, EOS ignored, temperature 0.6"),
           "method": ("CPU replay: the engine's Scheduler and StepLoop (one-step lookahead) over the protocol's "
                      "seeded lengths on each H200 run's KV pool (config.kv_blocks), with a runner that computes "
                      "nothing; the bounds from the replayed step log (bench/generate.py bound_seconds and "
                      "bound_split_seconds); wall and decode time are the H200 runs' (generate_<shape>_protocol"
                      ".json), not measured here"),
           "shapes": rows}
    print(f"wrote {write_json('bound_replay.json', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
