"""The memory model (rlcu.memory) against the peaks the GPU reports: at the published 0.6B and
4B shapes with random bf16 weights, an SFT-style train step (forward, backward, optimizer) in
each checkpointing mode and precision, and a GRPO step's rollout (the RL trainer's one-step
pool, CUDA graphs on, beside the optimizer's state), each phase's
`torch.cuda.max_memory_allocated()` within 10% of the model's estimate of it. It prints every
phase (measured and estimated, GiB), the allocator's reserved over allocated at the peak (the
model's FRAGMENTATION) and the device memory outside the allocator (its CONTEXT_BYTES), and
writes them to $OUT/memory_gpu.json when OUT is set.

    python3 -m pytest -m gpu -q -p no:cacheprovider tests/integration/test_memory_gpu.py -s

On an H200 (torch 2.11), GiB measured / estimated: 0.6B train steps 11.31 / 11.34 (full
checkpointing), 20.72 / 20.75 (none), 6.58 / 6.64 (bf16 mode, attention), rollout 18.97 / 19.41;
4B train steps 70.82 / 70.89, 99.30 / 99.40, 35.58 / 35.65, rollout 66.99 / 68.14; reserved over
allocated 1.000 to 1.015; 0.77 GiB outside the allocator.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
from support.shapes import SHAPES

from bench.generate import random_model  # bf16 weights drawn on the device
from rlcu.config import OptimConfig
from rlcu.engine import LLM, SamplingParams
from rlcu.memory import GiB, job_memory
from rlcu.memory.fit import step_kv_blocks
from rlcu.model.causal_lm import Qwen3
from rlcu.model.config import Qwen3Config
from rlcu.optim import FlatAdamW
from rlcu.train import sizing

pytestmark = pytest.mark.gpu

TOL = 0.10
B, T = 4, 2048  # the train step: 4 sequences of 2048 tokens
PROMPTS, GROUP, PROMPT_LEN, NEW = 32, 8, 128, 256  # the rollout: one GRPO step's sequences
PRECISIONS = {"default": dict(), "bf16": dict(master_weights=False, state_dtype="bfloat16", grad_dtype="bfloat16")}
CASES = [("default", True), ("default", 0), ("bf16", "attention")]  # (precision, checkpointing) of the train steps


def peak(fn, *args) -> tuple[int, int]:
    """(the most bytes allocated, the most reserved) while fn(*args) runs."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def free_all() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def train_step(model: Qwen3, opt: FlatAdamW, tokens, cu) -> None:
    """SFT's eager step (train/sft.py): forward, backward of the mean completion-token loss, AdamW."""
    n = tokens.numel()
    mask = torch.ones(n, device="cuda")
    model.zero_grad()
    lp = model.forward(tokens, cu)
    loss = -(lp * mask).sum()
    model.backward(mask * (-1.0 / n))
    opt.step(1e-5, float(loss) / n)


def measure_train(name: str, cfg: Qwen3Config, rows: list) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (B * T,), device="cuda", generator=g)
    cu = torch.arange(0, (B + 1) * T, T, device="cuda", dtype=torch.int32)
    for prec, ckpt in CASES:
        base = free_all()
        model = random_model(cfg, "cuda")
        model.gradient_checkpointing = ckpt
        opt = FlatAdamW(model, OptimConfig(**PRECISIONS[prec]))
        train_step(model, opt, tokens, cu)  # compiles and autotunes (their scratch is not the model's)
        alloc, reserved = peak(train_step, model, opt, tokens, cu)
        est = job_memory(sizing.run_shape(model, opt, micro_batch_tokens=B * T, fused_head=False))
        rows.append(dict(shape=name, phase="actor_train", case=f"{prec} precision, checkpointing {ckpt}",
                         measured=alloc - base, estimate=est.total("actor_train"), reserved_over_allocated=reserved
                         / alloc, estimate_parts={k: v for k, v in est.phases().items()}))
        del model, opt, est


def measure_rollout(name: str, cfg: Qwen3Config, rows: list) -> None:
    base = free_all()
    model = random_model(cfg, "cuda")
    opt = FlatAdamW(model, OptimConfig())  # what an RL trainer holds through its rollout (its gradient released)
    blocks = step_kv_blocks(PROMPT_LEN, NEW, 16, PROMPTS * GROUP)
    llm = LLM(model, num_kv_blocks=blocks, block_size=16, max_model_len=PROMPT_LEN + NEW + 16)
    llm.sleep(keep_graphs=True)  # as the RL trainer does after building it
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist()}
               for _ in range(PROMPTS)]
    sp = SamplingParams(n=GROUP, temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=3, logprobs=True)

    def rollout(llm):
        llm.wake()
        llm.generate(prompts, sp, progress=False)
        llm.sleep(keep_graphs=True)

    rollout(llm)  # the first after a sleep captures the prefill graphs again, as every later one does
    alloc, reserved = peak(rollout, llm)
    est = job_memory(sizing.run_shape(model, opt, micro_batch_tokens=B * T, fused_head=True, release_grads=True,
                                      llm=llm))
    rows.append(dict(shape=name, phase="rollout", case=f"{PROMPTS} x {GROUP}, {PROMPT_LEN} + {NEW} tokens, "
                     f"{blocks} blocks", measured=alloc - base, estimate=est.total("rollout"),
                     reserved_over_allocated=reserved / alloc, estimate_parts={k: v for k, v in est.phases().items()}))
    free, total = torch.cuda.mem_get_info()
    rows.append(dict(shape=name, phase="context", case="device used outside torch's allocator",
                     measured=total - free - torch.cuda.memory_reserved()))
    del llm, model, opt, est


def test_the_model_within_ten_percent_of_the_measured_peaks():
    rows: list[dict] = []
    for name in ("0.6b", "4b"):
        cfg = Qwen3Config(**(SHAPES.get(name, {})))
        measure_train(name, cfg, rows)
        measure_rollout(name, cfg, rows)
        free_all()
    bad = []
    for r in rows:
        if "estimate" not in r:
            print(f"{r['shape']:5} {r['phase']:12} {r['measured'] / GiB:7.2f} GiB  ({r['case']})")
            continue
        err = (r["estimate"] - r["measured"]) / r["measured"]
        r["error"] = err
        print(f"{r['shape']:5} {r['phase']:12} measured {r['measured'] / GiB:7.2f} GiB  estimate "
              f"{r['estimate'] / GiB:7.2f} GiB  {100 * err:+6.2f}%  reserved/allocated "
              f"{r['reserved_over_allocated']:.3f}  ({r['case']})")
        if abs(err) > TOL:
            bad.append(r)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "memory_gpu.json").write_text(json.dumps(rows, indent=1, default=float))
    assert not bad, [(r["shape"], r["phase"], r["case"], r["error"]) for r in bad]
