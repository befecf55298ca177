"""Many LoRA jobs on one base (issue 35): N LoRA GRPO jobs in ONE LoRA host process (one copy of
the base, one engine whose steps carry every job's sequences, updates in turns: `rlcu grpo
a.yaml b.yaml ...`) against the same N jobs as separate processes under the phase-aware
scheduler on the same GPU (bench/sched.py's `procs` mode: each process loads the base, builds
its engine and registers its own job). Both from the launch of the processes to the last job's end.

Per run: makespan, jobs per hour (N / makespan), peak device memory (NVML, the device's memory in
use), the return codes; the host's own engine steps and whether it read the adapters in place
(every job the same rank: the jobs' adapters are the rows of one slab) or copied them each
generate call (ranks that differ). Target: the host's jobs/h >= 2x the separate processes'.

The job: the synthetic sort task (its word tokenizer), a base with bench/sched.py's shape
(`--hidden 1024 --layers 28`: Qwen3-0.6B's trunk, 16 heads of 64, intermediate 3072, with the
task's small vocabulary) written once as a bf16 checkpoint, LoRA on all linear modules with
ranks `--ranks` (cycled over the jobs), each job its own adapter seed, data order and sampling
seed. One untimed job of 2 steps runs first (Triton's kernel cache on disk filled for both).

    python bench/lora_host.py                # the H200 run: 8 jobs x 4 steps, r = 32, ~4 minutes
    python bench/lora_host.py --ranks 16,32,64
    python bench/lora_host.py --quick        # a CPU smoke run of both modes; measures nothing

JSON: $OUT and bench/results/lora_host.json (GPU runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench import sched as sb  # noqa: E402  (after the path set-up)


def lora_job_config(i: int, a, work: Path, tok_dir: Path, data: Path, eager: bool, steps: int | None = None) -> Path:
    """bench/sched.py's job config with a `lora:` section (rank a.ranks[i mod len], alpha 2 r, seed i)."""
    import yaml

    p = _plain_job_config(i, a, work, tok_dir, data, eager, steps)
    cfg = yaml.safe_load(p.read_text())
    r = a.rank_list[i % len(a.rank_list)]
    cfg["lora"] = {"r": r, "alpha": 2 * r, "seed": i}
    cfg["optim"] = {"lr": 1e-4}
    p.write_text(yaml.safe_dump(cfg))
    return p


_plain_job_config = sb.job_config
sb.job_config = lora_job_config  # run_one (the separate processes) writes LoRA jobs too


def run_host(a, sampler, deadline: float) -> dict:
    """The N jobs as one `rlcu grpo c0.yaml ... cN.yaml` process; its makespan and NVML peak."""
    from rlcu.data.synthetic import make_tokenizer, sort_rows

    work = Path(tempfile.mkdtemp(prefix="rlcu-lora-host-"))
    tok_dir = work / "tok"
    make_tokenizer().save_pretrained(tok_dir)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sort_rows(512, seed=0)))
    cfgs = [str(lora_job_config(i, a, work, tok_dir, data, a.eager)) for i in range(a.jobs)]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(ROOT / "src"), os.environ.get("PYTHONPATH")] if p))
    if a.cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    code = ("import sys, json; from rlcu.train.lora_host import LoraHost; h = LoraHost(sys.argv[2:]); h.train(); "
            "json.dump({'status': h.status, 'engine_steps': h.engine.engine_steps, 'generate_calls': "
            "h.engine.generate_calls, 'in_place': h.engine.in_place, 'jobs': [j.status for j in h.jobs]}, "
            "open(sys.argv[1], 'w'))")
    mem_before = sampler.mem_now()
    t0 = time.time()
    with open(work / "host.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-c", code, str(work / "host.json"), *cfgs], env=env, stdout=log,
                             stderr=subprocess.STDOUT)
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
            complete = True
        except subprocess.TimeoutExpired:
            sb._stop([p])
            rc, complete = p.returncode, False
    t1 = time.time()
    got = json.loads((work / "host.json").read_text()) if (work / "host.json").exists() else {}
    nv = sampler.window(t0, t1)
    done = sum(1 for s in got.get("jobs", []) if s == 0)
    res = {"mode": "host", "complete": complete, "return_codes": [rc], "jobs": a.jobs, "jobs_done": done,
           "makespan_s": t1 - t0, "jobs_per_hour": done / max(t1 - t0, 1e-9) * 3600.0,
           "peak_mem_gib": max([m for m in nv["nvml_peak_mem_gib"] if m == m], default=float("nan")),
           "nvml_idle_frac": nv["nvml_idle_frac"], "mem_before_gib": mem_before, **got}
    if rc or not complete:
        res["log"] = (work / "host.log").read_text(errors="replace")[-3000:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--ranks", default="32", help="LoRA ranks, cycled over the jobs (e.g. 16,32,64)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs in either mode")
    ap.add_argument("--budget-s", type=float, default=230.0, help="the whole call's wall-clock bound")
    ap.add_argument("--quick", action="store_true", help="a CPU smoke run of both modes (measures nothing)")
    a = ap.parse_args()
    a.rank_list = [int(r) for r in a.ranks.split(",")]
    a.cpu, a.init, a.gpus = a.quick, "checkpoint", "0"
    if a.quick:
        a.jobs, a.steps, a.prompts, a.group, a.new_tokens, a.hidden, a.layers = 3, 2, 2, 2, 4, 64, 2
        a.rank_list = [4, 8, 4]
    import torch

    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device: use --quick for a CPU smoke run")
    t_start = time.time()
    deadline = t_start + a.budget_s
    caps = [64.0] if a.cpu else [torch.cuda.get_device_properties(0).total_memory / sb.GiB * 0.92]
    sampler = sb.GpuSampler([0], None if a.cpu else sb.cuda_uuids([0]), enabled=not a.cpu)
    sampler.start()
    print(f"{a.jobs} LoRA jobs (r {a.ranks if not a.quick else a.rank_list}) x {a.steps} steps, hidden {a.hidden}, "
          f"{a.layers} layers, {a.prompts}x{a.group} samples of {a.new_tokens} tokens", flush=True)
    warm = sb.run_one("fifo", "procs", a, [0], caps, sampler, t_start + 0.25 * a.budget_s, jobs=1,
                      steps=min(2, a.steps), tag="warm-up")
    print(f"warm-up: rc {warm['return_codes']} ({time.time() - t_start:.0f} s)", flush=True)
    left = deadline - time.time()
    host = run_host(a, sampler, time.time() + 0.4 * left)
    print(f"host: {host['jobs_done']}/{a.jobs} jobs in {host['makespan_s']:.1f} s, jobs/h {host['jobs_per_hour']:.1f}, "
          f"peak {host['peak_mem_gib']:.1f} GiB, engine steps {host.get('engine_steps')}, in place "
          f"{host.get('in_place')}, rc {host['return_codes']}", flush=True)
    sep = sb.run_one("phase", "procs", a, [0], caps, sampler, deadline)
    print(f"separate processes under the scheduler: {sep['jobs_done']}/{a.jobs} jobs in {sep['makespan_s']:.1f} s, "
          f"jobs/h {sep['jobs_per_hour']:.1f}, peak {sep['peak_mem_gib']:.1f} GiB, rc {sep['return_codes']}",
          flush=True)
    sampler.stop.set()
    sampler.join(timeout=5)
    sep = {k: v for k, v in sep.items() if k not in ("spans", "gpu_samples")}
    ratio = host["jobs_per_hour"] / sep["jobs_per_hour"] if sep.get("jobs_per_hour") else float("nan")
    from bench.common import RESULTS, meta

    payload = {"meta": meta(), "args": {k: v for k, v in vars(a).items()}, "wall_s": time.time() - t_start,
               "host": host, "separate_sched": sep, "jobs_per_hour_ratio": ratio,
               "target_2x_jobs_per_hour": ratio >= 2.0, "peak_mem_ratio": host["peak_mem_gib"] / sep["peak_mem_gib"]
               if sep.get("peak_mem_gib") else float("nan")}
    print(f"jobs/h host / separate: {ratio:.2f}x", flush=True)
    outs = [Path(os.environ["OUT"])] if os.environ.get("OUT") else []
    if not a.cpu:
        outs.append(RESULTS)
    for d in outs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "lora_host.json").write_text(json.dumps(payload, indent=2, default=float))
    ok = host["return_codes"] == [0] and not any(sep["return_codes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
