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
`--shape 8b` (a bench/common.py SHAPES entry) takes that trunk instead (the task's vocabulary; random
bf16 weights, written once as the base): where 8 separate processes cannot all hold a base at once
and the scheduler queues them, while the host holds one.

Start-up against steady state, per mode: `step_times` holds each job's step times from its
metrics.jsonl (time/step: a hosted job's covers its round, the others' turns and the shared
generate included), the median first step and the median of the later steps (every job advancing
one step, concurrently in both modes), and `startup_s` (the makespan less the median job's summed
step times: process start, imports, builds, engine warm-up, the tail). The host adds its own
`timeline` (train/lora_host.py: the base's load, each job's build, the engine's start, each
round's turns and serve) split into `phases_s`, and its engine's graph captures and wakes (whether
its decode graphs survived each sleep or were captured again).

    python bench/lora_host.py                # the H200 run: 8 jobs x 4 steps, r = 32, ~4 minutes
    python bench/lora_host.py --ranks 16,32,64
    python bench/lora_host.py --shape 8b --jobs 8 --steps 3 --budget-s 560   # a large base
    python bench/lora_host.py --quick        # a CPU smoke run of both modes; measures nothing

JSON: $OUT and bench/results/lora_host.json (GPU runs; lora_host_<shape>.json with --shape).
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
_plain_tiny_model = sb.tiny_model


def shape_model(a) -> dict:
    """The base's Qwen3Config fields: bench/sched.py's (--hidden, --layers), or with --shape that
    SHAPES entry's trunk over the task's vocabulary (its eos/bos, positions; head_dim 128 unless the
    entry says); --quick cuts a shape to 2 layers of 64 (the path smoked, not the size)."""
    cfg = _plain_tiny_model(a)
    if a.shape is None:
        return cfg
    from bench.common import SHAPES

    if a.shape not in SHAPES:
        raise SystemExit(f"--shape {a.shape!r}: not a bench/common.py SHAPES entry ({', '.join(SHAPES)})")
    keep = {k: cfg[k] for k in ("vocab_size", "eos_token_id", "bos_token_id", "max_position_embeddings")}
    out = {**cfg, "head_dim": 128, **SHAPES[a.shape], **keep}
    if a.quick:
        out.update(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, moe_intermediate_size=32, num_experts=4)
        out = {k: v for k, v in out.items() if k in SHAPES[a.shape] or k in cfg or k == "head_dim"}
    return out


sb.tiny_model = shape_model  # the base checkpoint and both modes' configs take the shape
_BASES: dict[tuple, Path] = {}


def base_checkpoint(a) -> Path:
    """bench/sched.py's base (random weights, seed 0, in the jobs' dtype, written once before any
    clock starts), made on the device when there is one (an 8B trunk in fp32 on the host is 32 GB)."""
    import torch

    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config

    key = tuple(sorted((k, str(v)) for k, v in shape_model(a).items())) + (a.cpu,)
    if key not in _BASES:
        folder = Path(tempfile.mkdtemp(prefix="rlcu-lora-host-base-")) / "base"
        dev, dt = ("cpu", torch.float32) if a.cpu else ("cuda", torch.bfloat16)
        m = Qwen3.from_config(Qwen3Config(**shape_model(a)), device=dev, dtype=dt, seed=0)
        m.save_pretrained(folder, dtype=dt)
        del m
        if not a.cpu:
            torch.cuda.empty_cache()
        _BASES[key] = folder
    return _BASES[key]


sb.base_checkpoint = base_checkpoint


def steady(run_dirs: list[Path], makespan: float) -> dict:
    """Each job's time/step from its metrics.jsonl: the medians of the first and the later steps,
    and start-up as the makespan less the median job's summed steps (module docstring)."""
    per = []
    for d in run_dirs:
        m = d / "metrics.jsonl"
        rows = [json.loads(x) for x in m.read_text().splitlines() if x.strip()] if m.exists() else []
        per.append([r["time/step"] for r in rows if "time/step" in r])
    firsts = [s[0] for s in per if s]
    later = [t for s in per for t in s[1:]]
    sums = [sum(s) for s in per if s]
    return {"first_step_s": _median(firsts), "step_s": _median(later), "startup_s": makespan - _median(sums),
            "step_times_s": per}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def host_phases(tl: dict, makespan: float) -> dict:
    """The host's timeline as phases: what came before its constructor (process start, imports,
    the host's own), the base, the builds, the engine's start, the first round, the later rounds
    (median; each: every job's turn and the shared serve) and the last round (the final updates,
    the checkpoints)."""
    rounds = [sum(r["turns_s"].values()) + r["serve_s"] for r in tl.get("rounds", [])]
    builds = list(tl.get("builds_s", {}).values())
    known = tl.get("base_s", 0.0) + sum(builds) + tl.get("engine_start_s", 0.0) + sum(rounds)
    return {"before_host_s": makespan - known, "base_s": tl.get("base_s"), "builds_s": sum(builds),
            "build_max_s": max(builds, default=float("nan")),
            "engine_start_s": tl.get("engine_start_s"), "first_round_s": rounds[0] if rounds else float("nan"),
            "round_s": _median(rounds[1:-1]), "last_round_s": rounds[-1] if len(rounds) > 1 else float("nan"),
            "serve_s": [r["serve_s"] for r in tl.get("rounds", [])],
            "turns_s": [sum(r["turns_s"].values()) for r in tl.get("rounds", [])]}


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
            "h.engine.generate_calls, 'in_place': h.engine.in_place, 'job_status': [j.status for j in h.jobs], "
            "'timeline': h.timeline, 'graph_captures': h.engine.llm.runner.num_captures, "
            "'graph_wakes': h.engine.llm.runner.graph_wakes, 'engine_startup': h.engine.llm.startup}, "
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
    done = sum(1 for s in got.get("job_status", []) if s == 0)
    res = {"mode": "host", "complete": complete, "return_codes": [rc], "jobs": a.jobs, "jobs_done": done,
           "makespan_s": t1 - t0, "jobs_per_hour": done / max(t1 - t0, 1e-9) * 3600.0,
           "peak_mem_gib": max([m for m in nv["nvml_peak_mem_gib"] if m == m], default=float("nan")),
           "nvml_idle_frac": nv["nvml_idle_frac"], "mem_before_gib": mem_before, **got,
           "step_times": steady([work / f"job{i}" for i in range(a.jobs)], t1 - t0),
           "phases_s": host_phases(got.get("timeline", {}), t1 - t0)}
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
    ap.add_argument("--shape", default=None, help="a bench/common.py SHAPES entry (8b, 4b, ...) as the base's trunk")
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
    if sep.get("work"):
        sep["step_times"] = steady([Path(sep["work"]) / f"job{i}" for i in range(a.jobs)], sep["makespan_s"])
    for name, r in (("host", host), ("separate", sep)):
        st = {**dict.fromkeys(("startup_s", "first_step_s", "step_s"), float("nan")), **r.get("step_times", {})}
        print(f"{name}: start-up {st['startup_s']:.1f} s, first step {st['first_step_s']:.2f} s, later steps "
              f"{st['step_s']:.2f} s (median job step)", flush=True)
    print(f"host phases: {json.dumps({k: v for k, v in host.get('phases_s', {}).items() if not isinstance(v, list)})}",
          flush=True)
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
    name = f"lora_host_{a.shape}.json" if a.shape else "lora_host.json"  # a shape's run keeps the default's file
    for d in outs:
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(payload, indent=2, default=float))
    ok = host["return_codes"] == [0] and not any(sep["return_codes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
