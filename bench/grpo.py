"""GRPO-step benchmark (BENCHMARKS.md section 3), rlcu against TRL's GRPOTrainer in the same run.

Protocol A: 8 prompts x 8 completions, prompt 128 tokens, completion 256 tokens (exact: EOS
ignored), one optimizer step per batch, gradient checkpointing. Protocol B: completion 2048.
Qwen3-0.6B shape, random bf16 weights. Reported: seconds per step (median of the timed steps
after warm-up), the phases (generate / logprobs / train), peak GPU memory. Each side runs in
its own process. Prompts are random token ids; with no real tokenizer, a word-level
tokenizer over the model's vocabulary (word i = "t{i}") serves both sides, so a prompt of
128 words is exactly 128 tokens. The reward is a fixed pseudo-random function of the
completion text, so the advantages (and the backward) are not zero.

rlcu runs in two memory modes (rows "rlcu" and "rlcu_bf16"), the same step otherwise:
  default  fp32 master weights + fp32 Adam m, v (rlcu's default optimizer precision)
  bf16     optim.master_weights=false + optim.state_dtype=bfloat16 + optim.grad_dtype=bfloat16: the
           bf16 weights are updated in place with stochastic rounding, bf16 m, v, bf16 gradients --
           TRL's precision class (torch AdamW on bf16 parameters: bf16 moments and gradients, no
           master copy); micro-batches of --bf16-micro-batch-tokens
The default mode's gradients are fp32. Besides the whole step's peak, each rlcu row
reports the peak of each phase (rollout: wake -> generate -> sleep; train: the updates and the
gradient buffer's release), what stays allocated between steps, and the arithmetic of the large
buffers (weights, optimizer state, gradients, KV pool).

LoRA (`--lora R`, issue 35): the same step with adapters of rank R, alpha 2R, on all linear layers
(the LM head stays frozen): rlcu with its `lora:` section (the base frozen, the adapters' fp32
master and moments: the default memory mode), TRL's GRPOTrainer with PEFT (peft_config=LoraConfig
of the same r, alpha and target_modules="all-linear"; PEFT keeps the adapters in fp32 beside the
bf16 base, torch AdamW's moments follow them). Protocol A by default; the JSON is
grpo_lora_r<R>.json. Every row reports its trained parameters (both sides count the same
adapters); the TRL row's phases are its `_generate` and the rest of its step.

    python bench/grpo.py                      # protocols A and B, rlcu (both modes) and (if installed) TRL
    python bench/grpo.py --lora 16            # protocol A, LoRA r = 16: rlcu beside TRL + PEFT
    python bench/grpo.py --memory-mode bf16   # rlcu in one memory mode only
    python bench/grpo.py --quick              # protocol A, rlcu only, 1 warm-up + 2 timed steps
    python bench/grpo.py --quick --tiny       # a tiny model on whatever device (a CPU smoke test)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
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

from bench.common import MEMORY_MODES, qwen3_06b_config, trl_step_timer, write_json  # noqa: E402

PROTOCOLS = {"A": dict(prompts=8, group=8, prompt_len=128, completion_len=256),
             "B": dict(prompts=8, group=8, prompt_len=128, completion_len=2048)}
MEMORY_NOTES = {
    "default": "rlcu's default optimizer precision: fp32 master weights + fp32 Adam m, v (12 bytes/param of "
               "optimizer state beside the bf16 weights); fp32 gradients, freed between steps",
    "bf16": "optim.master_weights=false + optim.state_dtype=bfloat16 + optim.grad_dtype=bfloat16: no master, "
            "the bf16 weights updated in place with stochastic rounding, bf16 m, v (4 bytes/param), bf16 "
            "gradients freed between steps -- TRL's precision class (torch AdamW on bf16 params: bf16 moments "
            "and gradients, no master); smaller micro-batches (micro_batch_tokens) so that the activations fit "
            "under TRL's peak",
}
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def hash_reward(prompts, completions, **_):
    """A fixed pseudo-random reward in [0, 1) of the completion text (both sides use it)."""
    return [int.from_bytes(hashlib.blake2b(str(c).encode(), digest_size=4).digest(), "little") / 2**32
            for c in completions]


def _model_cfg(tiny: bool):
    from rlcu.model.config import Qwen3Config

    return Qwen3Config(**TINY, eos_token_id=1, bos_token_id=None) if tiny else qwen3_06b_config()


def _word_tokenizer(V: int):
    """Word i is "t{i}" (i >= 1); id 0 is <unk>. No special tokens: EOS is never produced as text."""
    from rlcu.data.tokenizer import make_word_tokenizer

    return make_word_tokenizer([f"t{i}" for i in range(1, V)])


def _prompts(V: int, n: int, L: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (n, L), generator=g).tolist()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- rlcu
class _PhasePeaks:
    """Peak allocated GPU memory per phase of the trainer's step, by wrapping its phase methods
    (the peak counter is reset at each phase's start; the run's overall peak is kept apart)."""

    def __init__(self, tr):
        self.peaks: dict[str, float] = {}
        self.overall = 0
        for name, attr in (("rollout", "_engine_phase"), ("train", "_policy_update"),
                           ("train", "_end_train_phase")):
            setattr(tr, attr, self._wrap(name, getattr(tr, attr)))

    def _wrap(self, name, fn):
        def run(*a, **k):
            torch.cuda.synchronize()
            self.overall = max(self.overall, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
                self.overall = max(self.overall, peak)
                self.peaks[name] = max(self.peaks.get(name, 0), peak)

        return run

    def reset(self):
        self.peaks, self.overall = {}, 0
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return max(self.overall, torch.cuda.max_memory_allocated())


def _buffer_arithmetic(tr, kv_blocks: int, block: int) -> dict:
    """GiB of the large buffers, from their shapes (with LoRA: the optimizer's and gradients' are the adapters')."""
    m, c = tr.model, tr.model.cfg
    st = tr.opt.state_bytes()
    kv = 2 * c.num_hidden_layers * kv_blocks * block * c.num_key_value_heads * c.head_dim * m.flat.element_size()
    lo = m.lora
    grads = lo.num_params() * lo.grad_dtype.itemsize if lo is not None else m.layout.numel * m.grad_dtype.itemsize
    gib = {"weights": m.flat.numel() * m.flat.element_size(), "master": st["master"], "adam_m": st["m"],
           "adam_v": st["v"], "grads": grads, "kv_pool": kv}
    return {k: v / 2**30 for k, v in gib.items()}


def bench_rlcu(proto: dict, steps: int, warmup: int, tiny: bool, micro_batch_tokens: int,
               memory_mode: str = "default", exact: bool = False, lora: int = 0) -> dict:
    from rlcu.config import GRPOConfig, _build
    from rlcu.model.causal_lm import Qwen3
    from rlcu.train.grpo import GRPOTrainer

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = _model_cfg(tiny)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    model = Qwen3.from_config(cfg, device=dev, dtype=dtype, seed=0)
    model.gradient_checkpointing = True
    tok = _word_tokenizer(cfg.vocab_size)
    P, G, Lp, Lc = proto["prompts"], proto["group"], proto["prompt_len"], proto["completion_len"]
    total = warmup + steps
    rows = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size, P * total, Lp)]
    block = 16
    kv_blocks = P * G * (-(-(Lp + Lc + 1) // block)) + 64  # the batch, nothing more (no prefix-sharing credit)
    gcfg = _build(GRPOConfig, dict(
        steps=total, prompts_per_step=P, group_size=G, max_new_tokens=Lc, temperature=1.0, stop_at_eos=False,
        mu=1, micro_batch_tokens=micro_batch_tokens, exact=exact, lora=lora_section(lora),
        optim=dict(lr=1e-6, **MEMORY_MODES[memory_mode]),
        data=dict(shuffle=False),
        engine=dict(max_num_seqs=P * G, block_size=block, num_kv_blocks=kv_blocks,
                    max_num_batched_tokens=max(8192, P * Lp)),
        log=dict(out_dir=tempfile.mkdtemp(prefix="rlcu-bench-grpo-"), progress=False, tensorboard=False, plot=False),
        checkpoint=dict(save_at_end=False)))
    tr = GRPOTrainer(gcfg, rows, [hash_reward], model=model, tokenizer=tok)
    pp = _PhasePeaks(tr) if cuda else None
    times, phases = [], []
    for s in range(total):
        if s == warmup and cuda:
            pp.reset()
        _sync()
        t0 = time.perf_counter()
        m = tr.train_step(s)
        _sync()
        dt = time.perf_counter() - t0
        if s >= warmup:
            times.append(dt)
            phases.append({k[5:]: m[k] for k in ("time/generate", "time/logprobs", "time/train") if k in m})
            lens = m.get("completion_len")
    res = {"s_per_step": statistics.median(times), "steps": times,
           "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
           "completion_len_mean": lens, "tokens_per_step": P * G * (Lp + Lc)}
    res["memory_mode"] = memory_mode
    res["micro_batch_tokens"] = gcfg.micro_batch_tokens
    res["graph_wakes"] = dict(tr.llm.runner.graph_wakes)
    res["buffers_GiB"] = _buffer_arithmetic(tr, kv_blocks, block)
    res["trained_params"] = model.lora.num_params() if model.lora is not None else model.num_params()
    if cuda:
        res["peak_GiB"] = (pp.peak() - base) / 2**30
        res["phase_peak_GiB"] = {k: (v - base) / 2**30 for k, v in pp.peaks.items()}
        res["between_steps_GiB"] = (torch.cuda.memory_allocated() - base) / 2**30
        res["kv_pool_blocks"] = kv_blocks
    del tr, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def lora_section(r: int) -> dict:
    """rlcu's `lora:` section of --lora r (empty: full fine-tuning); TRL's LoraConfig matches it."""
    return dict(r=r, alpha=2 * r, target_modules="all-linear") if r else {}


# ---------------------------------------------------------------- TRL
def _timed(fn, times: list[float]):
    """fn, appending the seconds of each call (the device waited for at both ends) to times."""
    def run(*a, **k):
        _sync()
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _sync()
            times.append(time.perf_counter() - t0)

    return run


def bench_trl(proto: dict, steps: int, warmup: int, tiny: bool, lora: int = 0) -> dict:
    try:
        import datasets
        import trl
        from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM
        from transformers import Qwen3Config as HFConfig
    except ImportError as e:
        return {"error": f"TRL side skipped: {e} (install trl, datasets, dill, multiprocess)"}
    import dataclasses

    cuda = torch.cuda.is_available()
    cfg = _model_cfg(tiny)
    skip = ("architectures", "model_type", "torch_dtype")
    hcfg = HFConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in skip})
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hcfg).to("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    wt = _word_tokenizer(cfg.vocab_size)
    # the model's EOS id as the tokenizer's eos (transformers' generation needs one for
    # min_new_tokens); a random model practically never samples it
    tok = PreTrainedTokenizerFast(tokenizer_object=wt.backend, unk_token="<unk>", pad_token="<unk>",
                                  eos_token=f"t{cfg.eos_token_ids[0]}")
    P, G, Lp, Lc = proto["prompts"], proto["group"], proto["prompt_len"], proto["completion_len"]
    total = warmup + steps
    texts = [" ".join(f"t{i}" for i in p) for p in _prompts(cfg.vocab_size, P * total, Lp)]
    ds = datasets.Dataset.from_list([{"prompt": t} for t in texts])
    want = dict(output_dir=tempfile.mkdtemp(prefix="trl-bench-grpo-"), per_device_train_batch_size=P * G,
                gradient_accumulation_steps=1, num_generations=G, max_prompt_length=Lp, max_completion_length=Lc,
                gradient_checkpointing=True, bf16=cuda, learning_rate=1e-6, beta=0.0, temperature=1.0,
                num_iterations=1, steps_per_generation=1, max_steps=total, logging_steps=1, report_to=[],
                save_strategy="no", shuffle_dataset=False, seed=0,
                generation_kwargs={"min_new_tokens": Lc}, use_cpu=not cuda)
    names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    dropped = sorted(k for k in want if k not in names)
    args = trl.GRPOConfig(**{k: v for k, v in want.items() if k in names})
    times: list[float] = []

    timer = trl_step_timer(times, warmup, cuda)

    peft_config = None
    if lora:
        import peft

        peft_config = peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear", lora_dropout=0.0,
                                      task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[hash_reward], args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[timer], peft_config=peft_config)
    gen: list[float] = []
    trainer._generate = _timed(trainer._generate, gen)  # one call a step (steps_per_generation=1)
    trainer.train()
    res = {"s_per_step": statistics.median(times) if times else None, "steps": times, "trl": trl.__version__,
           "config_fields_not_in_this_trl": dropped,
           "trained_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}
    if lora:
        res["peft"] = peft.__version__
    if times and len(gen) >= len(times):
        g = gen[-len(times):]
        res["phases_s"] = {"generate": statistics.median(g),
                           "train": statistics.median(t - x for t, x in zip(times, g))}
    if cuda:
        res["peak_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return res


# ---------------------------------------------------------------- driver
def run_side(side: str, a) -> dict:
    proto = dict(PROTOCOLS[a.protocol])
    if a.tiny:
        proto.update(prompt_len=16, completion_len=16 if a.protocol == "A" else 64)
    if side.startswith("rlcu"):
        mode = "bf16" if side == "rlcu_bf16" else "default"
        mbt = a.bf16_micro_batch_tokens if mode == "bf16" else a.micro_batch_tokens
        return bench_rlcu(proto, a.steps, a.warmup, a.tiny, mbt, mode, lora=a.lora)
    return bench_trl(proto, a.steps, a.warmup, a.tiny, lora=a.lora)


def _expand_sides(sides: str, memory_mode: str) -> list[str]:
    """'rlcu' -> the rows of the memory modes asked for ('rlcu' = default, 'rlcu_bf16')."""
    rows = {"default": ["rlcu"], "bf16": ["rlcu_bf16"], "both": ["rlcu", "rlcu_bf16"]}[memory_mode]
    out = []
    for side in sides.split(","):
        out += rows if side == "rlcu" else [side]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocols", default=None, help="default A,B (A with --lora)")
    ap.add_argument("--sides", default="rlcu,trl")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--b-steps", type=int, default=None, help="timed steps of protocol B (default --steps)")
    ap.add_argument("--b-warmup", type=int, default=None, help="warm-up steps of protocol B (default --warmup)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="rlcu's micro-batch (default mode)")
    ap.add_argument("--bf16-micro-batch-tokens", type=int, default=12288, help="rlcu's micro-batch in the bf16 mode")
    ap.add_argument("--lora", type=int, default=0, help="LoRA of rank R (alpha 2R, all linear) on both sides")
    ap.add_argument("--memory-mode", choices=("default", "bf16", "both"), default=None,
                    help="rlcu's optimizer precision: default (fp32 master + fp32 m, v), "
                         "bf16 (no master, bf16 m, v and gradients, stochastic rounding), or both (two rows; the "
                         "default without --lora)")
    ap.add_argument("--quick", action="store_true", help="protocol A, rlcu only, 1 warm-up + 2 timed steps")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and short sequences (CPU smoke test)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per side and protocol")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--protocol", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.protocols = a.protocols or ("A" if a.lora else "A,B")
    a.memory_mode = a.memory_mode or ("default" if a.lora else "both")
    if a.quick:
        a.protocols, a.sides, a.steps, a.warmup = "A", "rlcu", 2, 1
    if a.side:
        print("RESULT " + json.dumps(run_side(a.side, a)))
        return
    t0 = time.time()
    res = {"protocol": {k: v for k, v in PROTOCOLS.items() if k in a.protocols.split(",")},
           "method": "Qwen3-0.6B shape, random bf16 weights, EOS ignored (exact lengths), gradient checkpointing, "
                     "one optimizer step per batch, no KL; median s/step after warm-up; each side in its own process",
           "tiny": a.tiny, "memory_modes": {m: MEMORY_NOTES[m] for m in MEMORY_NOTES
                                            if a.memory_mode in (m, "both")}}
    if a.lora:
        res["lora"] = dict(lora_section(a.lora), peer="TRL GRPOTrainer + PEFT LoraConfig (same r, lora_alpha, "
                           "target_modules='all-linear')")
    sides = _expand_sides(a.sides, a.memory_mode)
    for p in a.protocols.split(","):
        res[p] = {}
        steps, warmup = a.steps, a.warmup
        if p == "B":
            steps, warmup = a.b_steps or a.steps, a.b_warmup if a.b_warmup is not None else a.warmup
        res[p]["timed_steps"], res[p]["warmup_steps"] = steps, warmup
        for side in sides:
            cmd = [sys.executable, __file__, "--side", side, "--protocol", p, "--steps", str(steps),
                   "--warmup", str(warmup), "--micro-batch-tokens", str(a.micro_batch_tokens),
                   "--bf16-micro-batch-tokens", str(a.bf16_micro_batch_tokens), "--lora", str(a.lora)]
            if a.tiny:
                cmd.append("--tiny")
            try:
                pr = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                    env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                line = [x for x in pr.stdout.splitlines() if x.startswith("RESULT ")]
                res[p][side] = json.loads(line[-1][7:]) if line else {"error": (pr.stderr or pr.stdout)[-800:]}
            except subprocess.TimeoutExpired:
                res[p][side] = {"error": f"timed out after {a.timeout} s"}
        t = res[p].get("trl", {})
        for side, suffix in (("rlcu", ""), ("rlcu_bf16", "_bf16")):
            r = res[p].get(side, {})
            if r.get("s_per_step") and t.get("s_per_step"):
                res[p]["speedup_vs_trl" + suffix] = t["s_per_step"] / r["s_per_step"]
                if r.get("peak_GiB") and t.get("peak_GiB"):
                    res[p]["memory_ratio_vs_trl" + suffix] = r["peak_GiB"] / t["peak_GiB"]
    res["wall_s"] = time.time() - t0
    name = f"grpo_lora_r{a.lora}" if a.lora else "grpo"
    write_json(f"{name}_tiny.json" if a.tiny else f"{name}.json", res)
    print(f"\n{'GRPO step':<16} {'s/step':>8} {'gen':>7} {'lp':>6} {'train':>7} {'peak GiB':>9} {'rollout':>8} "
          f"{'train':>6} {'vs TRL':>7} {'trained':>11}")
    for p in a.protocols.split(","):
        for side in sides:
            r = res[p].get(side, {})
            if r.get("s_per_step"):
                ph, pp = r.get("phases_s", {}), r.get("phase_peak_GiB", {})
                key = "speedup_vs_trl" + ("_bf16" if side == "rlcu_bf16" else "")
                sp = f"{res[p][key]:.1f}x" if side.startswith("rlcu") and key in res[p] else ""
                pk = f"{r['peak_GiB']:.2f}" if "peak_GiB" in r else "-"
                pr = f"{pp['rollout']:.2f}" if "rollout" in pp else "-"
                pt = f"{pp['train']:.2f}" if "train" in pp else "-"
                print(f"{p + ' ' + side:<16} {r['s_per_step']:>8.2f} {ph.get('generate', 0):>7.2f} "
                      f"{ph.get('logprobs', 0):>6.2f} {ph.get('train', 0):>7.2f} {pk:>9} {pr:>8} {pt:>6} {sp:>7} "
                      f"{r.get('trained_params', 0):>11,}")
            else:
                print(f"{p + ' ' + side:<16} {str(r.get('error', 'no result'))[-300:]}")


if __name__ == "__main__":
    main()
