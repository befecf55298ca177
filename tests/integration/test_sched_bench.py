"""bench/sched.py: the NVML arithmetic, the report, and a tiny end-to-end run on the CPU
(both modes x both policies, then one stopped by its budget); on a GPU, the ctypes NVML
sampler reads the device."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import sched  # noqa: E402

TINY = ["--cpu", "--hidden", "64", "--layers", "2", "--prompts", "2", "--group", "2", "--new-tokens", "8",
        "--jobs", "2", "--no-warmup"]


def test_time_weighted_util():
    raw = [(0.0, 0.0), (1.0, 100.0), (2.0, 0.0), (4.0, 50.0)]  # each value covers the time since the one before
    assert sched.time_weighted_util(raw, 0.0, 4.0) == pytest.approx((100 * 1 + 0 * 1 + 50 * 2) / 4)
    assert sched.time_weighted_util(raw, 0.5, 1.5) == pytest.approx((100 * 0.5 + 0 * 0.5) / 1.0)
    assert sched.time_weighted_util(raw[::-1], 3.0, 4.0) == pytest.approx(50.0)  # order does not matter
    assert sched.time_weighted_util(raw, 5.0, 6.0) is None
    assert sched.time_weighted_util(raw[:1], 0.0, 4.0) is None


def test_sampler_window():
    s = sched.GpuSampler([0], enabled=False)
    w = s.window(0.0, 1.0)
    assert s.source == "off" and math.isnan(w["nvml_idle_frac"]) and w["nvml_idle_source"] == "none"
    # as if sampled: raw driver samples win over the polled utilization
    s.source, s.gpus = "nvml", [0, 1]
    s.polled = [(t / 10, d, 40.0, 3.0 + d) for t in range(11) for d in (0, 1)]
    w = s.window(0.0, 1.0)
    assert w["nvml_idle_source"] == "polled utilization" and w["nvml_idle_frac"] == pytest.approx(0.6)
    assert w["nvml_peak_mem_gib"] == [3.0, 4.0]
    s.raw = [(t / 10, d, 90.0 if d == 0 else 70.0) for t in range(11) for d in (0, 1)]
    w = s.window(0.0, 1.0)
    assert w["nvml_idle_source"] == "driver samples" and w["nvml_idle_frac"] == pytest.approx(0.2)
    assert w["nvml_idle_frac_polled"] == pytest.approx(0.6)


def test_summary_and_table():
    base = {"jobs": 4, "jobs_done": 4, "complete": True, "sched_idle_frac_from_first_lease": 0.1,
            "peak_mem_gib": 9.0, "startup_s": 3.0, "yields": 0}
    runs = {"fifo-procs": dict(base, policy="fifo", mode="procs", jobs_per_hour=100.0, mean_latency_s=60.0,
                               makespan_s=144.0, nvml_idle_frac=0.5),
            "phase-procs": dict(base, policy="phase", mode="procs", jobs_per_hour=250.0, mean_latency_s=40.0,
                                makespan_s=57.6, nvml_idle_frac=0.04),
            "fifo-streams": {"policy": "fifo", "mode": "streams", "skipped": True}}
    s = sched.summarize_runs(runs)
    assert list(s) == ["procs"]
    assert s["procs"]["jobs_per_hour_ratio"] == pytest.approx(2.5)
    assert s["procs"]["target_2x_jobs_per_hour"] and s["procs"]["target_idle_le_5pct"] and s["procs"]["both_complete"]
    t = sched.table(runs, s)
    assert "skipped" in t and "2.50x" in t and "4.0%" in t


def test_stop_kills_what_ignores_sigterm():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    p.stdout.readline()
    t = time.time()
    sched._stop([p], grace_s=0.5)
    assert p.returncode is not None and time.time() - t < 5


def _run(tmp_path, *args, timeout=120):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "sched.py"), *TINY, "--out-dir", str(tmp_path), *args],
                         check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout, json.loads((tmp_path / "sched_cpu.json").read_text())


def test_cpu_smoke_end_to_end(tmp_path):
    stdout, d = _run(tmp_path, "--steps", "1")
    assert set(d["runs"]) == {"fifo-procs", "phase-procs", "fifo-streams", "phase-streams"}
    for k, r in d["runs"].items():
        assert r["complete"] and r["jobs_done"] == 2 and r["return_codes"] == ([0, 0] if "procs" in k else [0]), k
        assert r["jobs_progress"] == pytest.approx(2.0)
        phases = {s["phase"] for s in r["spans"]}
        assert {"resident", "init", "rollout", "actor_train"} <= phases, k
    assert set(d["summary"]) == {"procs", "streams"}
    assert d["runs"]["fifo-procs"]["steady"] is None  # one job at a time: never all of them running
    assert (tmp_path / "sched_timeline_cpu.png").stat().st_size > 10_000
    assert "phase/fifo jobs per hour" in stdout and "makespan_s" in stdout


def test_warm_workers_start_the_clock_after_their_warm_up(tmp_path):
    """--warm-workers: the worker processes import, build and run one step of their job's
    shape before the clock; the jobs then reach their first lease at once."""
    _, d = _run(tmp_path, "--steps", "1", "--modes", "procs", "--warm-workers")
    for k, r in d["runs"].items():
        assert r["complete"] and r["jobs_done"] == 2 and r["warm_workers"], k
        assert r["warm_up_s"] > 0 and r["startup_s"] < 2.0, (k, r["warm_up_s"], r["startup_s"])


def test_budget_stops_a_run(tmp_path):
    stdout, d = _run(tmp_path, "--steps", "500", "--modes", "procs", "--policies", "fifo,phase", "--budget-s", "6",
                     "--min-run-s", "3")
    r = d["runs"]["fifo-procs"]
    assert not r["complete"] and r["jobs_done"] == 0 and "logs" in r
    assert d["runs"]["phase-procs"].get("skipped")
    assert "stopped by --budget-s" in stdout
    assert (tmp_path / "sched_timeline_cpu.png").exists()


@pytest.mark.gpu
def test_nvml_sampler_reads_the_gpu():
    import torch

    s = sched.GpuSampler([0], sched.cuda_uuids([0]))
    assert s.source in ("nvml", "nvidia-smi"), s.errors
    s.start()
    x = torch.randn(4096, 4096, device="cuda")
    t0 = time.time()
    while time.time() - t0 < 1.5:
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    t1 = time.time()
    s.stop.set()
    s.join()
    w = s.window(t0, t1)
    assert s.polled and 0.0 <= w["nvml_idle_frac"] < 0.5, (w, s.errors)
    assert w["nvml_peak_mem_gib"][0] > 0.1


FAKE_NVML = r"""
#include <string.h>
#include <sys/time.h>
typedef struct { unsigned int gpu, memory; } Util;
typedef struct { unsigned long long total, free, used; } Mem;
typedef union { double d; unsigned int ui; unsigned long ul; unsigned long long ull; long long sll; } Value;
typedef struct { unsigned long long ts; Value v; } Sample;
static int dev;
static unsigned long long base;
static unsigned long long now_us(void) {
    struct timeval t; gettimeofday(&t, 0); return t.tv_sec * 1000000ULL + t.tv_usec; }
int nvmlInit_v2(void) { base = now_us() - 1000000ULL; return 0; }
const char *nvmlErrorString(int rc) { return "fake"; }
int nvmlDeviceGetHandleByUUID(const char *u, void **h) { if (strcmp(u, "GPU-abc")) return 6; *h = &dev; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) { return 2; }
int nvmlDeviceGetUtilizationRates(void *h, Util *u) { if (h != &dev) return 2; u->gpu = 42; u->memory = 1; return 0; }
int nvmlDeviceGetMemoryInfo(void *h, Mem *m) {
    m->total = 80ULL << 30; m->free = 77ULL << 30; m->used = 3ULL << 30; return 0; }
int nvmlDeviceGetSamples(void *h, int type, unsigned long long last, int *vt, unsigned int *n, Sample *s) {
    if (h != &dev || type != 1) return 2;
    unsigned int k, c = 0, have = (unsigned int)((now_us() - base) / 100000ULL);  /* one sample per 0.1 s */
    for (k = 0; k < have; k++) {
        unsigned long long ts = base + k * 100000ULL;
        if (ts <= last) continue;
        if (s) { if (c >= *n) break; s[c].ts = ts; s[c].v.ui = 80; }
        c++;
    }
    *vt = 1;
    *n = c;
    return c ? 0 : 6;
}
"""


def test_nvml_ctypes_bindings_against_a_fake_library(tmp_path):
    """The ctypes plumbing (handles by UUID, structs, the two-call sample buffer) against a
    stand-in libnvidia-ml.so.1 built from the declarations in nvml.h."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "fake.c").write_text(FAKE_NVML)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libnvidia-ml.so.1"), str(tmp_path / "fake.c")],
                   check=True)
    code = ("import json, sys, time; sys.path.insert(0, sys.argv[1]); from bench import sched\n"
            "s = sched.GpuSampler([0], ['abc'], every=0.02); s.start(); t0 = time.time(); time.sleep(0.5)\n"
            "s.stop.set(); s.join(); t1 = time.time()\n"
            "print(json.dumps({'source': s.source, 'errors': s.errors, 'total': s.total_gib, 'n_raw': len(s.raw),\n"
            "                  'w': s.window(t0 - 2, t1)}))")
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, env=env,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert d["source"] == "nvml" and not d["errors"], d
    assert d["total"] == [80.0] and d["n_raw"] >= 3  # the 10 samples from before start() are dropped
    assert d["w"]["nvml_idle_source"] == "driver samples" and d["w"]["nvml_idle_frac"] == pytest.approx(0.2)
    assert d["w"]["nvml_idle_frac_polled"] == pytest.approx(0.58) and d["w"]["nvml_peak_mem_gib"] == [3.0]


def test_profile_startup_cpu_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_startup.py"), "--cpu", "--hidden", "64",
                          "--layers", "2", "--prompts", "2", "--group", "2", "--new-tokens", "4", "--steps", "3",
                          "--top", "5"], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "start-up beyond a steady step" in out.stdout
    lines = out.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 3
    i = lines.index("--- init: largest cumulative times")
    assert "rl_trainer.py" in lines[i + 1]  # the trainer's construction heads the init profile
    j = lines.index("--- steady_step: largest self times")
    assert len(lines) - j - 1 == 5 and all(" s " in line for line in lines[j + 1:])


def test_jobs_start_from_one_base_checkpoint_or_their_own_random_weights(tmp_path):
    """--init checkpoint (the default): every job's config names the same base HF folder,
    written once, which loads into the jobs' model shape; --init random: a tiny model per job."""
    import types

    import yaml

    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config

    a = types.SimpleNamespace(hidden=64, layers=2, new_tokens=8, cpu=True, init="checkpoint", steps=1, prompts=2,
                              group=2)
    cfgs = [yaml.safe_load(sched.job_config(i, a, tmp_path, tmp_path / "tok", tmp_path / "d.jsonl", True).read_text())
            for i in range(2)]
    paths = {c["model"]["path"] for c in cfgs}
    assert len(paths) == 1 and "tiny" not in cfgs[0]["model"]
    m = Qwen3.from_pretrained(paths.pop())
    assert m.cfg == Qwen3Config(**sched.tiny_model(a))
    assert torch.equal(m.flat, Qwen3.from_config(m.cfg, seed=0).flat)
    a.init = "random"
    c = yaml.safe_load(sched.job_config(1, a, tmp_path, tmp_path / "tok", tmp_path / "d.jsonl", True).read_text())
    assert "path" not in c["model"] and c["model"]["tiny"] == sched.tiny_model(a) and c["model"]["init_seed"] == 1
