"""`rlcu demo [--out DIR]`: a tiny Qwen3 made from scratch learns to sort digits, first by
imitation (SFT), then by reinforcement (GRPO) against a verifier.

The task (rlcu.data.synthetic, `sort`): "sort 7 2 9 4 :" -> "2 4 7 9", 4 to 8 distinct digits,
exact match. The SFT demonstrations come from a sloppy teacher: on lists of 6 or more digits
it forgets the last (largest) digit 70% of the time. The warm-up teaches the model the
format and how to sort, and its bad habit, so its held-out accuracy is partial. GRPO then
samples 8 completions per prompt, rewards exact answers only, and the held-out accuracy
(greedy decoding, prompts never seen in training) rises far above the teacher's.

Everything runs on the engine + trainers of the library (the reference twins on the CPU,
the Triton kernels on a GPU). DIR gets summary.json, demo.png (SFT loss, GRPO reward and
held-out accuracy), the logs and metrics of both phases (sft/, grpo/), the GRPO checkpoint
(checkpoints/) and the final model with its tokenizer (model/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rlcu.config import (
    CheckpointConfig,
    ConfigError,
    DemoConfig,
    GRPOConfig,
    LogConfig,
    SFTConfig,
    check_device,
    command_config,
    config_from_dict,
    config_to_dict,
)


def _parser():
    p = argparse.ArgumentParser(prog="rlcu demo", add_help=False, description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: the built-in settings)")
    p.add_argument("--out", default=None, help="output folder (the option `out`; default runs/demo)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an option, e.g. --set grpo_steps=60 (repeatable; values are YAML)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("-h", "--help", action="store_true", help="show this help, with every option and its default")
    return p


def accuracy(trainer, rows, temperature: float = 0.0, n: int = 1, seed: int = 1) -> float:
    """Exact-match accuracy of `n` completions per prompt (greedy when temperature is 0)."""
    from rlcu.data.synthetic import exact_match_reward

    samples = trainer._engine_phase(lambda: trainer.rollout(rows, n, seed=seed, temperature=temperature))
    ok = exact_match_reward(None, [s.completion_text for s in samples], [s.row["answer"] for s in samples])
    return sum(ok) / len(ok)


def _plot(out: Path, sft_hist: list[dict], grpo_hist: list[dict], before: float, after: float) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
    a.plot([r["step"] for r in sft_hist], [r["loss"] for r in sft_hist], color="tab:gray")
    a.set_title("SFT warm-up (sloppy teacher)")
    a.set_xlabel("step")
    a.set_ylabel("loss (nats / completion token)")
    a.grid(alpha=0.3)
    b.plot([r["step"] for r in grpo_hist], [r["reward"] for r in grpo_hist], label="train reward (sampled)",
           color="tab:blue", alpha=0.7)
    ev = [(0, before)] + [(r["step"], r["eval/accuracy"]) for r in grpo_hist if "eval/accuracy" in r]
    ev[-1] = (ev[-1][0], after) if ev[-1][0] == grpo_hist[-1]["step"] else ev[-1]
    b.plot([e[0] for e in ev], [e[1] for e in ev], "o-", label="held-out accuracy (greedy)", color="tab:red")
    b.set_ylim(0, 1.02)
    b.set_title("GRPO (exact-match reward)")
    b.set_xlabel("step")
    b.grid(alpha=0.3)
    b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below the axes: it covers no line
    path = out / "demo.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = summary
    t = Table(title=f"rlcu demo: sort digits, {s['model_params']:,}-parameter Qwen3 from scratch ({s['device']})")
    t.add_column("phase")
    t.add_column("steps", justify="right")
    t.add_column("seconds", justify="right")
    t.add_column("held-out accuracy (greedy)", justify="right")
    t.add_column("sampled (T=1)", justify="right")
    t.add_row("SFT warm-up", str(s["sft_steps"]), f"{s['sft_seconds']:.1f}", f"{s['accuracy_before_grpo']:.1%}",
              f"{s['sampled_accuracy_before_grpo']:.1%}")
    t.add_row("GRPO", str(s["grpo_steps"]), f"{s['grpo_seconds']:.1f}", f"{s['accuracy_after_grpo']:.1%}",
              f"{s['sampled_accuracy_after_grpo']:.1%}")
    t.add_row("gain", "", "", f"{s['accuracy_after_grpo'] - s['accuracy_before_grpo']:+.1%}",
              f"{s['sampled_accuracy_after_grpo'] - s['sampled_accuracy_before_grpo']:+.1%}")
    Console().print(t)
    print(f"total {s['wall_seconds']:.1f} s; summary, plot, logs, checkpoint and model in {s['out']}")


def run(cfg: DemoConfig) -> dict:
    """The demo; returns (and writes to cfg.out/summary.json) its summary."""
    t_start = time.perf_counter()
    import torch

    if cfg.threads or not torch.cuda.is_available():
        from rlcu.threads import apply

        apply(cfg.threads or 1)  # (and the inter-op pool to one: rlcu runs no inter-op work)
    from rlcu.data import synthetic as syn
    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config
    from rlcu.ops._backend import backend_name
    from rlcu.train.grpo import GRPOTrainer
    from rlcu.train.sft import SFTTrainer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    check_device(device, "device")  # one line, not torch's traceback, on a machine without it
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    t = cfg.task
    task = dict(min_len=t.min_len, max_len=t.max_len, distinct=t.distinct, sloppy=t.sloppy,
                sloppy_min_len=t.sloppy_min_len)
    tok = syn.make_tokenizer()
    train = syn.sort_rows(t.n_train, "train", seed=cfg.seed, **task)
    held = syn.sort_rows(t.n_eval, "eval", seed=cfg.seed, **task)
    try:
        qc = Qwen3Config(**{**cfg.model, "vocab_size": tok.vocab_size, "eos_token_id": tok.eos_token_id})
    except (TypeError, ValueError) as e:
        raise ConfigError("model", f"is not a valid Qwen3Config: {e}") from None
    model = Qwen3.from_config(qc, device=device, dtype=dtype, seed=cfg.seed)
    model.gradient_checkpointing = False  # tiny activations: recomputing them only costs time
    import importlib.util

    # event files when the tensorboard extra is installed (a bare install gets no warning for them);
    # a demo always starts afresh
    log = dict(progress=cfg.progress, every=1, tensorboard=importlib.util.find_spec("tensorboard") is not None,
               overwrite=True)

    # 1. SFT warm-up on the sloppy demonstrations
    t0 = time.perf_counter()
    scfg = config_from_dict(SFTConfig, dict(
        steps=cfg.sft_steps, batch_tokens=cfg.sft_batch_tokens, seed=cfg.seed,
        optim=dict(lr=cfg.sft_lr, warmup_steps=min(10, cfg.sft_steps), schedule="cosine", min_lr_ratio=0.1),
        log=LogConfig(out_dir=str(out / "sft"), plot=False, **log), checkpoint=CheckpointConfig(save_at_end=False)))
    sft = SFTTrainer(scfg, train, model=model, tokenizer=tok)
    sft.train()
    sft_hist = list(sft.logger.history)
    t_sft = time.perf_counter() - t0

    # 2. GRPO against the exact-match verifier
    gcfg = config_from_dict(GRPOConfig, dict(
        steps=cfg.grpo_steps, prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size,
        max_new_tokens=t.max_len + 2, temperature=cfg.temperature, optim=dict(lr=cfg.grpo_lr), clip_low=0.2,
        clip_high=cfg.clip_high, loss_agg="token", eval_every=cfg.eval_every, eval_max_prompts=t.n_eval,
        rewards=[{"fn": "rlcu.data.synthetic:exact_match_reward"}], seed=cfg.seed, data=dict(seed=cfg.seed),
        log=LogConfig(out_dir=str(out / "grpo"), plot_keys=["reward", "eval/accuracy"], **log),
        checkpoint=CheckpointConfig(dir=str(out / "checkpoints"), keep_last=1)))
    grpo = GRPOTrainer(gcfg, train, tokenizer=tok, model=model, eval_dataset=held)
    t0 = time.perf_counter()
    before = accuracy(grpo, held)
    before_s = accuracy(grpo, held, temperature=cfg.temperature, n=4)
    t_eval = time.perf_counter() - t0
    t0 = time.perf_counter()
    hist = [h for h in grpo.train() if h["step"] > 0]  # step 0 is the trainer's baseline evaluation
    t_grpo = time.perf_counter() - t0
    t0 = time.perf_counter()
    after = accuracy(grpo, held)
    after_s = accuracy(grpo, held, temperature=cfg.temperature, n=4)
    t_eval += time.perf_counter() - t0

    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    plot = _plot(out, sft_hist, hist, before, after)
    ckpt = sorted((out / "checkpoints").glob("step-*"))

    summary = {
        "task": f"sort {t.min_len}-{t.max_len} {'distinct ' if t.distinct else ''}digits; SFT on a sloppy teacher "
                f"(drops the largest digit of {t.sloppy_min_len}+ digit lists {t.sloppy:.0%} of the time), then "
                f"GRPO with an exact-match reward",
        "accuracy_before_grpo": before, "accuracy_after_grpo": after,
        "sampled_accuracy_before_grpo": before_s, "sampled_accuracy_after_grpo": after_s,
        "accuracy_metric": f"exact match of greedy completions of {len(held)} held-out prompts "
                           f"(sampled: 4 completions per prompt at temperature {cfg.temperature})",
        "wall_seconds": time.perf_counter() - t_start, "sft_seconds": t_sft, "grpo_seconds": t_grpo,
        "eval_seconds": t_eval, "sft_steps": cfg.sft_steps, "grpo_steps": cfg.grpo_steps,
        "grpo_reward_first": hist[0]["reward"], "grpo_reward_last": hist[-1]["reward"],
        "device": str(model.device), "backend": backend_name(model.device), "threads": torch.get_num_threads(),
        "model_params": model.num_params(), "config": config_to_dict(cfg),
        "out": str(out), "plot": str(plot) if plot else None, "checkpoint": str(ckpt[-1]) if ckpt else None,
        "model_dir": str(out / "model"),
        "logs": {"sft": str(out / "sft" / "metrics.jsonl"), "grpo": str(out / "grpo" / "metrics.jsonl")},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        argv = argv[1:]
    p = _parser()
    a = p.parse_args(argv)
    overrides = list(a.overrides)
    if a.out is not None:
        overrides.append(f"out={a.out}")
    if a.no_progress:
        overrides.append("progress=false")
    cfg = command_config(DemoConfig, p, a, overrides)
    if isinstance(cfg, int):
        return cfg
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        summary = run(cfg)
    except ConfigError as e:
        print(f"rlcu demo: {e}", file=sys.stderr)
        return 2
    _table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
