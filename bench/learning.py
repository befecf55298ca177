"""Learning parity (BENCHMARKS.md section 5): does rlcu learn as well as TRL, in each of its
old-policy modes, and does exact on-policy mode learn at least as well as the others?

Protocol, per task and seed: rlcu's SFT warm-up from seeded random weights, saved as an HF folder
with a transformers tokenizer; then GRPO from those same weights in every mode:
    default    old logprobs = the engine's sampling logprobs (the ratio carries the mismatch)
    tis        old logprobs recomputed by the trainer, truncated importance weights min(rho, 2)
    recompute  old logprobs recomputed by the trainer, no correction
    exact      `exact: true`: engine logprobs equal the trainer's bit for bit
    trl        TRL's GRPOTrainer (transformers generate; with one update per batch its old
               logprobs are its own forward's, so it is the analogue of `recompute`)
Each run is a process of its own (bench/learning_worker.py; exact mode is process-wide), several
at once on one device (--jobs). Tasks (bench/learning_tasks.py): `demo` (sort 4-8 digits,
completions of 5-9 tokens) and `long` (sort 24-40 numbers, completions of 24-41 tokens, where a
sequence's log-ratio sums ~5x as many per-token mismatches). Recorded per run: the training reward
per step, rlcu's mismatch metrics per step (metrics.jsonl: mismatch/abs_mean, exact_frac, kl_k3,
ratio_p01/p99, seq_abs_sum; None for TRL, which logs none without vLLM), and the held-out greedy
accuracy before and after by one evaluator (transformers greedy generate on the saved folders, the
weights in the run's dtype), so every arm is scored identically.

Matched in every arm: the SFT weights of the seed, the prompts, prompts/step 16, group 8, max new
tokens = longest answer + 2, T = 1.0 with no top-p/top-k, stop at <|im_end|>, lr 2e-4 constant,
AdamW (0.9, 0.999) eps 1e-8 no weight decay, grad-norm clip 1.0, clip 0.2 / 0.28, no KL, one
update per batch, group-std-scaled advantages, token-level loss (rlcu loss_agg=token == TRL
loss_type=dapo), the exact-match reward; precision: bf16 compute with fp32 master weights (TRL:
fp32 weights under bf16 autocast) on cuda, fp32 on the cpu.
Unmatched (in the JSON under "unmatched"): each framework's prompt shuffle and sampling RNG; the
sampler (rlcu's paged engine vs transformers generate, which in TRL runs outside the autocast, so
with bf16 TRL samples from its fp32 weights and trains in bf16).

    pip install trl==1.16.0 datasets           # bench-only, never a dependency of rlcu
    python bench/learning.py --deadline 300     # the GPU run (one H200): 2 tasks x 3 seeds x 5 arms
    python bench/learning.py --quick --out DIR  # CPU smoke run: 1 seed, 2 steps, small warm-ups
    python bench/learning.py --replot DIR/learning.json --out DIR   # summary + figure again

The GPU run: 6 SFT warm-ups (all at once), then 30 GRPO runs of 40 steps, 12 at a time (--jobs),
1 CPU thread each (16 cores). The tiny model is launch-bound on a GPU, so side-by-side runs share
it well; a run is ~20 s of process start (imports, CUDA context, Triton cache, CUDA graphs) plus
40 steps of a fraction of a second plus its evaluations. learning.json (meta, per-run curves, a
summary per task and mode) is rewritten after every finished run and learning.png drawn at the
end, in --out (default bench/results/) and $OUT when set. --deadline S: no run starts after S
seconds (those left are listed under "skipped"); runs start in seed order, so a cut drops the
last seed's runs first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("default", "tis", "recompute", "exact", "trl")
QUICK = {"demo": {"sft_steps": 30, "n_train": 800, "n_eval": 48},
         "long": {"sft_steps": 80, "n_train": 800, "n_eval": 32}}


def _job(kind, task, seed, mode, a, d: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.learning_worker", kind, "--task", task, "--seed", str(seed), "--dir", str(d),
           "--mode", mode, "--steps", str(a.steps), "--device", a.device, "--dtype", a.dtype,
           "--scale", json.dumps(QUICK[task] if a.quick else {})] + (["--no-engine-eval"] if a.quick else [])
    # offline: every model is a local folder, and a machine without a network must not wait on the hub
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **os.environ, "OMP_NUM_THREADS": str(a.threads),
           "MKL_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    return {"kind": kind, "task": task, "seed": seed, "mode": mode if kind == "grpo" else "sft", "dir": d,
            "cmd": cmd, "env": env}


def run_all(a, work: Path, on_done=None) -> tuple[list[dict], list[dict], list[dict]]:
    """Every job, `a.jobs` at a time; a (task, seed)'s GRPO runs start once its SFT is done.
    Order: by seed, then task, then arm, so that a deadline cuts whole seeds last. on_done(sfts,
    runs, skipped) after each finished job."""
    root = Path(__file__).resolve().parent.parent
    ready = [_job("sft", t, s, "default", a, work / f"{t}_{s}") for s in a.seeds for t in a.tasks]
    waiting = {(j["task"], j["seed"]): [_job("grpo", j["task"], j["seed"], m, a, j["dir"]) for m in a.modes]
               for j in ready}
    order = {(s, t): i for i, (s, t) in enumerate((s, t) for s in a.seeds for t in a.tasks)}
    running, done, skipped = [], [], []
    total = len(ready) + sum(len(v) for v in waiting.values())
    t0 = time.perf_counter()
    while ready or running:
        while ready and len(running) < a.jobs:
            j = ready.pop(0)
            if time.perf_counter() - t0 > a.deadline:
                skipped.append({k: j[k] for k in ("kind", "task", "seed", "mode")})
                skipped += [{k: g[k] for k in ("kind", "task", "seed", "mode")}
                            for g in waiting.pop((j["task"], j["seed"]), [])] if j["kind"] == "sft" else []
                continue
            j["dir"].mkdir(parents=True, exist_ok=True)
            j["log"] = open(j["dir"] / f"{j['mode']}.log", "w")
            j["proc"] = subprocess.Popen(j["cmd"], env=j["env"], cwd=root, stdout=j["log"], stderr=subprocess.STDOUT)
            j["t0"] = time.perf_counter()
            running.append(j)
        time.sleep(0.2)
        for j in [j for j in running if j["proc"].poll() is not None]:
            running.remove(j)
            j["log"].close()
            res = _finish(j, len(done) + 1, total, time.perf_counter() - t0)
            done.append(res)
            if j["kind"] == "sft":
                kids = waiting.pop((j["task"], j["seed"]), [])
                if "error" in res:
                    skipped += [{k: g[k] for k in ("kind", "task", "seed", "mode")} for g in kids]
                    kids = []
                ready += kids
                ready.sort(key=lambda g: (order[(g["seed"], g["task"])], g["kind"] != "sft"))
            if on_done:
                on_done(*_split(done), skipped)
    return (*_split(done), skipped)


def _split(done):
    return [r for r in done if r["mode"] == "sft"], [r for r in done if r["mode"] != "sft"]


def _finish(j, i: int, total: int, elapsed: float) -> dict:
    secs = time.perf_counter() - j["t0"]
    out = j["dir"] / f"{j['mode']}.json"
    head = f"[{i}/{total} {elapsed:.0f} s] {j['task']} seed {j['seed']} {j['mode']}"
    if j["proc"].returncode != 0 or not out.exists():
        tail = (j["dir"] / f"{j['mode']}.log").read_text().splitlines()[-15:]
        print(f"{head}: FAILED (exit {j['proc'].returncode}, {secs:.0f} s)\n    " + "\n    ".join(tail), flush=True)
        return {"task": j["task"], "seed": j["seed"], "mode": j["mode"], "error": "\n".join(tail)}
    r = json.loads(out.read_text())
    r["process_seconds"] = secs
    if j["mode"] == "sft":
        print(f"{head}: held-out accuracy {r['accuracy_before']:.3f} ({secs:.0f} s)", flush=True)
    else:
        am = _mean((r.get("mismatch") or {}).get("mismatch/abs_mean", []))
        mm = "" if math.isnan(am) else f", mismatch {am:.2e}"
        print(f"{head}: reward {_tail(r['reward'][:5]):.3f} -> {_tail(r['reward']):.3f}, accuracy after "
              f"{r['accuracy_after']:.3f}{mm} ({r['seconds']:.0f} s GRPO, {secs:.0f} s process)", flush=True)
    return r


def _tail(xs, k: int = 5) -> float:
    xs = list(xs)[-k:]
    return sum(xs) / len(xs) if xs else float("nan")


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def _mean_std(xs) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def summarize(sfts, runs, tasks, modes, tail: int) -> dict:
    out = {}
    for t in tasks:
        s = {"accuracy_before": _mean_std([r["accuracy_before"] for r in sfts if r["task"] == t and "error" not in r])}
        for m in modes:
            rs = [r for r in runs if r["task"] == t and r["mode"] == m and "error" not in r]
            if not rs:
                continue
            mm = {k: _mean_std([_mean((r.get("mismatch") or {}).get(k, [])) for r in rs])[0]
                  for k in ("mismatch/abs_mean", "mismatch/exact_frac", "mismatch/kl_k3", "mismatch/seq_abs_sum")}
            s[m] = {"seeds": len(rs), "final_reward": _mean_std([_tail(r["reward"], tail) for r in rs]),
                    "first_reward": _mean_std([_tail(r["reward"][:tail], tail) for r in rs]),
                    "accuracy_after": _mean_std([r["accuracy_after"] for r in rs]),
                    "completion_len": _mean([_mean(r.get("completion_len", [])) for r in rs]),
                    **{k + "_mean": (None if math.isnan(v) else v) for k, v in mm.items()},
                    "seconds": _mean([r["seconds"] for r in rs])}
        out[t] = s
    out["legend"] = (f"(mean, std) over seeds; final_reward: mean of a run's last {tail} steps, first_reward: of its "
                     "first; mismatch/*_mean: mean over a run's steps, then over seeds (None for TRL)")
    return out


def _args(argv):
    from bench.learning_tasks import TASKS
    from bench.learning_worker import DTYPES
    from rlcu.config import ConfigError, check_device

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--modes", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default 40; --quick: 2)")
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, choices=tuple(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--jobs", type=int, default=None, help="runs at once (default 12 on cuda, the cores on cpu)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    p.add_argument("--deadline", type=float, default=math.inf, help="start no run after this many seconds")
    p.add_argument("--tail", type=int, default=5, help="final reward = mean of the last N steps")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: 1 seed, 2 steps, small warm-ups")
    p.add_argument("--out", default=str(RESULTS), help="folder of learning.json and learning.png")
    p.add_argument("--replot", default=None, metavar="JSON", help="only the summary and figure of a learning.json")
    p.add_argument("--keep", action="store_true", help="keep the runs' folders (models, logs, metrics)")
    a = p.parse_args(argv)
    try:  # one line, not torch's traceback, for a device this machine lacks
        check_device(a.device, "--device")
    except ConfigError as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        sys.exit(2)
    a.seeds = a.seeds or ([0] if a.quick else [0, 1, 2])
    a.steps = a.steps or (2 if a.quick else 40)
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    a.jobs = a.jobs or (12 if a.device == "cuda" else os.cpu_count() or 1)
    return a


def payload(a, sfts, runs, skipped, seconds: float) -> dict:
    from bench.common import meta
    from bench.learning_tasks import get
    from bench.learning_worker import HYPER, MODES

    return {
        "meta": meta(), "device": a.device, "dtype": a.dtype, "steps": a.steps, "seeds": a.seeds, "quick": a.quick,
        "tasks_run": a.tasks, "modes_run": a.modes, "tail": a.tail, "jobs": a.jobs, "threads_per_run": a.threads,
        "versions": _versions(),
        "tasks": {t: {"about": get(t).about, "max_new_tokens": get(t).max_new_tokens, "sft_steps": get(t).sft_steps,
                      "model": get(t).model} for t in a.tasks},
        "modes": {**{m: MODES[m] for m in a.modes if m in MODES}, **({"trl": "TRL GRPOTrainer"} if "trl" in a.modes
                                                                     else {})},
        "hyper_parameters": {**HYPER, "lr_schedule": "constant", "beta_kl": 0.0, "updates_per_batch": 1,
                             "scale_rewards": "group std", "loss_agg": "rlcu token == TRL dapo", "max_grad_norm": 1.0,
                             "adamw": "betas (0.9, 0.999), eps 1e-8, weight decay 0"},
        "unmatched": ["prompt order (each framework shuffles the same training prompts with its own RNG)",
                      "sampling RNG (different completions from the same distribution)",
                      "sampler: rlcu's paged engine vs transformers generate (both T=1, no top-p/top-k); TRL "
                      "generates outside its bf16 autocast, i.e. from its fp32 weights",
                      "TRL's mismatch: not measured (it logs the sampler/trainer comparison only with vLLM)"],
        "accuracy_metric": "exact match of greedy completions (transformers generate, weights in the run's dtype) "
                           "on the task's held-out prompts, the same evaluator for every arm",
        "summary": summarize(sfts, runs, a.tasks, a.modes, a.tail), "sft": sfts, "runs": runs,
        "skipped": skipped,
        "failed": [{k: r[k] for k in ("task", "seed", "mode")} for r in sfts + runs if "error" in r],
        "wall_seconds": seconds,
    }


def _outs(a) -> list[Path]:
    return [Path(a.out)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])


def write(a, p: dict, figure: bool = True) -> None:
    """learning.json (and learning.png) to --out and $OUT."""
    from bench.learning_plot import plot

    title = (f"GRPO from the same SFT weights: rlcu's modes and TRL, {p['device']} {p['dtype']}, "
             f"{len(p['seeds'])} seed(s), {p['steps']} steps ({p['meta']['device']}, rlcu {p['meta']['commit']})")
    ok = [r for r in p["runs"] if "error" not in r]
    for o in _outs(a):
        o.mkdir(parents=True, exist_ok=True)
        (o / "learning.json").write_text(json.dumps(p, indent=1) + "\n")
        if figure:
            plot(ok, [r for r in p["sft"] if "error" not in r], p["tasks_run"], p["modes_run"], title,
                 o / "learning.png")


def replot(a) -> int:
    """--replot JSON: the summary and the figure again from a learning.json (e.g. one written
    run by run by a command that was stopped)."""
    p = json.loads(Path(a.replot).read_text())
    p["summary"] = summarize(p["sft"], p["runs"], p["tasks_run"], p["modes_run"], p["tail"])
    write(a, p)
    _print_summary(p["summary"], p["tasks_run"], p["modes_run"])
    return 0


def main(argv=None) -> int:
    a = _args(argv)
    if a.replot:
        return replot(a)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="rlcu-learning-"))
    print(f"{len(a.tasks)} tasks x {len(a.seeds)} seeds: {len(a.tasks) * len(a.seeds)} SFT warm-ups, "
          f"{len(a.tasks) * len(a.seeds) * len(a.modes)} GRPO runs of {a.steps} steps on {a.device} ({a.dtype}), "
          f"{a.jobs} at a time; runs in {work}", flush=True)

    def partial(sfts, runs, skipped):  # learning.json after every run, so a stopped command leaves its results
        write(a, payload(a, sfts, runs, skipped, time.perf_counter() - t0), figure=False)

    sfts, runs, skipped = run_all(a, work, partial)
    p = payload(a, sfts, runs, skipped, time.perf_counter() - t0)
    write(a, p)
    failed = p["failed"]
    _print_summary(p["summary"], a.tasks, a.modes)
    print(f"total {p['wall_seconds']:.0f} s -> {_outs(a)[0] / 'learning.json'}, {_outs(a)[0] / 'learning.png'}"
          + (f"; {len(skipped)} skipped (deadline)" if skipped else "") + (f"; {len(failed)} FAILED" if failed else ""))
    if a.keep or failed:
        print(f"run folders kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("transformers", "trl", "accelerate", "datasets"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def _print_summary(s, tasks, modes) -> None:
    for t in tasks:
        b = s[t]["accuracy_before"]
        print(f"{t}: held-out accuracy before GRPO {b[0]:.3f} +- {b[1]:.3f}")
        for m in modes:
            if m not in s[t]:
                continue
            r = s[t][m]
            am, ef = r["mismatch/abs_mean_mean"], r["mismatch/exact_frac_mean"]
            mm = "" if am is None else f", mismatch |d| {am:.2e}, bit-equal {ef:.1%}"
            print(f"  {m:9s}: reward {r['first_reward'][0]:.3f} -> {r['final_reward'][0]:.3f} +- "
                  f"{r['final_reward'][1]:.3f}, accuracy after {r['accuracy_after'][0]:.3f} +- "
                  f"{r['accuracy_after'][1]:.3f}{mm}, {r['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
