"""Learning parity with TRL (BENCHMARKS.md section 5) on the built-in demo task.

For each seed: the demo's SFT warm-up (rlcu) once, saved as an HF folder plus a transformers
tokenizer; then GRPO from those same weights with (a) rlcu's GRPOTrainer and (b) TRL's
GRPOTrainer, with the same hyper-parameters as far as both expose them. Recorded: the mean
training reward per step and the held-out greedy exact-match accuracy before and after GRPO,
both measured by one evaluator (transformers greedy generate on the saved folders), so the
two frameworks are scored identically.

Device-independent: the tiny model runs on the CPU (1 thread) in seconds per step.

    pip install trl==1.16.0 datasets   # bench-only, never a dependency of rlcu
    python bench/learning.py [--seeds 0 1 2] [--steps 40]

Settings that cannot be matched exactly (recorded in the JSON under "unmatched"):
- the prompt order: each framework draws its own shuffle of the same training prompts;
- the sampling RNG: the two samplers draw different completions from the same distribution;
- rlcu samples in its paged engine (reference twins on the CPU), TRL with transformers' generate;
  both at temperature 1.0, no top-p / top-k, stopping at <|im_end|>.
Everything else (prompts/step 16, group 8, max new tokens = max digits + 2, lr 2e-4 constant,
AdamW betas (0.9, 0.999) eps 1e-8 no weight decay, grad-norm clip 1.0, clip eps 0.2 / 0.28,
beta 0 (no reference model), one update per batch, group-std-scaled advantages with eps 1e-4,
token-level loss aggregation: rlcu loss_agg=token == TRL loss_type=dapo with one accumulation
step, the same exact-match reward function) is set identically.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
RESULTS = Path(__file__).resolve().parent / "results"


def reward_exact(prompts, completions, answer, **_):
    from rlcu.data.synthetic import exact_match_reward

    return exact_match_reward(prompts, completions, answer)


def hf_tokenizer(tok):
    """The demo's word tokenizer as a transformers tokenizer (same backend, eos/pad)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok.backend, unk_token="<unk>", eos_token=tok.eos_token,
                                   pad_token=tok.pad_token, clean_up_tokenization_spaces=False)


@torch.no_grad()
def greedy_accuracy(model_dir, rows, max_new_tokens: int) -> float:
    """Exact-match accuracy of greedy completions with transformers' generate (prompts grouped by
    length, so there is no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcu.data.synthetic import exact_match_reward

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        by_len.setdefault(len(ids), []).append((ids, r))
    ok = []
    for group in by_len.values():
        x = torch.tensor([g[0] for g in group])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(y[:, x.shape[1]:], skip_special_tokens=True)
        ok += exact_match_reward(None, texts, [g[1]["answer"] for g in group])
    return sum(ok) / len(ok)


def sft_warmup(cfg, tmp: Path):
    """The demo's SFT phase (same code path as rlcu.train.demo.run); returns (model, tok, train, held)."""
    from rlcu.config import CheckpointConfig, LogConfig, SFTConfig, _build
    from rlcu.data import synthetic as syn
    from rlcu.model.config import Qwen3Config
    from rlcu.model.qwen3 import Qwen3

    t = cfg.task
    task = {"min_len": t.min_len, "max_len": t.max_len, "distinct": t.distinct, "sloppy": t.sloppy,
            "sloppy_min_len": t.sloppy_min_len}
    tok = syn.make_tokenizer()
    train = syn.sort_rows(t.n_train, "train", seed=cfg.seed, **task)
    held = syn.sort_rows(t.n_eval, "eval", seed=cfg.seed, **task)
    qc = Qwen3Config(**{**cfg.model, "vocab_size": tok.vocab_size, "eos_token_id": tok.eos_token_id})
    model = Qwen3.from_config(qc, device="cpu", dtype=torch.float32, seed=cfg.seed)
    model.gradient_checkpointing = False
    scfg = _build(SFTConfig, {
        "steps": cfg.sft_steps, "batch_tokens": cfg.sft_batch_tokens, "seed": cfg.seed,
        "optim": {"lr": cfg.sft_lr, "warmup_steps": min(10, cfg.sft_steps), "schedule": "cosine", "min_lr_ratio": 0.1},
        "log": LogConfig(out_dir=str(tmp / "sft"), plot=False, progress=False, tensorboard=False),
        "checkpoint": CheckpointConfig(save_at_end=False)})
    from rlcu.train.sft import SFTTrainer

    SFTTrainer(scfg, train, model=model, tokenizer=tok).train()
    return model, tok, train, held


def grpo_rlcu(cfg, model, tok, train, held, steps: int, tmp: Path) -> tuple[list[float], float, float]:
    """rlcu's GRPO (trains `model` in place); returns (reward per step, held-out greedy accuracy
    before and after measured by rlcu's own engine, as a cross-check of the shared evaluator)."""
    from rlcu.config import CheckpointConfig, LogConfig, _build
    from rlcu.train.grpo import GRPOTrainer
    from rlcu.train.rl_config import GRPOConfig

    gcfg = _build(GRPOConfig, {
        "steps": steps, "prompts_per_step": cfg.prompts_per_step, "group_size": cfg.group_size,
        "max_new_tokens": cfg.task.max_len + 2, "temperature": cfg.temperature, "optim": {"lr": cfg.grpo_lr},
        "clip_low": 0.2, "clip_high": cfg.clip_high, "loss_agg": "token", "kl_coef": 0.0, "mu": 1,
        "scale_rewards": True,
        "eval_every": 0, "rewards": [{"fn": "rlcu.data.synthetic:exact_match_reward"}], "seed": cfg.seed,
        "data": {"seed": cfg.seed},
        "log": LogConfig(out_dir=str(tmp / "grpo"), plot=False, progress=False, tensorboard=False),
        "checkpoint": CheckpointConfig(save_at_end=False)})
    from rlcu.train.demo import accuracy

    trainer = GRPOTrainer(gcfg, train, tokenizer=tok, model=model)
    before = accuracy(trainer, held)
    hist = trainer.train()
    return [float(h["reward"]) for h in hist], before, accuracy(trainer, held)


def grpo_trl(cfg, sft_dir: Path, train, steps: int, tmp: Path) -> tuple[list[float], object]:
    try:
        import datasets
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"bench/learning.py needs TRL: pip install trl==1.16.0 datasets ({e})") from None
    P, G = cfg.prompts_per_step, cfg.group_size
    args = GRPOConfig(
        output_dir=str(tmp / "trl"), max_steps=steps, per_device_train_batch_size=P * G, num_generations=G,
        steps_per_generation=1, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=cfg.task.max_len + 2, temperature=cfg.temperature, top_p=1.0, top_k=0,
        learning_rate=cfg.grpo_lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        epsilon=0.2, epsilon_high=cfg.clip_high, beta=0.0, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        seed=cfg.seed, data_seed=cfg.seed, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, log_completions=False)
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train])
    model = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32)
    tr = GRPOTrainer(model=model, reward_funcs=reward_exact, args=args, train_dataset=ds,
                     processing_class=AutoTokenizer.from_pretrained(sft_dir))
    tr.train()
    rewards = [float(h["reward"]) for h in tr.state.log_history if "reward" in h]
    return rewards, tr.model


def run_seed(seed: int, steps: int) -> dict:
    from rlcu.train.demo import DemoConfig

    cfg = DemoConfig(seed=seed, progress=False)
    mnt = cfg.task.max_len + 2
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        model, tok, train, held = sft_warmup(cfg, tmp)
        sft_dir = tmp / "sft_model"
        model.save_pretrained(sft_dir)
        hf_tokenizer(tok).save_pretrained(sft_dir)
        t_sft = time.perf_counter() - t0
        before = greedy_accuracy(sft_dir, held, mnt)

        t0 = time.perf_counter()
        r_rlcu, eng_before, eng_after = grpo_rlcu(cfg, model, tok, train, held, steps, tmp)
        t_rlcu = time.perf_counter() - t0
        model.save_pretrained(tmp / "rlcu_model")
        hf_tokenizer(tok).save_pretrained(tmp / "rlcu_model")
        after_rlcu = greedy_accuracy(tmp / "rlcu_model", held, mnt)

        t0 = time.perf_counter()
        r_trl, trl_model = grpo_trl(cfg, sft_dir, train, steps, tmp)
        t_trl = time.perf_counter() - t0
        trl_model.save_pretrained(tmp / "trl_model")
        hf_tokenizer(tok).save_pretrained(tmp / "trl_model")
        after_trl = greedy_accuracy(tmp / "trl_model", held, mnt)
    res = {"seed": seed, "accuracy_before": before, "accuracy_before_rlcu_engine": eng_before,
           "rlcu": {"reward": r_rlcu, "accuracy_after": after_rlcu, "accuracy_after_rlcu_engine": eng_after,
                    "seconds": t_rlcu},
           "trl": {"reward": r_trl, "accuracy_after": after_trl, "seconds": t_trl},
           "sft_seconds": t_sft}
    print(f"seed {seed}: acc before {before:.3f} | rlcu after {after_rlcu:.3f} ({t_rlcu:.0f} s) | "
          f"(rlcu engine: {eng_before:.3f} -> {eng_after:.3f}) | trl after {after_trl:.3f} ({t_trl:.0f} s) | "
          "final reward (last 5 mean) "
          f"rlcu {_tail(r_rlcu):.3f} trl {_tail(r_trl):.3f}", flush=True)
    return res


def _tail(xs, k: int = 5) -> float:
    return sum(xs[-k:]) / len(xs[-k:])


def _mean_std(xs) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def summarize(runs: list[dict], tail: int) -> dict:
    out = {}
    for fw in ("rlcu", "trl"):
        fin = [_tail(r[fw]["reward"], tail) for r in runs]
        acc = [r[fw]["accuracy_after"] for r in runs]
        first = [_tail(r[fw]["reward"][:tail], tail) for r in runs]
        out[fw] = {"final_reward_mean": _mean_std(fin)[0], "final_reward_std": _mean_std(fin)[1],
                   "first_reward_mean": _mean_std(first)[0],
                   "accuracy_after_mean": _mean_std(acc)[0], "accuracy_after_std": _mean_std(acc)[1],
                   "seconds_mean": _mean_std([r[fw]["seconds"] for r in runs])[0]}
    acc0 = [r["accuracy_before"] for r in runs]
    out["accuracy_before_mean"], out["accuracy_before_std"] = _mean_std(acc0)
    out["final_reward"] = f"mean over the last {tail} steps of each run, then mean +- std over seeds"
    return out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for fw, color in (("rlcu", "tab:blue"), ("trl", "tab:orange")):
        curves = [r[fw]["reward"] for r in runs]
        n = min(len(c) for c in curves)
        for c in curves:
            ax.plot(range(1, len(c) + 1), c, color=color, alpha=0.25, lw=1)
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
        ax.plot(range(1, n + 1), mean, color=color, lw=2.2, label=f"{fw} (mean of {len(curves)} seeds)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean training reward (exact match, T=1)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Learning parity on the sort demo: rlcu vs TRL GRPOTrainer\n(same SFT weights per seed; "
                 "thin: per seed)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=40, help="GRPO steps (the demo's 40)")
    p.add_argument("--tail", type=int, default=5, help="final reward = mean of the last N steps")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    runs = [run_seed(s, a.steps) for s in a.seeds]
    import trl

    from rlcu.train.demo import DemoConfig

    c = DemoConfig()
    payload = {
        "task": "rlcu demo: sort 4-8 distinct digits; SFT warm-up (rlcu) on a sloppy teacher, then GRPO with an "
                "exact-match reward from the same weights in rlcu and in TRL",
        "trl_version": trl.__version__, "transformers_version": transformers.__version__,
        "steps": a.steps, "seeds": a.seeds,
        "hyper_parameters": {"prompts_per_step": c.prompts_per_step, "group_size": c.group_size,
                             "max_new_tokens": c.task.max_len + 2, "temperature": c.temperature, "lr": c.grpo_lr,
                             "lr_schedule": "constant", "clip_low": 0.2, "clip_high": c.clip_high, "beta_kl": 0.0,
                             "updates_per_batch": 1, "scale_rewards": "group std (+1e-4)",
                             "loss_agg": "rlcu token == TRL dapo", "max_grad_norm": 1.0,
                             "adamw": "betas (0.9, 0.999), eps 1e-8, weight decay 0"},
        "unmatched": ["prompt order (each framework shuffles the same training prompts with its own RNG)",
                      "sampling RNG (different completions from the same distribution)",
                      "sampler: rlcu's paged engine vs transformers generate (both T=1, no top-p/top-k)"],
        "accuracy_metric": "exact match of greedy completions (transformers generate) on the demo's 200 held-out "
                           "prompts, the same evaluator for both frameworks",
        "summary": summarize(runs, a.tail), "runs": runs, "wall_seconds": time.perf_counter() - t0,
    }
    from bench.common import meta

    payload = {"meta": meta(), **payload}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "learning.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(runs, RESULTS / "learning.png")
    s = payload["summary"]
    print(f"accuracy before GRPO {s['accuracy_before_mean']:.3f} +- {s['accuracy_before_std']:.3f}")
    for fw in ("rlcu", "trl"):
        print(f"{fw}: final reward {s[fw]['final_reward_mean']:.3f} +- {s[fw]['final_reward_std']:.3f}, "
              f"held-out accuracy after {s[fw]['accuracy_after_mean']:.3f} +- {s[fw]['accuracy_after_std']:.3f}, "
              f"{s[fw]['seconds_mean']:.0f} s/run")
    print(f"total {payload['wall_seconds']:.0f} s -> {RESULTS / 'learning.json'}, {RESULTS / 'learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
