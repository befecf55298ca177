"""What the preference benches (bench/dpo.py, bench/reward_model.py) share: the tiny model, the
rlcu side's timed step loop, the row's throughput figures, a word tokenizer for TRL's side, and
the driver (arguments, each side and shape in its own process, the speed-up and memory ratio
against TRL, the JSON and the table). Each bench keeps what is its own: its pairs, its trainers
and their settings, its protocol's docstring.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from bench.common import SHAPES, qwen3_06b_config, sync, write_json

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def model_cfg(shape: str, tiny: bool):
    """The shape's Qwen3Config (bench/common.py SHAPES), or the tiny one (eos id 1, no bos)."""
    from rlcu.model.config import Qwen3Config

    return Qwen3Config(**TINY, eos_token_id=1, bos_token_id=None) if tiny else qwen3_06b_config(**SHAPES[shape])


def summary(times: list[float], p: dict, cuda: bool, base: int) -> dict:
    """A side's row: median s/step, pairs/s, tokens/s (a pair: the prompt twice and both
    completions) and, on the GPU, the peak memory above `base` bytes."""
    s = statistics.median(times)
    tokens = p["pairs"] * (2 * p["prompt_len"] + p["chosen_len"] + p["rejected_len"])
    res = {"s_per_step": s, "steps": times, "pairs_per_s": p["pairs"] / s, "tokens_per_s": tokens / s,
           "tokens_per_step": tokens}
    if cuda:
        res["peak_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return res


def time_rlcu_steps(tr, p: dict, total: int, warmup: int, cuda: bool) -> tuple[list[float], dict]:
    """(the timed steps' seconds, the last step's metrics) of `total` train_step calls of an rlcu
    trainer, the first `warmup` untimed; each step must take the protocol's pairs."""
    times, m = [], {}
    for s in range(total):
        if s == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        m = tr.train_step(s)
        sync()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
        if m["pairs"] != p["pairs"]:
            raise RuntimeError(f"a step took {m['pairs']} pairs, not {p['pairs']}")
    return times, m


def release(cuda: bool) -> None:
    """Give the side's memory back (gc, then CUDA's cache) once its objects are dropped."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def trl_missing() -> dict | None:
    """The TRL side's row when TRL, datasets or transformers cannot be imported, else None."""
    try:
        import datasets  # noqa: F401
        import transformers  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        return {"error": f"TRL side skipped: {e} (install trl, datasets)"}
    return None


def hf_peer(make: Callable, cfg) -> tuple[bool, int, object]:
    """(cuda, the bytes held before the model, `make(cfg)` seeded and on the side's device and
    dtype: bf16 on the GPU, fp32 on the CPU): the TRL side's model, made as rlcu's is."""
    cuda = torch.cuda.is_available()
    base = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    return cuda, base, make(cfg).to("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)


def hf_word_tokenizer(words: list[str]):
    """transformers' fast tokenizer over rlcu's word-level one (<unk> 0 pads, <eos> the last id)."""
    from transformers import PreTrainedTokenizerFast

    from rlcu.data.tokenizer import make_word_tokenizer

    wt = make_word_tokenizer(words, special_tokens=("<eos>",), eos_token="<eos>")
    return PreTrainedTokenizerFast(tokenizer_object=wt.backend, unk_token="<unk>", pad_token="<unk>",
                                   eos_token="<eos>")


def run_sides(a, script: str, res: dict) -> None:
    """Each side of each shape in its own process (`script --side S --shape X`), its RESULT line
    read into res[shape][side]; the speed-up and memory ratio against TRL where both ran."""
    for shape in a.shapes.split(","):
        res[shape] = {}
        for side in a.sides.split(","):
            cmd = [sys.executable, script, "--side", side, "--shape", shape, "--steps", str(a.steps),
                   "--warmup", str(a.warmup)] + (["--tiny"] if a.tiny else [])
            try:
                pr = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                    env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                line = [x for x in pr.stdout.splitlines() if x.startswith("RESULT ")]
                res[shape][side] = json.loads(line[-1][7:]) if line else {"error": (pr.stderr or pr.stdout)[-800:]}
            except subprocess.TimeoutExpired:
                res[shape][side] = {"error": f"timed out after {a.timeout} s"}
        r, t = res[shape].get("rlcu", {}), res[shape].get("trl", {})
        if r.get("s_per_step") and t.get("s_per_step"):
            res[shape]["speedup_vs_trl"] = t["s_per_step"] / r["s_per_step"]
            if r.get("peak_GiB") and t.get("peak_GiB"):
                res[shape]["memory_ratio_vs_trl"] = r["peak_GiB"] / t["peak_GiB"]


def print_table(a, res: dict, title: str, ref_col: bool) -> None:
    """One line a shape and side: s/step, pairs/s, tokens/s, peak GiB (ref s: the reference
    pass, with `ref_col`) and rlcu's speed-up against TRL; a side's error where it has no row."""
    ref_head = f" {'ref s':>7}" if ref_col else ""
    print(f"\n{title:<14} {'s/step':>8} {'pairs/s':>8} {'tokens/s':>9} {'peak GiB':>9}{ref_head} {'vs TRL':>7}")
    for shape in a.shapes.split(","):
        for side in a.sides.split(","):
            r = res[shape].get(side, {})
            if not r.get("s_per_step"):
                print(f"{shape + ' ' + side:<14} {str(r.get('error', 'no result'))[-300:]}")
                continue
            sp = f"{res[shape]['speedup_vs_trl']:.2f}x" if side == "rlcu" and "speedup_vs_trl" in res[shape] else ""
            pk = f"{r['peak_GiB']:.2f}" if "peak_GiB" in r else "-"
            ref = f" {r['ref_s']:>7.1f}" if ref_col else ""
            print(f"{shape + ' ' + side:<14} {r['s_per_step']:>8.3f} {r['pairs_per_s']:>8.1f} "
                  f"{r['tokens_per_s']:>9.0f} {pk:>9}{ref} {sp:>7}")


def main(doc: str, script: str, sides: dict[str, Callable], protocols: tuple[dict, dict], name: str,
         method: str, title: str, ref_col: bool = False) -> None:
    """A preference bench's command line: `sides` {"rlcu": fn, "trl": fn}, each fn(shape, p,
    steps, warmup, tiny) -> row; `protocols` (full, tiny); results in bench/results/<name>.json
    (<name>_tiny.json with --tiny)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--shapes", default="0.6b,4b")
    ap.add_argument("--sides", default="rlcu,trl")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and 4 short pairs a step (CPU smoke test)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per side and shape")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    a = ap.parse_args()
    p = protocols[1] if a.tiny else protocols[0]
    if a.tiny:
        a.shapes, a.steps, a.warmup = "tiny", min(a.steps, 2), min(a.warmup, 1)
    if a.side:
        print("RESULT " + json.dumps(sides[a.side](a.shape, p, a.steps, a.warmup, a.tiny)))
        return
    t0 = time.time()
    res = {"protocol": p, "tiny": a.tiny, "method": method, "timed_steps": a.steps, "warmup_steps": a.warmup}
    run_sides(a, script, res)
    res["wall_s"] = time.time() - t0
    path = write_json(f"{name}_tiny.json" if a.tiny else f"{name}.json", res)
    print_table(a, res, title, ref_col)
    print(f"\n{path}")
