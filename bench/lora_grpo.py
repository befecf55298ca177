"""LoRA GRPO beside full fine-tuning (issue 35) in the same call: bench/grpo.py's step (random
bf16 weights, word tokenizer, the hash reward, EOS ignored, one optimizer step per batch,
gradient checkpointing, no KL) at the Qwen3-8B shape, 32 prompts x 8 completions, prompt 128 +
completion 256 tokens. Rows, each in its own process:
  lora  LoRA r = --lora (all linear), the base frozen, the adapters' fp32 master and moments
        (the default optimizer precision), fp32 adapter gradients
  full  every weight trains, in the bf16 memory mode (the default mode's 8B state, ~131 GiB of
        master, moments and gradients, does not fit one H200)
Reported: median s/step after warm-up, the phases, the peak GPU memory (the step's and each
phase's). Targets: LoRA's peak <= 40 GiB and its step <= 0.8x full fine-tuning's.

Checkpointing: each row's `--ckpt` (default auto: the fewest checkpointed layers whose modelled peak
fits what the process may hold). The lora row runs under `--lora-budget-gib` (default 40, the
target): its allocator is capped there (torch.cuda.set_per_process_memory_fraction, which fails any
allocation past it) and auto fits that cap, as it would on a 40 GiB device; the full row has the
whole H200. `--ckpt full` with `--lora-budget-gib 0` is the first protocol (every layer
checkpointed, no cap). A MoE shape records the rollout-against-training route disagreement
(moe/route_mismatch*, rlcu.train.moe_routes); `--exact` runs the job in exact mode (0 expected).

--shape qwen3-30b-a3b (issue 37): the lora row alone by default (full fine-tuning of 30B-A3B does
not fit one H200: the trainer refuses it at setup, rlcu.train.sizing.refuse_unfit); its adapters
are the attention's by default (--targets: the recorded rows' protocol; all-linear would add one
adapter an expert, 3.9B parameters at r = 64, model/lora.py), the bf16 base of 61 GB frozen.
With --tiny a small model of the shape's family (a MoE: 8 experts, top 2).

    python bench/lora_grpo.py                 # on the H200: lora and full rows, JSON lora_grpo_8b_r64.json
    python bench/lora_grpo.py --shape qwen3-30b-a3b   # lora_grpo_qwen3-30b-a3b_r64.json
    python bench/lora_grpo.py --quick --tiny  # a CPU smoke test (tiny model, 1 + 1 steps)
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

from bench.common import MEMORY_MODES, SHAPES, write_json  # noqa: E402
from bench.generate import random_model  # noqa: E402
from bench.grpo import TINY, _PhasePeaks, _prompts, _sync, _word_tokenizer, hash_reward  # noqa: E402

PROTOCOL = dict(prompts=32, group=8, prompt_len=128, completion_len=256)
ROWS = ("lora", "full")


def is_moe(shape: str) -> bool:
    return SHAPES[shape].get("family") == "qwen3_moe"


def tiny_family(shape: str) -> dict:
    """--tiny's family fields for `shape`: a MoE's 8 experts of 64, top 2; none for a dense one."""
    return dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                norm_topk_prob=True) if is_moe(shape) else {}


def bench_side(side: str, a) -> dict:
    from rlcu.config import GRPOConfig, _build
    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config
    from rlcu.train.grpo import GRPOTrainer

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = Qwen3Config(**TINY, **tiny_family(a.shape), eos_token_id=1, bos_token_id=None) if a.tiny else \
        Qwen3Config(**SHAPES[a.shape])
    P, G, Lp, Lc = PROTOCOL["prompts"], PROTOCOL["group"], PROTOCOL["prompt_len"], PROTOCOL["completion_len"]
    if a.tiny:
        P, G, Lp, Lc = 4, 4, 16, 16
    total = a.warmup + a.steps
    ckpt = {"true": True, "false": False}.get(a.ckpt, int(a.ckpt) if a.ckpt.isdigit() else a.ckpt)
    mbt = a.lora_micro_batch_tokens if side == "lora" and a.lora_micro_batch_tokens else a.micro_batch_tokens
    if cuda and side == "lora" and a.lora_budget_gib > 0:
        torch.cuda.set_per_process_memory_fraction(a.lora_budget_gib * 2**30 / torch.cuda.mem_get_info()[1])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    # on the GPU straight in bf16 (from_config stages the weights in fp32 first: 183 GB at 30B-A3B)
    model = random_model(cfg, dev) if cuda else Qwen3.from_config(cfg, device=dev, dtype=dtype, seed=0)
    block = 16
    kv_blocks = P * G * (-(-(Lp + Lc + 1) // block)) + 64
    lora = dict(r=a.lora, alpha=2 * a.lora, target_modules=a.targets.split(",") if "," in a.targets
                else a.targets) if side == "lora" else {}
    gcfg = _build(GRPOConfig, dict(
        steps=total, prompts_per_step=P, group_size=G, max_new_tokens=Lc, temperature=1.0, stop_at_eos=False, mu=1,
        micro_batch_tokens=mbt, lora=lora,
        optim=dict(lr=1e-6, **MEMORY_MODES["default" if side == "lora" else "bf16"]),
        model=dict(gradient_checkpointing=ckpt), data=dict(shuffle=False), exact=a.exact,
        engine=dict(max_num_seqs=P * G, block_size=block, num_kv_blocks=kv_blocks,
                    max_num_batched_tokens=max(8192, P * Lp)),
        log=dict(out_dir=tempfile.mkdtemp(prefix="rlcu-bench-lora-grpo-"), progress=False, tensorboard=False,
                 plot=False),
        checkpoint=dict(save_at_end=False)))
    model.gradient_checkpointing = ckpt
    rows = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size, P * total, Lp)]
    tr = GRPOTrainer(gcfg, rows, [hash_reward], model=model, tokenizer=_word_tokenizer(cfg.vocab_size))
    pp = _PhasePeaks(tr) if cuda else None
    times, phases, moe = [], [], []
    for s in range(total):
        if s == a.warmup and cuda:
            pp.reset()
        _sync()
        t0 = time.perf_counter()
        m = tr.train_step(s)
        _sync()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
            phases.append({k[5:]: m[k] for k in ("time/generate", "time/logprobs", "time/train") if k in m})
            moe.append({k: m[k] for k in m if k.startswith(("moe/", "mismatch/"))})
    st = tr.opt.state_bytes()
    res = {"s_per_step": statistics.median(times), "steps": times,
           "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
           "trained_params": model.lora.num_params() if model.lora is not None else model.num_params(),
           "optimizer_state_GiB": sum(st.values()) / 2**30, "micro_batch_tokens": mbt,
           "gradient_checkpointing": {"asked": a.ckpt, "ran": model.gradient_checkpointing},
           "budget_GiB": a.lora_budget_gib if cuda and side == "lora" and a.lora_budget_gib > 0 else None}
    if moe and moe[0]:
        res["moe"] = {k: statistics.median(x[k] for x in moe) for k in moe[0]}
    if cuda:
        res["peak_GiB"] = (pp.peak() - base) / 2**30
        res["phase_peak_GiB"] = {k: (v - base) / 2**30 for k, v in pp.peaks.items()}
        res["between_steps_GiB"] = (torch.cuda.memory_allocated() - base) / 2**30
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lora", type=int, default=64, help="the adapters' rank r (all linear)")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="the model shape (bench/common.py)")
    ap.add_argument("--targets", default=None, help="the adapters' target_modules, comma-separated or all-linear "
                    "(default: all-linear; a MoE shape's attention)")
    ap.add_argument("--sides", default=None, help="rows (default: lora,full; lora for a MoE shape)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--lora-micro-batch-tokens", type=int, default=4096, help="the lora row's (0: as the full row)")
    ap.add_argument("--ckpt", default="auto", help="gradient checkpointing of every row: auto, full/true, attention, "
                                                    "none/false or a number of layers")
    ap.add_argument("--lora-budget-gib", type=float, default=40.0, help="the lora row's allocator cap (0: none)")
    ap.add_argument("--exact", action="store_true", help="exact mode (the MoE rows: 0 route disagreement)")
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 1 timed step")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and short sequences (CPU smoke test)")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per side")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup = 1, 1
    if a.sides is None:
        a.sides = "lora" if is_moe(a.shape) else ",".join(ROWS)
    if a.targets is None:
        a.targets = "q_proj,k_proj,v_proj,o_proj" if is_moe(a.shape) else "all-linear"
    if a.side:
        print("RESULT " + json.dumps(bench_side(a.side, a)))
        return
    t0 = time.time()
    res = {"protocol": PROTOCOL, "shape": a.shape, "lora_r": a.lora, "target_modules": a.targets, "tiny": a.tiny,
           "exact": a.exact,
           "ckpt": a.ckpt, "lora_budget_GiB": a.lora_budget_gib,
           "method": __doc__.split("\n\n")[0].replace("\n", " "), "timed_steps": a.steps, "warmup_steps": a.warmup}
    for side in a.sides.split(","):
        cmd = [sys.executable, __file__, "--side", side, "--lora", str(a.lora), "--shape", a.shape, "--steps",
               str(a.steps), "--warmup", str(a.warmup), "--micro-batch-tokens", str(a.micro_batch_tokens),
               "--lora-micro-batch-tokens", str(a.lora_micro_batch_tokens), "--ckpt", a.ckpt,
               "--lora-budget-gib", str(a.lora_budget_gib), "--targets", a.targets] + (["--exact"] if a.exact else [])
        cmd += ["--tiny"] if a.tiny else []
        try:
            pr = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = [x for x in pr.stdout.splitlines() if x.startswith("RESULT ")]
            res[side] = json.loads(line[-1][7:]) if line else {"error": (pr.stderr or pr.stdout)[-800:]}
        except subprocess.TimeoutExpired:
            res[side] = {"error": f"timed out after {a.timeout} s"}
    lo, fu = res.get("lora", {}), res.get("full", {})
    if lo.get("s_per_step") and fu.get("s_per_step"):
        res["step_ratio_lora_vs_full"] = lo["s_per_step"] / fu["s_per_step"]
        res["targets"] = {"peak_le_40GiB": lo.get("peak_GiB", 0) <= 40, "step_le_0.8x_full":
                          res["step_ratio_lora_vs_full"] <= 0.8}
    res["wall_s"] = time.time() - t0
    write_json(f"lora_grpo_tiny{'_moe' if is_moe(a.shape) else ''}.json" if a.tiny
               else f"lora_grpo_{a.shape}_r{a.lora}{'_exact' if a.exact else ''}.json", res)
    for side in a.sides.split(","):
        r = res.get(side, {})
        if r.get("s_per_step"):
            pk = f"{r['peak_GiB']:.2f} GiB" if "peak_GiB" in r else "-"
            print(f"{side:<6} {r['s_per_step']:8.2f} s/step  peak {pk}  phases {r['phases_s']}")
        else:
            print(f"{side:<6} {str(r.get('error', 'no result'))[-400:]}")


if __name__ == "__main__":
    main()
