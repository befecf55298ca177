"""One run of bench/learning.py, in a process of its own (so that runs can share one GPU side by
side). Exact mode is the model's: the trainer sets it from `exact: true` (MODES["exact"]).

    python -m bench.learning_worker sft  --task demo --seed 0 --dir D [--device cuda --dtype bf16]
    python -m bench.learning_worker grpo --task demo --seed 0 --dir D --mode exact --steps 40

`sft` writes D/sft_model (an HF folder with a transformers tokenizer) and D/sft.json; `grpo`
trains from D/sft_model with rlcu in one of MODES or with TRL (`--mode trl`) and writes
D/<mode>.json: the reward per step, the mismatch metrics per step (rlcu's metrics.jsonl; None for
TRL, which logs none without vLLM), and the held-out greedy accuracy after, by `greedy_accuracy`,
the one evaluator of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import learning_tasks  # noqa: E402
from rlcu.config import ConfigError, check_device  # noqa: E402

# rlcu's GRPO options per mode; every other option is the same in all of them
MODES = {
    "default": {},  # old logprobs = the engine's sampling logprobs, no correction
    "tis": {"old_logprobs": "recompute", "behaviour_correction": "tis", "tis_cap": 2.0},
    "recompute": {"old_logprobs": "recompute"},
    "exact": {"exact": True},  # engine logprobs == trainer's bit for bit (old_logprobs: engine)
}
MISMATCH = ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/exact_frac", "mismatch/kl_k3",
            "mismatch/ratio_p01", "mismatch/ratio_p99", "mismatch/seq_abs_sum")
HYPER = dict(prompts_per_step=16, group_size=8, temperature=1.0, lr=2e-4, clip_low=0.2, clip_high=0.28)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def reward_exact(prompts, completions, answer, **_):
    from rlcu.data.synthetic import exact_match_reward

    return exact_match_reward(prompts, completions, answer)


def hf_tokenizer(tok):
    """A word tokenizer of rlcu as a transformers tokenizer (same backend, eos/pad)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok.backend, unk_token="<unk>", eos_token=tok.eos_token,
                                   pad_token=tok.pad_token, clean_up_tokenization_spaces=False)


@torch.no_grad()
def greedy_accuracy(model_dir, rows, max_new_tokens: int, device: str, dtype: torch.dtype) -> float:
    """Exact-match accuracy of greedy completions with transformers' generate, the weights in the
    run's dtype (prompts grouped by length, so there is no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcu.data.synthetic import exact_match_reward

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    by_len: dict[int, list] = {}
    for r in rows:
        ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        by_len.setdefault(len(ids), []).append((ids, r))
    ok = []
    for group in by_len.values():
        x = torch.tensor([g[0] for g in group], device=device)
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(y[:, x.shape[1]:], skip_special_tokens=True)
        ok += exact_match_reward(None, texts, [g[1]["answer"] for g in group])
    return sum(ok) / len(ok)


def _logs(out: Path):
    from rlcu.config import CheckpointConfig, LogConfig

    return (LogConfig(out_dir=str(out), plot=False, progress=False, tensorboard=False),
            CheckpointConfig(save_at_end=False))


def sft(task, seed: int, d: Path, device: str, dtype: torch.dtype) -> dict:
    """The demo's SFT warm-up (rlcu) from seeded random weights; saves d/sft_model."""
    from rlcu.config import SFTConfig, _build
    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config
    from rlcu.train.sft import SFTTrainer

    t0 = time.perf_counter()
    tok = task.tokenizer()
    qc = Qwen3Config(**{**task.model, "vocab_size": tok.vocab_size, "eos_token_id": tok.eos_token_id})
    model = Qwen3.from_config(qc, device=device, dtype=dtype, seed=seed)
    model.gradient_checkpointing = False
    log, ckpt = _logs(d / "sft")
    scfg = _build(SFTConfig, {
        "steps": task.sft_steps, "batch_tokens": task.sft_batch_tokens, "seed": seed,
        "optim": {"lr": task.sft_lr, "warmup_steps": min(10, task.sft_steps), "schedule": "cosine",
                  "min_lr_ratio": 0.1}, "log": log, "checkpoint": ckpt})
    SFTTrainer(scfg, task.rows("train", seed), model=model, tokenizer=tok).train()
    model.save_pretrained(d / "sft_model")
    hf_tokenizer(tok).save_pretrained(d / "sft_model")
    secs = time.perf_counter() - t0
    acc = greedy_accuracy(d / "sft_model", task.rows("eval", seed), task.max_new_tokens, device, dtype)
    return {"accuracy_before": acc, "seconds": secs}


def grpo_config(task, seed: int, mode: str, steps: int, out: Path):
    """rlcu's GRPOConfig of one mode: the shared hyper-parameters plus MODES[mode]."""
    from rlcu.config import GRPOConfig, _build

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    h = HYPER
    log, ckpt = _logs(out)
    return _build(GRPOConfig, {
        "steps": steps, "prompts_per_step": h["prompts_per_step"], "group_size": h["group_size"],
        "max_new_tokens": task.max_new_tokens, "temperature": h["temperature"], "optim": {"lr": h["lr"]},
        "clip_low": h["clip_low"], "clip_high": h["clip_high"], "loss_agg": "token", "kl_coef": 0.0, "mu": 1,
        "scale_rewards": True, "eval_every": 0, "rewards": [{"fn": "rlcu.data.synthetic:exact_match_reward"}],
        "seed": seed, "data": {"seed": seed}, "log": log, "checkpoint": ckpt, **MODES[mode]})


def _metrics(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("step", 0) > 0 and "reward" in r]


def grpo_rlcu(task, seed: int, mode: str, steps: int, d: Path, device: str, dtype: torch.dtype,
              engine_eval: bool = True) -> dict:
    """rlcu's GRPO in `mode` from d/sft_model; saves d/<mode>_model. engine_eval: also the held-out
    greedy accuracy by rlcu's own engine before and after (a cross-check of the shared evaluator)."""
    from rlcu.model.causal_lm import Qwen3
    from rlcu.train.demo import accuracy
    from rlcu.train.grpo import GRPOTrainer

    cfg = grpo_config(task, seed, mode, steps, d / mode)
    model = Qwen3.from_pretrained(d / "sft_model", device=device, dtype=dtype)
    model.gradient_checkpointing = False
    held = task.rows("eval", seed)
    trainer = GRPOTrainer(cfg, task.rows("train", seed), tokenizer=task.tokenizer(), model=model)
    eng_before = accuracy(trainer, held) if engine_eval else None
    t0 = time.perf_counter()
    trainer.train()
    secs = time.perf_counter() - t0
    eng_after = accuracy(trainer, held) if engine_eval else None
    rows = _metrics(d / mode / "metrics.jsonl")
    model.save_pretrained(d / f"{mode}_model")
    hf_tokenizer(task.tokenizer()).save_pretrained(d / f"{mode}_model")
    return {"reward": [r["reward"] for r in rows], "completion_len": [r.get("completion_len") for r in rows],
            "mismatch": {k: [r.get(k) for r in rows] for k in MISMATCH}, "seconds": secs,
            "accuracy_before_rlcu_engine": eng_before, "accuracy_after_rlcu_engine": eng_after}


def grpo_trl(task, seed: int, steps: int, d: Path, device: str, dtype: torch.dtype) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    h = HYPER
    P, G = h["prompts_per_step"], h["group_size"]
    args = GRPOConfig(
        output_dir=str(d / "trl"), max_steps=steps, per_device_train_batch_size=P * G, num_generations=G,
        steps_per_generation=1, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=task.max_new_tokens, temperature=h["temperature"], top_p=1.0, top_k=0,
        learning_rate=h["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        epsilon=h["clip_low"], epsilon_high=h["clip_high"], beta=0.0, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, gradient_checkpointing=False, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu=device == "cpu", seed=seed, data_seed=seed, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, log_completions=False)
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in task.rows("train", seed)])
    # fp32 master weights; with bf16 the forward runs under bf16 autocast (rlcu: bf16 weights, fp32 master)
    model = AutoModelForCausalLM.from_pretrained(d / "sft_model", dtype=torch.float32)
    tr = GRPOTrainer(model=model, reward_funcs=reward_exact, args=args, train_dataset=ds,
                     processing_class=AutoTokenizer.from_pretrained(d / "sft_model"))
    t0 = time.perf_counter()
    tr.train()
    secs = time.perf_counter() - t0
    logs = [x for x in tr.state.log_history if "reward" in x]
    tr.model.save_pretrained(d / "trl_model")
    AutoTokenizer.from_pretrained(d / "sft_model").save_pretrained(d / "trl_model")
    # TRL logs a sampler/trainer comparison only with vLLM ("sampling/..."); without it the old
    # logprobs are its own forward's, so there is no mismatch metric to record
    samp = sorted({k for x in logs for k in x if k.startswith("sampling/")})
    return {"reward": [x["reward"] for x in logs], "completion_len": [x.get("completions/mean_length") for x in logs],
            "mismatch": None, "trl_sampling_metrics": {k: [x.get(k) for x in logs] for k in samp} or None,
            "seconds": secs}


def grpo(task, seed: int, mode: str, steps: int, d: Path, device: str, dtype: torch.dtype,
         engine_eval: bool = True) -> dict:
    if mode == "trl":
        res = grpo_trl(task, seed, steps, d, device, dtype)
    else:
        res = grpo_rlcu(task, seed, mode, steps, d, device, dtype, engine_eval)
    res["accuracy_after"] = greedy_accuracy(d / f"{mode}_model", task.rows("eval", seed), task.max_new_tokens,
                                            device, dtype)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one run of bench/learning.py")
    p.add_argument("what", choices=("sft", "grpo"))
    p.add_argument("--task", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--dir", required=True, help="the (task, seed) folder: sft_model, results")
    p.add_argument("--mode", default="default", choices=(*MODES, "trl"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=tuple(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--no-engine-eval", action="store_true", help="skip rlcu's own-engine accuracy cross-check")
    p.add_argument("--scale", default="{}", help="JSON of Task fields to override (--quick's smaller warm-up)")
    a = p.parse_args(argv)
    try:  # one line, not torch's traceback, for a device this machine lacks
        check_device(a.device, "--device")
    except ConfigError as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dtype = DTYPES[a.dtype or ("bf16" if a.device == "cuda" else "fp32")]
    task = learning_tasks.get(a.task).scaled(**json.loads(a.scale))
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.what == "sft":
        res, name = sft(task, a.seed, d, a.device, dtype), "sft"
    else:
        res, name = grpo(task, a.seed, a.mode, a.steps, d, a.device, dtype, not a.no_engine_eval), a.mode
    res.update(task=a.task, seed=a.seed, mode=name, wall_seconds=time.perf_counter() - t0)
    (d / f"{name}.json").write_text(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
