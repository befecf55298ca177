"""Scheduler benchmark (issue 6): N small GRPO jobs on the GPU(s), FIFO-exclusive (one job
at a time) against phase-aware sharing, with the jobs as separate processes (`procs`) or as
threads of one worker process, each on its own CUDA stream (`streams`).

Per run: makespan, jobs per hour, mean job latency (from launch), the GPU idle fraction
from NVML (1 - utilization.gpu, the share of time a kernel runs, sampled every 50 ms, over
the span from the first lease to the last finish), the scheduler's own lease-based idle
fraction, peak device memory (NVML), yields; a timeline PNG with every lease and the NVML
utilization under it. JSON in $OUT and bench/results/sched.json (runs of an earlier call
with the same device are kept, so the modes can be measured in separate calls).

    python bench/sched.py [--modes procs,streams] [--policies fifo,phase] [--jobs 4] [--steps 6]
                          [--gpus all] [--hidden 512 --layers 8 --new-tokens 128] [--eager]

The streams mode always runs the engine eagerly: capturing a CUDA graph while other threads
of the process launch kernels is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

COLORS = {"init": "#999999", "rollout": "#4c72b0", "old_logprobs": "#8172b2", "ref_logprobs": "#dd8452",
          "values": "#937860", "critic_train": "#da8bc3", "actor_train": "#c44e52"}


# ---------------------------------------------------------------------- jobs
def job_config(i: int, a, work: Path, tok_dir: Path, data: Path, eager: bool) -> Path:
    import yaml

    from rlcu.data.synthetic import make_tokenizer

    tok = make_tokenizer()
    heads = max(2, a.hidden // 64)
    cfg = {
        "model": {"tiny": {"vocab_size": tok.vocab_size, "hidden_size": a.hidden, "intermediate_size": 3 * a.hidden,
                           "num_hidden_layers": a.layers, "num_attention_heads": heads,
                           "num_key_value_heads": max(1, heads // 2), "head_dim": 64,
                           "max_position_embeddings": 64 + a.new_tokens, "eos_token_id": tok.eos_token_id,
                           "bos_token_id": None},
                  "init_seed": i, "tokenizer": str(tok_dir), "device": "cpu" if a.cpu else "cuda",
                  "dtype": "float32" if a.cpu else "bfloat16"},
        "data": {"path": str(data), "seed": i},
        "rewards": [{"fn": "rlcu.data.synthetic:partial_match_reward"}],
        "steps": a.steps, "prompts_per_step": a.prompts, "group_size": a.group, "max_new_tokens": a.new_tokens,
        "stop_at_eos": False, "temperature": 1.0, "chat_template": False, "seed": i, "kl_coef": 0.0,
        "engine": {"enforce_eager": eager, "max_num_seqs": a.prompts * a.group},
        "log": {"out_dir": str(work / f"job{i}"), "tensorboard": False, "plot": False, "progress": False},
        "checkpoint": {"save_at_end": False},
    }
    p = work / f"job{i}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def job_mem(cfg_path: Path, procs: bool) -> dict:
    """Estimated GiB per phase with a margin; a process's CUDA context counts as resident."""
    from rlcu.config import load_config
    from rlcu.sched.job import job_memory
    from rlcu.train.rl_config import GRPOConfig

    _, mem = job_memory(load_config(GRPOConfig, cfg_path))
    mem = {k: max(1.0, 1.5 * v) for k, v in mem.items()}
    if procs:
        mem["resident"] += 0.75
    return mem


def worker(addr: str, cfgs: list[str], mem: dict) -> int:
    """The streams mode's one process: a thread per job, each on its own CUDA stream."""
    import torch

    from rlcu.sched.job import ScheduledGRPO, run_grpo

    class StreamGRPO(ScheduledGRPO):
        def _use_device(self, lease):
            super()._use_device(lease)
            if torch.cuda.is_available():
                self._stream_ctx = torch.cuda.stream(torch.cuda.Stream())
                self._stream_ctx.__enter__()  # this thread's current stream from now on

    errors = []

    def one(i: int, path: str) -> None:
        try:
            run_grpo(path, addr, f"job{i}", mem=mem, trainer_cls=StreamGRPO)
        except BaseException as e:  # noqa: BLE001
            errors.append(f"job{i}: {e!r}")

    ts = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(cfgs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


# ---------------------------------------------------------------------- measurement
class Nvml(threading.Thread):
    def __init__(self, indices: list[int], every: float = 0.05, enabled: bool = True):
        super().__init__(daemon=True)
        self.every, self.samples, self.stop, self.handles = every, [], threading.Event(), []
        if not enabled:  # the CPU smoke run
            return
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]

    def run(self):
        while not self.stop.wait(self.every):
            t = time.time()
            for d, h in enumerate(self.handles):
                u = self.nv.nvmlDeviceGetUtilizationRates(h).gpu
                m = self.nv.nvmlDeviceGetMemoryInfo(h).used / (1 << 30)
                self.samples.append((t, d, u, m))

    def idle(self, t0: float, t1: float) -> float:
        us = [u for t, _, u, _ in self.samples if t0 <= t <= t1]
        return 1.0 - sum(us) / (100.0 * len(us)) if us else float("nan")

    def peak_mem(self, t0: float, t1: float) -> list[float]:
        out = [0.0] * len(self.handles) if self.handles else [float("nan")]
        for t, d, _, m in self.samples:
            if t0 <= t <= t1:
                out[d] = max(out[d], m)
        return out


def run_one(policy: str, mode: str, a, gpus: list[int], caps: list[float]) -> dict:
    from rlcu.data.synthetic import make_tokenizer, sort_rows
    from rlcu.sched import metrics as mx
    from rlcu.sched.core import Core
    from rlcu.sched.server import SchedServer

    work = Path(tempfile.mkdtemp(prefix=f"rlcu-sched-{policy}-{mode}-"))
    tok_dir = work / "tok"
    make_tokenizer().save_pretrained(tok_dir)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sort_rows(512, seed=0)))
    eager = a.eager or mode == "streams"
    cfgs = [job_config(i, a, work, tok_dir, data, eager) for i in range(a.jobs)]
    mem = job_mem(cfgs[0], mode == "procs")
    core = Core(caps, state=work / "sched.db", policy=policy, heartbeat_timeout=300.0,
                device_names=[f"cpu{g}" if a.cpu else f"cuda:{g}" for g in gpus])
    srv = SchedServer(core, f"unix:{work / 's.sock'}", "bench").start()
    env = dict(os.environ, RLCU_SCHED_TOKEN="bench", PYTHONPATH=f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}")
    mem_args = [f"--mem={k}={v}" for k, v in mem.items()]
    nv = Nvml(gpus, enabled=not a.cpu)
    nv.start()
    t_launch = time.time()
    if mode == "procs":
        procs = [subprocess.Popen([sys.executable, "-m", "rlcu.sched.job", "--config", str(c), "--addr", srv.address,
                                   "--name", f"job{i}", *mem_args], env=env,
                                  stdout=open(work / f"job{i}.log", "wb"), stderr=subprocess.STDOUT)
                 for i, c in enumerate(cfgs)]
    else:
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--addr", srv.address,
                                   "--configs", ",".join(map(str, cfgs)), *mem_args], env=env,
                                  stdout=open(work / "worker.log", "wb"), stderr=subprocess.STDOUT)]
    rcs = [p.wait() for p in procs]
    t_end = time.time()
    nv.stop.set()
    nv.join()
    logs = {p.name: p.read_text()[-3000:] for p in work.glob("*.log")}
    spans = list(core.spans.values())
    jobs = [{"name": j["name"], "arrival": t_launch, "finish": j["finished"] if j["state"] == "done" else None}
            for j in core.jobs.values()]
    first = min((s.start for s in spans if s.phase != "resident"), default=t_launch)
    res = {"policy": policy, "mode": mode, "eager": eager, "return_codes": rcs, "jobs": a.jobs,
           "states": {j["name"]: j["state"] for j in core.jobs.values()},
           **mx.summarize(spans, caps, jobs, t_launch, t_end),
           "nvml_idle_frac": nv.idle(first, t_end), "sched_idle_frac_from_first_lease": mx.idle_fraction(
               spans, len(caps), first, t_end),
           "peak_mem_gib": nv.peak_mem(t_launch, t_end), "yields": len(core.yield_at), "mem_per_job_gib": mem,
           "startup_s": first - t_launch,
           "spans": [s.to_dict() for s in spans], "nvml": [s for s in nv.samples],
           "t_launch": t_launch}
    if any(rcs):
        res["logs"] = logs
    trace = core.op_trace()["trace"]
    out = os.environ.get("OUT")
    if out:
        mx.write_trace(Path(out) / f"sched_trace_{policy}_{mode}.json", trace)
    srv.stop()
    return res


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(runs)
    fig, axes = plt.subplots(len(keys), 1, figsize=(14, 2.6 * len(keys)), squeeze=False, sharex=True)
    for ax, k in zip(axes[:, 0], keys):
        r = runs[k]
        t0 = r["t_launch"]
        names = sorted({s["job"] for s in r["spans"]})
        for s in r["spans"]:
            if s["phase"] == "resident" or s["end"] is None:
                continue
            y = names.index(s["job"])
            ax.broken_barh([(s["start"] - t0, s["end"] - s["start"])], (y - 0.4, 0.8),
                           color=COLORS.get(s["phase"], "k"))
        ax.set_yticks(range(len(names)), names)
        ax.set_title(f"{k}: {r['jobs_per_hour']:.1f} jobs/h, NVML idle {r['nvml_idle_frac']:.1%}, "
                     f"mean latency {r['mean_latency_s']:.0f} s")
        ax2 = ax.twinx()
        for d in sorted({x[1] for x in r.get("nvml", [])}):
            pts = [(t - t0, u) for t, dd, u, _ in r.get("nvml", []) if dd == d]
            if pts:
                ax2.plot(*zip(*pts), lw=0.6, color="k", alpha=0.5)
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("GPU util %")
        ax.set_xlabel("seconds since launch")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="lower center", ncol=len(COLORS))
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="procs,streams")
    ap.add_argument("--policies", default="fifo,phase")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gpus", default="all", help="GPU indices (e.g. 0,1) or all")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs in procs mode either")
    ap.add_argument("--capacity", type=float, default=None,
                    help="GiB per GPU the scheduler may lease (default 92%% of each); lower: tight memory")
    ap.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (no NVML; nothing is measured)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--configs", help=argparse.SUPPRESS)
    ap.add_argument("--mem", action="append", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.addr, a.configs.split(","), {k: float(v) for k, v in (x.split("=") for x in a.mem)})

    import torch

    from bench.common import RESULTS, write_json

    if a.cpu:
        gpus, caps = [0], [64.0]
    else:
        gpus = list(range(torch.cuda.device_count())) if a.gpus == "all" else [int(x) for x in a.gpus.split(",")]
        caps = [a.capacity or torch.cuda.get_device_properties(g).total_memory / (1 << 30) * 0.92 for g in gpus]
    old = {}
    prev = RESULTS / "sched.json"
    if prev.exists():
        try:
            d = json.loads(prev.read_text())
            if not a.cpu and d.get("gpus") == len(gpus) and d.get("meta", {}).get("device") == \
                    torch.cuda.get_device_name(0):
                old = d.get("runs", {})
        except (ValueError, KeyError):
            pass
    runs = dict(old)
    for mode in a.modes.split(","):
        for policy in a.policies.split(","):
            key = f"{policy}-{mode}"
            print(f"=== {key}: {a.jobs} jobs x {a.steps} steps on {len(gpus)} GPU(s)", flush=True)
            r = run_one(policy, mode, a, gpus, caps)
            runs[key] = r
            peak = max(r["peak_mem_gib"], default=float("nan"))
            print(f"    makespan {r['makespan_s']:.1f} s  jobs/h {r['jobs_per_hour']:.1f}  mean latency "
                  f"{r['mean_latency_s']:.1f} s  NVML idle {r['nvml_idle_frac']:.1%}  peak {peak:.1f} GiB  "
                  f"yields {r['yields']}  rc {r['return_codes']}", flush=True)
    summary = {}
    for mode in {k.split("-", 1)[1] for k in runs}:
        f, p = runs.get(f"fifo-{mode}"), runs.get(f"phase-{mode}")
        if f and p and f["jobs_per_hour"] > 0:
            summary[mode] = {"jobs_per_hour_ratio": p["jobs_per_hour"] / f["jobs_per_hour"],
                             "latency_ratio": p["mean_latency_s"] / max(f["mean_latency_s"], 1e-9),
                             "idle_fifo": f["nvml_idle_frac"], "idle_phase": p["nvml_idle_frac"],
                             "target_idle_le_5pct": p["nvml_idle_frac"] <= 0.05,
                             "target_2x_jobs_per_hour": p["jobs_per_hour"] >= 2 * f["jobs_per_hour"]}
    slim = {k: {kk: vv for kk, vv in r.items() if kk != "nvml"} for k, r in runs.items()}
    payload = {"gpus": len(gpus), "args": vars(a), "summary": summary, "runs": slim}
    if a.cpu:  # a smoke run measures nothing: keep it out of bench/results
        where = Path(tempfile.mkdtemp(prefix="rlcu-sched-smoke-"))
        (where / "sched.json").write_text(json.dumps(payload, indent=2, default=float))
        plot(runs, where / "sched_timeline.png")
        print(f"smoke run: {where}")
    else:
        RESULTS.mkdir(exist_ok=True)
        plot(runs, RESULTS / "sched_timeline.png")
        if os.environ.get("OUT"):
            plot(runs, Path(os.environ["OUT"]) / "sched_timeline.png")
        write_json("sched.json", payload)
    for mode, s in summary.items():
        print(f"{mode}: phase/fifo jobs per hour {s['jobs_per_hour_ratio']:.2f}x, idle {s['idle_fifo']:.1%} -> "
              f"{s['idle_phase']:.1%}, latency x{s['latency_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
