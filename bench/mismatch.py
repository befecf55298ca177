"""The default mode's train/inference mismatch and what its corrections cost (rlcu.train.mismatch).

Qwen3-0.6B shape, random bf16 weights whose final norm is scaled until the mean entropy of the
next-token distribution is 2.9 nats (as a trained model's: random weights give a nearly uniform,
mismatch-free distribution); 32 prompts x 8 samples, prompt 32 tokens, completion 256 (EOS
ignored), mu = 2, the same weights and data for every mode. For each mode (old_logprobs /
behaviour_correction) and step: the mismatch metrics, the correction metrics, the first update's
ratio / clip fraction / approx_kl (exactly 1 / 0 / 0 with recompute: the recompute pass and the
first update's forward give the same bits), and the step's phases. The first step of the first
mode includes the kernels' compilation.

    python bench/mismatch.py            # on the GPU: writes bench/results/mismatch.json
    python bench/mismatch.py --tiny     # a tiny model on whatever device (a smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import scale_to_entropy, write_json
from grpo import _model_cfg, _prompts, _word_tokenizer, hash_reward

MODES = (("engine", "none"), ("recompute", "none"), ("recompute", "tis"), ("recompute", "mis_token"),
         ("recompute", "mis_seq"))
KEEP = ("mismatch/", "correction/", "time/", "clip_frac", "ratio", "approx_kl")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_mode(model, base, tok, V, old_logprobs, correction, P, G, Lp, Lc, steps):
    from rlcu.config import GRPOConfig, _build
    from rlcu.train.grpo import GRPOTrainer

    model.flat.copy_(base)
    rows = [{"prompt_token_ids": p} for p in _prompts(V, P * steps, Lp)]
    blocks = P * G * (-(-(Lp + Lc + 1) // 16)) + 64
    cfg = _build(GRPOConfig, {
        "steps": steps, "prompts_per_step": P, "group_size": G, "max_new_tokens": Lc, "stop_at_eos": False, "mu": 2,
        "micro_batch_tokens": 16384, "optim": {"lr": 1e-6}, "data": {"shuffle": False},
        "old_logprobs": old_logprobs, "behaviour_correction": correction,
        "engine": {"max_num_seqs": P * G, "block_size": 16, "num_kv_blocks": blocks, "max_num_batched_tokens": 8192},
        "log": {"out_dir": tempfile.mkdtemp(prefix="rlcu-bench-mismatch-"), "progress": False, "tensorboard": False,
                "plot": False},
        "checkpoint": {"save_at_end": False}})
    tr = GRPOTrainer(cfg, rows, [hash_reward], model=model, tokenizer=tok)
    updates = []
    update = tr._policy_update

    def spy(*a, **k):
        out = update(*a, **k)
        updates.append(out)
        return out

    tr._policy_update = spy
    out = []
    for s in range(steps):
        _sync()
        t0 = time.perf_counter()
        m = tr.train_step(s)
        _sync()
        row = {k: v for k, v in m.items() if k.startswith(KEEP) and isinstance(v, (int, float))}
        row["wall_s"] = time.perf_counter() - t0
        row["first_update"] = {k: updates[-2][k] for k in ("ratio", "clip_frac", "approx_kl")}
        out.append(row)
    del tr
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a tiny model and short sequences (a smoke test)")
    a = ap.parse_args()
    from rlcu.model.causal_lm import Qwen3

    cuda = torch.cuda.is_available()
    cfg = _model_cfg(a.tiny)
    model = Qwen3.from_config(cfg, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32,
                              seed=0)
    model.gradient_checkpointing = True
    scale, ent = scale_to_entropy(model, 2.9)
    print(f"final norm x{scale:.3f}: entropy {ent:.3f}", flush=True)
    base = model.flat.clone()
    tok = _word_tokenizer(cfg.vocab_size)
    P, G, Lp, Lc = (4, 4, 8, 16) if a.tiny else (32, 8, 32, 256)
    res = {"protocol": {"prompts": P, "group": G, "prompt_len": Lp, "completion_len": Lc, "mu": 2,
                        "steps": a.steps, "final_norm_scale": scale, "entropy": ent},
           "tiny": a.tiny, "modes": {}}
    for ol, bc in MODES:
        rows = run_mode(model, base, tok, cfg.vocab_size, ol, bc, P, G, Lp, Lc, a.steps)
        res["modes"][f"{ol}/{bc}"] = rows
        timed = rows[1:] or rows
        res["modes"][f"{ol}/{bc}_median_step_s"] = statistics.median(r["wall_s"] for r in timed)
        r = rows[-1]
        print(f"{ol}/{bc}: step {res['modes'][f'{ol}/{bc}_median_step_s']:.3f} s  "
              + "  ".join(f"{k.split('/')[-1]} {v:.4g}" for k, v in r.items()
                          if k.startswith(("mismatch/", "correction/")))
              + f"  first update {r['first_update']}", flush=True)
    if not a.tiny:
        print(write_json("mismatch.json", res))


if __name__ == "__main__":
    main()
