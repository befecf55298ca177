"""Scheduler benchmark (issue 6): N small GRPO jobs on the GPU(s), FIFO-exclusive (one job
at a time per device) against phase-aware sharing, with the jobs as separate processes
(`procs`, CUDA graphs on unless --eager; `procs_eager`: the same without graphs) or as
threads of one worker process, each on its own CUDA stream (`streams`, always eager:
capturing a CUDA graph while other threads of the process launch kernels is an error).

Per run: makespan (launch to the last job's finish), jobs per hour, mean job latency (from
launch), the GPU idle fraction from NVML (the share of time no kernel runs: 1 - the
driver's utilization samples, time-weighted, over the span from the first phase lease to
the last finish), the scheduler's own lease-based idle fraction, peak device memory (NVML,
and each worker process's torch peak), yields; a timeline PNG with every lease per job and
the NVML utilization under it, one panel per policy and mode.

NVML is read through ctypes from libnvidia-ml.so.1 (no pynvml needed): the driver's raw
utilization samples (nvmlDeviceGetSamples) and, every 50 ms, nvmlDeviceGetUtilizationRates
and the memory in use; without the library, `nvidia-smi` is polled instead.

--warm-workers (processes only) starts the worker processes before the clock and lets each
run one unscheduled step of its job's shape, so that a job's start-up is its `init` alone, as
in a service whose workers outlive the jobs; a worker whose job is done gives its memory back
and stays up until every job is done (no CUDA context torn down while other jobs run); both
policies get the same warm workers.
Every job loads one base checkpoint (an HF folder written before any clock, as RL runs start
from a pretrained model); --init random has each job draw its own weights at init instead.

Before the timed runs one job of 2 steps runs untimed (--no-warmup skips it), so Triton's
kernel cache on disk is filled and no policy pays the first compiles. --budget-s bounds the
whole call (warm-up included): a run that would pass it is stopped (its processes killed)
and reported with the jobs it completed, and the runs left are skipped.

    python bench/sched.py [--modes procs,streams] [--policies fifo,phase] [--jobs 4] [--steps 6]
                          [--gpus all] [--hidden 512 --layers 8 --new-tokens 128] [--eager]
                          [--warm-workers] [--init checkpoint|random] [--budget-s 360] [--no-warmup] [--merge]
                          [--tag NAME]
    python bench/sched.py --cpu --hidden 64 --layers 2 --prompts 2 --group 2 --new-tokens 8 --steps 2
                                                                        # a smoke run, measures nothing

JSON: $OUT and bench/results/sched_<N>gpu[_<tag>].json (N GPUs); the timeline:
sched_timeline_<N>gpu[_<tag>].png in both. --merge keeps the runs of an earlier call on the same
device and GPU count that this call does not repeat.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

COLORS = {"init": "#999999", "rollout": "#4c72b0", "old_logprobs": "#8172b2", "ref_logprobs": "#dd8452",
          "values": "#937860", "critic_train": "#da8bc3", "actor_train": "#c44e52"}
GiB = float(1 << 30)


# ---------------------------------------------------------------------- jobs
def tiny_model(a) -> dict:
    """The Qwen3Config fields of the bench's job model."""
    from rlcu.data.synthetic import make_tokenizer

    tok = make_tokenizer()
    heads = max(2, a.hidden // 64)
    return {"vocab_size": tok.vocab_size, "hidden_size": a.hidden, "intermediate_size": 3 * a.hidden,
            "num_hidden_layers": a.layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "head_dim": 64, "max_position_embeddings": 64 + a.new_tokens, "eos_token_id": tok.eos_token_id,
            "bos_token_id": None}


_BASES: dict[tuple, Path] = {}


def base_checkpoint(a) -> Path:
    """The base model the jobs start from with --init checkpoint: one HF folder (random
    weights, seed 0, in the jobs' dtype), written once per call before any clock starts,
    as RL runs start from a pretrained checkpoint."""
    import torch

    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config

    key = tuple(sorted(tiny_model(a).items())) + (a.cpu,)
    if key not in _BASES:
        folder = Path(tempfile.mkdtemp(prefix="rlcu-sched-base-")) / "base"
        Qwen3.from_config(Qwen3Config(**tiny_model(a)), seed=0).save_pretrained(
            folder, dtype=torch.float32 if a.cpu else torch.bfloat16)
        _BASES[key] = folder
    return _BASES[key]


def job_config(i: int, a, work: Path, tok_dir: Path, data: Path, eager: bool, steps: int | None = None) -> Path:
    import yaml

    weights = {"path": str(base_checkpoint(a))} if a.init == "checkpoint" else {"tiny": tiny_model(a), "init_seed": i}
    cfg = {
        "model": {**weights, "tokenizer": str(tok_dir), "device": "cpu" if a.cpu else "cuda",
                  "dtype": "float32" if a.cpu else "bfloat16"},
        "data": {"path": str(data), "seed": i},
        "rewards": [{"fn": "rlcu.data.synthetic:partial_match_reward"}],
        "steps": steps or a.steps, "prompts_per_step": a.prompts, "group_size": a.group,
        "max_new_tokens": a.new_tokens, "stop_at_eos": False, "temperature": 1.0, "chat_template": False, "seed": i,
        "kl_coef": 0.0, "engine": {"enforce_eager": eager, "max_num_seqs": a.prompts * a.group},
        "log": {"out_dir": str(work / f"job{i}"), "tensorboard": False, "plot": False, "progress": False},
        "checkpoint": {"save_at_end": False},
    }
    p = work / f"job{i}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def job_mem(cfg_path: Path, procs: bool) -> dict:
    """Estimated GiB per phase with a margin; a process's CUDA context counts as resident."""
    from rlcu.config import GRPOConfig, load_config
    from rlcu.sched.job import job_memory

    _, mem = job_memory(load_config(GRPOConfig, cfg_path))
    mem = {k: max(1.0, 1.5 * v) for k, v in mem.items()}
    if procs:
        mem["resident"] += 0.75
    return mem


def _give_memory_back() -> None:
    """What a worker's finished job or warm-up held goes back to the device (the process and
    its CUDA context stay)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def warm_up(cfg_path: str, devices: list[str]) -> None:
    """A warm worker's preparation, before the clock starts: one unscheduled step of its own
    job's shape on each device it may be leased (CUDA context, cuBLAS, Triton's kernels
    loaded into the process), then everything it allocated given back."""
    import torch

    from rlcu.config import GRPOConfig, load_config
    from rlcu.train.grpo import GRPOTrainer

    for dev in devices:
        cfg = load_config(GRPOConfig, cfg_path)
        cfg.steps, cfg.log.out_dir = 1, tempfile.mkdtemp(prefix="rlcu-warm-")
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
        GRPOTrainer(cfg).train()
    _give_memory_back()
    if torch.cuda.is_available():
        for dev in devices:
            if dev.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(dev)


def worker(addr: str, cfgs: list[str], names: list[str], mem: dict, streams: bool, stats: str | None,
           warm: str | None = None, warm_devices: list[str] | None = None) -> int:
    """One process of either mode: a thread per job (one job in the procs mode); in the
    streams mode each job issues its work on a CUDA stream of its own. Writes the process's
    peak torch memory per device to `stats` (JSON). With `warm` (a path): `warm_up` first,
    then `warm`.ready is written and the jobs start once `warm`.go exists."""
    import torch

    from rlcu.sched.job import ScheduledGRPO, run_grpo

    if warm:
        warm_up(cfgs[0], warm_devices or [])
        Path(warm + ".ready").write_text(str(os.getpid()))
        while not Path(warm + ".go").exists():
            time.sleep(0.002)

    used: set[int] = set()

    class BenchGRPO(ScheduledGRPO):
        def _use_device(self, lease):
            super()._use_device(lease)
            if torch.cuda.is_available():
                used.add(torch.cuda.current_device())
                if streams:
                    self._stream_ctx = torch.cuda.stream(torch.cuda.Stream())
                    self._stream_ctx.__enter__()  # this thread's current stream from now on

    errors, done = [], {}

    def one(path: str, name: str) -> None:
        try:
            run_grpo(path, addr, name, mem=mem, trainer_cls=BenchGRPO)
            done[name] = time.time()
        except BaseException as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            errors.append(f"{name}: {e!r}")

    ts = [threading.Thread(target=one, args=(p, n)) for p, n in zip(cfgs, names)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for e in errors:
        print(e, file=sys.stderr)
    if stats:
        out = {"pid": os.getpid(), "jobs": names, "done": done, "errors": errors, "devices": {}}
        for d in sorted(used):
            out["devices"][d] = {"peak_alloc_gib": torch.cuda.max_memory_allocated(d) / GiB,
                                 "peak_reserved_gib": torch.cuda.max_memory_reserved(d) / GiB}
        Path(stats).write_text(json.dumps(out))
    if warm:  # a pool's worker outlives its job: give the job's memory back, stay up until the run ends
        _give_memory_back()
        Path(warm + ".done").write_text("")
        while not Path(warm + ".end").exists():
            time.sleep(0.01)
    return 1 if errors else 0


# ---------------------------------------------------------------------- NVML
class NvmlError(RuntimeError):
    pass


class _Util(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Mem(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Value(ctypes.Union):
    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint), ("ulVal", ctypes.c_ulong),
                ("ullVal", ctypes.c_ulonglong), ("sllVal", ctypes.c_longlong), ("siVal", ctypes.c_int),
                ("usVal", ctypes.c_ushort)]


class _Sample(ctypes.Structure):
    _fields_ = [("timeStamp", ctypes.c_ulonglong), ("sampleValue", _Value)]


class Nvml:
    """The few NVML calls the benchmark needs, through ctypes (nvml.h: nvmlInit_v2,
    nvmlDeviceGetHandleByUUID / ByIndex_v2, nvmlDeviceGetUtilizationRates,
    nvmlDeviceGetMemoryInfo, nvmlDeviceGetSamples)."""

    SUCCESS, NOT_FOUND = 0, 6
    GPU_UTILIZATION_SAMPLES = 1
    _VALUE: ClassVar[dict] = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

    def __init__(self):
        err = None
        for name in ("libnvidia-ml.so.1", "libnvidia-ml.so"):
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as e:
                err = e
        else:
            raise NvmlError(f"no NVML library: {err}")
        L = self.lib
        L.nvmlErrorString.restype = ctypes.c_char_p
        L.nvmlErrorString.argtypes = [ctypes.c_int]
        L.nvmlDeviceGetHandleByUUID.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
        L.nvmlDeviceGetHandleByIndex_v2.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
        L.nvmlDeviceGetUtilizationRates.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Util)]
        L.nvmlDeviceGetMemoryInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Mem)]
        L.nvmlDeviceGetSamples.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong,
                                           ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint),
                                           ctypes.POINTER(_Sample)]
        self._check(L.nvmlInit_v2(), "nvmlInit_v2")

    def _check(self, rc: int, what: str) -> None:
        if rc != self.SUCCESS:
            try:
                msg = self.lib.nvmlErrorString(rc).decode()
            except Exception:  # noqa: BLE001
                msg = "?"
            raise NvmlError(f"{what}: NVML error {rc} ({msg})")

    def handle(self, index: int, uuid: str | None = None) -> ctypes.c_void_p:
        """The device of that UUID (as CUDA reports it, with or without 'GPU-'), else NVML's index."""
        h = ctypes.c_void_p()
        for u in ([uuid, f"GPU-{uuid}"] if uuid else []):
            if self.lib.nvmlDeviceGetHandleByUUID(u.encode(), ctypes.byref(h)) == self.SUCCESS:
                return h
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(h)), "nvmlDeviceGetHandleByIndex_v2")
        return h

    def utilization(self, h) -> int:
        u = _Util()
        self._check(self.lib.nvmlDeviceGetUtilizationRates(h, ctypes.byref(u)), "nvmlDeviceGetUtilizationRates")
        return int(u.gpu)

    def memory(self, h) -> tuple[float, float]:
        """(used, total) in GiB."""
        m = _Mem()
        self._check(self.lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)), "nvmlDeviceGetMemoryInfo")
        return m.used / GiB, m.total / GiB

    def samples(self, h, last_us: int) -> list[tuple[int, float]]:
        """The driver's GPU utilization samples newer than last_us: [(timestamp in µs, percent)]."""
        vt, n = ctypes.c_int(0), ctypes.c_uint(0)
        rc = self.lib.nvmlDeviceGetSamples(h, self.GPU_UTILIZATION_SAMPLES, last_us, ctypes.byref(vt), ctypes.byref(n),
                                           None)
        if rc == self.NOT_FOUND:
            return []
        self._check(rc, "nvmlDeviceGetSamples (count)")
        if n.value == 0:
            return []
        buf = (_Sample * n.value)()
        rc = self.lib.nvmlDeviceGetSamples(h, self.GPU_UTILIZATION_SAMPLES, last_us, ctypes.byref(vt), ctypes.byref(n),
                                           buf)
        if rc == self.NOT_FOUND:
            return []
        self._check(rc, "nvmlDeviceGetSamples")
        field = self._VALUE.get(vt.value, "uiVal")
        return [(int(s.timeStamp), float(getattr(s.sampleValue, field))) for s in buf[:n.value]
                if s.timeStamp > last_us]


def cuda_uuids(gpus: list[int]) -> list[str | None]:
    import torch

    out = []
    for g in gpus:
        try:
            out.append(str(torch.cuda.get_device_properties(g).uuid))
        except Exception:  # noqa: BLE001
            out.append(None)
    return out


def time_weighted_util(raw: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """Mean of a utilization series [(t, percent)] over [t0, t1] where each sample covers
    the time since the one before it; None when fewer than 2 samples reach into the window."""
    raw = sorted(raw)
    num = den = 0.0
    for (ta, _), (tb, u) in itertools.pairwise(raw):
        w = min(tb, t1) - max(ta, t0)
        if w > 0:
            num += w * u
            den += w
    return num / den if den > 0 else None


class GpuSampler(threading.Thread):
    """Samples the GPUs while the runs go: every `every` s the utilization (the share of the
    driver's last sample period in which a kernel ran) and memory in use of each device,
    and the driver's raw utilization samples. source: nvml, nvidia-smi or off."""

    def __init__(self, gpus: list[int], uuids: list[str | None] | None = None, every: float = 0.05,
                 enabled: bool = True):
        super().__init__(daemon=True)
        self.gpus, self.every, self.stop = gpus, every, threading.Event()
        self.polled: list[tuple[float, int, float, float]] = []  # (time, device, util %, used GiB)
        self.raw: list[tuple[float, int, float]] = []  # (time, device, util %) from the driver's sample buffer
        self.errors: list[str] = []
        self.source, self.handles, self.nv = "off", [], None
        self.total_gib: list[float] = []
        self._lock = threading.Lock()
        if not enabled:
            return
        try:
            self.nv = Nvml()
            uuids = uuids or [None] * len(gpus)
            self.handles = [self.nv.handle(g, u) for g, u in zip(gpus, uuids)]
            self.total_gib = [self.nv.memory(h)[1] for h in self.handles]
            self.source = "nvml"
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"NVML through ctypes: {e}; polling nvidia-smi instead")
            self.nv = None
            if self._smi() is not None:
                self.source = "nvidia-smi"
                self.every = max(every, 0.1)
            else:
                self.errors.append("nvidia-smi did not answer either: no GPU sampling")
        self._last_us = [0] * len(self.handles)
        self._raw_ok = self.source == "nvml"

    def _smi(self) -> list[tuple[float, float]] | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                                  "--format=csv,noheader,nounits"],
                                 check=False, capture_output=True, text=True, timeout=5)
            rows = {int(r[0]): (float(r[1]), float(r[2]) / 1024.0)
                    for r in (line.split(",") for line in out.stdout.strip().splitlines()) if len(r) == 3}
            return [rows[g] for g in self.gpus]
        except Exception:  # noqa: BLE001
            return None

    def _raw_poll(self) -> None:
        for d, h in enumerate(self.handles):
            try:
                got = self.nv.samples(h, self._last_us[d])
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"raw samples off: {e}")
                self._raw_ok = False
                return
            if not got:
                continue
            self._last_us[d] = max(ts for ts, _ in got)
            now = time.time()
            skew = now - self._last_us[d] / 1e6  # the driver's stamps are wall-clock µs; shift if not
            shift = skew if abs(skew) > 10.0 else 0.0
            with self._lock:
                self.raw.extend((ts / 1e6 + shift, d, u) for ts, u in got)

    def run(self) -> None:
        if self.source == "off":
            return
        if self._raw_ok:
            self._raw_poll()  # drop what the buffer held before the runs
            with self._lock:
                self.raw.clear()
        next_raw = 0.0
        while not self.stop.wait(self.every):
            t = time.time()
            try:
                if self.source == "nvml":
                    vals = [(self.nv.utilization(h), self.nv.memory(h)[0]) for h in self.handles]
                else:
                    vals = self._smi() or []
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"sampling stopped: {e}")
                return
            with self._lock:
                self.polled.extend((t, d, float(u), m) for d, (u, m) in enumerate(vals))
            if self._raw_ok and t >= next_raw:
                self._raw_poll()
                next_raw = t + 0.25
        if self._raw_ok:
            self._raw_poll()

    def window(self, t0: float, t1: float) -> dict:
        """NVML figures over [t0, t1]: idle fraction (raw samples when there are enough,
        else the polled utilization), peak memory in use per device."""
        with self._lock:
            polled = [s for s in self.polled if t0 <= s[0] <= t1]
            raw = list(self.raw)
        n = max(len(self.handles), len(self.gpus)) if self.source != "off" else 0
        utils = [time_weighted_util([(t, u) for t, dd, u in raw if dd == d], t0, t1) for d in range(n)]
        raw_util = sum(utils) / n if n and all(u is not None for u in utils) else None
        pol = [u for _, _, u, _ in polled]
        pol_util = sum(pol) / len(pol) if pol else None
        util, src = (raw_util, "driver samples") if raw_util is not None else (pol_util, "polled utilization")
        peak = [max([m for _, dd, _, m in polled if dd == d], default=float("nan")) for d in range(n)]
        return {"nvml_idle_frac": 1.0 - util / 100.0 if util is not None else float("nan"),
                "nvml_idle_source": src if util is not None else "none",
                "nvml_idle_frac_polled": 1.0 - pol_util / 100.0 if pol_util is not None else float("nan"),
                "nvml_peak_mem_gib": peak}

    def mem_now(self) -> list[float]:
        with self._lock:
            last = {}
            for _, d, _, m in self.polled:
                last[d] = m
        return [last.get(d, float("nan")) for d in range(len(self.gpus))]

    def series(self, t0: float, t1: float) -> dict:
        """The samples of [t0, t1] for the JSON and the plot."""
        with self._lock:
            raw = [(t, d, u) for t, d, u in self.raw if t0 <= t <= t1]
            polled = [(t, d, u, m) for t, d, u, m in self.polled if t0 <= t <= t1]
        return {"raw": raw, "polled": polled[::4]}  # polled: every 4th (every 0.2 s)


# ---------------------------------------------------------------------- one run
def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is still alive after grace_s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    t = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, t - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_one(policy: str, mode: str, a, gpus: list[int], caps: list[float], sampler: GpuSampler, deadline: float,
            jobs: int | None = None, steps: int | None = None, tag: str = "", warm: bool = False) -> dict:
    """One policy x mode: launch the jobs, wait for them (until `deadline` at most: then the
    processes are killed and the run is reported as incomplete), measure. With `warm` the
    worker processes are started and warmed up (`warm_up`) first, and the clock starts when
    all are ready: jobs handed to a long-lived pool of workers, as a service would."""
    from rlcu.data.synthetic import make_tokenizer, sort_rows
    from rlcu.sched import metrics as mx
    from rlcu.sched.core import Core
    from rlcu.sched.server import SchedServer

    jobs = jobs or a.jobs
    work = Path(tempfile.mkdtemp(prefix=f"rlcu-sched-{policy}-{mode}-"))
    tok_dir = work / "tok"
    make_tokenizer().save_pretrained(tok_dir)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sort_rows(512, seed=0)))
    procs_mode = mode.startswith("procs")
    eager = a.eager or mode != "procs"
    cfgs = [job_config(i, a, work, tok_dir, data, eager, steps) for i in range(jobs)]
    names = [f"job{i}" for i in range(jobs)]
    mem = job_mem(cfgs[0], procs_mode)
    core = Core(caps, state=work / "sched.db", policy=policy, heartbeat_timeout=300.0,
                device_names=[f"cpu{g}" if a.cpu else f"cuda:{g}" for g in gpus])
    srv = SchedServer(core, f"unix:{work / 's.sock'}", "bench").start()
    env = dict(os.environ, RLCU_SCHED_TOKEN="bench", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")] if p))
    if a.cpu:  # the smoke run: jobs share a few cores
        env.setdefault("OMP_NUM_THREADS", "1")
    mem_args = [f"--mem={k}={v}" for k, v in mem.items()]
    me = str(Path(__file__).resolve())
    groups = [([c], [n]) for c, n in zip(cfgs, names)] if procs_mode else [(cfgs, names)]
    procs = []
    complete = True
    warm_s = None

    def launch():
        for k, (cs, ns) in enumerate(groups):
            cmd = [sys.executable, me, "--worker", "--addr", srv.address, "--configs", ",".join(map(str, cs)),
                   "--names", ",".join(ns), "--stats", str(work / f"stats{k}.json"), *mem_args]
            if not procs_mode:
                cmd.append("--streams")
            if warm:
                cmd += ["--warm", str(work / f"warm{k}"),
                        "--warm-devices", ",".join(f"cpu{g}" if a.cpu else f"cuda:{g}" for g in gpus)]
            with open(work / f"worker{k}.log", "wb") as log:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    try:
        if warm:
            t_warm = time.time()
            launch()
            ready = [work / f"warm{k}.ready" for k in range(len(groups))]
            while not all(r.exists() for r in ready):
                if time.time() > deadline or any(p.poll() is not None for p in procs):
                    complete = False
                    break
                time.sleep(0.01)
            warm_s = time.time() - t_warm
            if not complete:
                print(f"    the workers' warm-up did not finish ({warm_s:.0f} s)", flush=True)
        mem_before = sampler.mem_now()
        t_launch = time.time()
        if warm:
            for k in range(len(groups)):
                (work / f"warm{k}.go").write_text("")
        else:
            launch()
        if warm and complete:  # the workers stay up after their jobs (a pool): end them when all are done
            done_files = [work / f"warm{k}.done" for k in range(len(groups))]
            while not all(f.exists() for f in done_files):
                if time.time() > deadline or any(p.poll() is not None and p.returncode for p in procs):
                    break
                time.sleep(0.01)
            for k in range(len(groups)):
                (work / f"warm{k}.end").write_text("")
        for p in procs if complete else []:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                complete = False
                print(f"    budget reached: stopping {tag or policy + '-' + mode} after {time.time() - t_launch:.0f} s",
                      flush=True)
                break
    finally:  # also on Ctrl-C: leave no job process behind
        _stop(procs)
    t_exit = time.time()
    rcs = [p.returncode for p in procs]
    logs = {p.name: p.read_text(errors="replace")[-3000:] for p in sorted(work.glob("*.log"))}
    snap = core.snapshot()
    spans = list(snap.spans)
    done = {n: j.finished for n, j in snap.jobs.items() if j.state == "done"}
    states = {n: j.state for n, j in snap.jobs.items()}
    yields = snap.metrics["yields"]
    trace = snap.trace()
    t_end = max(done.values()) if complete and len(done) == jobs else t_exit
    js = [{"name": n, "arrival": t_launch, "finish": done.get(n)} for n in names]
    work_spans = [s for s in spans if s.phase != mx.RESIDENT]
    first = min((s.start for s in work_spans), default=t_launch)
    stats = [json.loads(p.read_text()) for p in sorted(work.glob("stats*.json"))]
    torch_peak = {}
    for st in stats:
        for d, v in st["devices"].items():
            torch_peak[d] = torch_peak.get(d, 0.0) + v["peak_reserved_gib"]
    progress = 0.0  # jobs' worth of steps done (a run stopped by the budget counts its jobs' finished steps)
    for i in range(jobs):
        m = work / f"job{i}" / "metrics.jsonl"
        n_steps = sum(1 for line in m.read_text().splitlines() if line.strip()) if m.exists() else 0
        progress += 1.0 if names[i] in done else min(n_steps, (steps or a.steps) - 1) / (steps or a.steps)
    nv = sampler.window(first, t_end)
    # steady state: from when every job is past its first actor_train (start-up, the first rollout's graph
    # capture and the first compiles behind it) to the first finish (every job still running)
    warm_by = [min((s.end for s in work_spans if s.job == n and s.phase == "actor_train" and s.end), default=None)
               for n in names]
    steady = None
    if all(w is not None for w in warm_by) and len(done) == jobs and min(done.values()) > max(warm_by):
        t0, t1 = max(warm_by), min(done.values())
        steady = {"t0_s": t0 - t_launch, "t1_s": t1 - t_launch,
                  "nvml_idle_frac": sampler.window(t0, t1)["nvml_idle_frac"]}
    res = {"policy": policy, "mode": mode, "eager": eager, "warm_workers": warm, "warm_up_s": warm_s,
           "complete": complete, "return_codes": rcs, "jobs": jobs,
           "steps": steps or a.steps, "states": states,
           **mx.summarize(spans, caps, js, t_launch, t_end),
           **nv, "sched_idle_frac_from_first_lease": mx.idle_fraction(spans, len(caps), first, t_end),
           "peak_mem_gib": max([m for m in nv["nvml_peak_mem_gib"] if not math.isnan(m)], default=float("nan")),
           "mem_before_gib": mem_before, "torch_peak_reserved_gib_sum": torch_peak,
           "jobs_progress": progress, "jobs_per_hour_by_steps": progress / max(t_end - t_launch, 1e-9) * 3600.0,
           "yields": yields, "mem_per_job_gib": mem, "startup_s": first - t_launch,
           "exit_s": t_exit - t_end, "steady": steady, "spans": [s.to_dict() for s in spans],
           "gpu_samples": sampler.series(t_launch, t_exit), "t_launch": t_launch,
           "work": str(work)}
    if any(rcs) or not complete:
        res["logs"] = logs
    out = os.environ.get("OUT")
    if out and not tag:
        mx.write_trace(Path(out) / f"sched_trace_{len(gpus)}gpu_{policy}_{mode}.json", trace)
    srv.stop()
    return res


# ---------------------------------------------------------------------- report
def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in sorted(runs, key=lambda k: (k.split("-", 1)[1], k)) if "spans" in runs[k]]
    if not keys:
        return
    fig, axes = plt.subplots(len(keys), 1, figsize=(14, 2.6 * len(keys)), squeeze=False, sharex=True)
    xmax = max(runs[k]["makespan_s"] for k in keys) * 1.02  # one scale for all panels, none cut off
    for ax, k in zip(axes[:, 0], keys):
        r = runs[k]
        t0 = r["t_launch"]
        names = sorted({s["job"] for s in r["spans"]} | {f"job{i}" for i in range(r["jobs"])})
        end_default = r["t_launch"] + r["makespan_s"]
        for s in r["spans"]:
            if s["phase"] == "resident":
                continue
            end = s["end"] if s["end"] is not None else end_default
            y = names.index(s["job"])
            ax.broken_barh([(s["start"] - t0, end - s["start"])], (y - 0.4, 0.8), color=COLORS.get(s["phase"], "k"))
        devs = {}
        for s in r["spans"]:
            devs.setdefault(s["job"], set()).update(s["devices"])
        multi = len({d for v in devs.values() for d in v}) > 1
        ax.set_yticks(range(len(names)), [f"{j} (GPU {','.join(map(str, sorted(devs.get(j, []))))})" if multi else j
                                          for j in names])
        ax.set_xlim(0, xmax)
        ax.set_ylim(-0.6, len(names) - 0.4)
        flag = "" if r.get("complete", True) else " [stopped by the budget]"
        ax.set_title(f"{k}: {r['jobs_per_hour']:.1f} jobs/h, NVML idle {r['nvml_idle_frac']:.1%}, "
                     f"mean latency {r['mean_latency_s']:.1f} s, {r['jobs_done']}/{r['jobs']} done{flag}", fontsize=9)
        ax2 = ax.twinx()
        gs = r.get("gpu_samples", {})
        pts_all = [(t, d, u) for t, d, u in gs.get("raw", [])] or [(t, d, u) for t, d, u, _ in gs.get("polled", [])]
        for d in sorted({x[1] for x in pts_all}):
            pts = sorted((t - t0, u) for t, dd, u in pts_all if dd == d)
            ax2.step(*zip(*pts), where="pre", lw=0.7, color="k", alpha=0.5, label=f"GPU {d} util")
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("GPU util %")
        ax.set_xlabel("seconds since launch")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="lower center", ncol=len(COLORS))
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize_runs(runs: dict) -> dict:
    summary = {}
    for mode in sorted({k.split("-", 1)[1] for k in runs}):
        f, p = runs.get(f"fifo-{mode}"), runs.get(f"phase-{mode}")
        if f and p and "jobs_per_hour" in f and "jobs_per_hour" in p and f["jobs_per_hour"] > 0:
            summary[mode] = {"jobs_per_hour_ratio": p["jobs_per_hour"] / f["jobs_per_hour"],
                             "latency_ratio": p["mean_latency_s"] / max(f["mean_latency_s"], 1e-9),
                             "makespan_ratio": p["makespan_s"] / max(f["makespan_s"], 1e-9),
                             "idle_fifo": f["nvml_idle_frac"], "idle_phase": p["nvml_idle_frac"],
                             "idle_phase_steady": (p.get("steady") or {}).get("nvml_idle_frac"),
                             "both_complete": bool(f.get("complete") and p.get("complete")),
                             "target_idle_le_5pct": p["nvml_idle_frac"] <= 0.05,
                             "target_2x_jobs_per_hour": p["jobs_per_hour"] >= 2 * f["jobs_per_hour"]}
    return summary


def table(runs: dict, summary: dict) -> str:
    head = ("mode", "policy", "done", "gpu_idle", "sched_idle", "jobs/h", "mean_lat_s", "peak_GiB", "makespan_s",
            "startup_s", "yields")
    rows = [head]
    for k in sorted(runs, key=lambda k: (k.split("-", 1)[1], k)):
        r = runs[k]
        if "jobs_per_hour" not in r:
            rows.append((r["mode"], r["policy"], "skipped", *["-"] * 8))
            continue
        rows.append((r["mode"], r["policy"], f"{r['jobs_done']}/{r['jobs']}" + ("" if r.get("complete") else "*"),
                     f"{r['nvml_idle_frac']:.1%}", f"{r['sched_idle_frac_from_first_lease']:.1%}",
                     f"{r['jobs_per_hour']:.1f}", f"{r['mean_latency_s']:.1f}", f"{r['peak_mem_gib']:.1f}",
                     f"{r['makespan_s']:.1f}", f"{r['startup_s']:.1f}", str(r["yields"])))
    w = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    for mode, s in summary.items():
        lines.append(f"{mode}: phase/fifo jobs per hour {s['jobs_per_hour_ratio']:.2f}x (target >= 2), NVML idle "
                     f"{s['idle_fifo']:.1%} -> {s['idle_phase']:.1%} (target <= 5%), mean latency "
                     f"x{s['latency_ratio']:.2f}" + ("" if s["both_complete"] else "  [a run was cut by the budget]"))
        if s.get("idle_phase_steady") is not None:
            lines.append(f"{mode}: phase NVML idle in steady state (every job past its first update, none "
                         f"finished) {s['idle_phase_steady']:.1%}")
    if any(not r.get("complete", True) for r in runs.values()):
        lines.append("*: stopped by --budget-s; figures from the jobs completed until then")
    return "\n".join(lines)


# ---------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="procs,streams", help="procs, procs_eager, streams")
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
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="wall seconds for the whole call, warm-up included; a run past it is stopped")
    ap.add_argument("--min-run-s", type=float, default=10.0, help=argparse.SUPPRESS)  # skip a run with less left
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the untimed job that fills Triton's kernel cache first")
    ap.add_argument("--tag", default="", help="suffix of the JSON and PNG names (sched_<N>gpu_<tag>.json)")
    ap.add_argument("--merge", action="store_true", help="keep the earlier call's runs this call does not repeat")
    ap.add_argument("--out-dir", default=None, help="where the --cpu smoke run writes (default: a temp folder)")
    ap.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (no NVML; nothing is measured)")
    ap.add_argument("--warm-workers", action="store_true",
                    help="procs modes: start and warm up the worker processes before the clock (imports, CUDA "
                         "context, Triton kernels loaded by one step of the job's shape), as a long-lived pool would")
    ap.add_argument("--init", choices=("checkpoint", "random"), default="checkpoint",
                    help="checkpoint: every job loads one base HF checkpoint (written before the clock), as RL "
                         "runs start from a pretrained model; random: each job draws its weights at init (seed i)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm", help=argparse.SUPPRESS)
    ap.add_argument("--warm-devices", help=argparse.SUPPRESS)
    ap.add_argument("--streams", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--configs", help=argparse.SUPPRESS)
    ap.add_argument("--names", help=argparse.SUPPRESS)
    ap.add_argument("--stats", help=argparse.SUPPRESS)
    ap.add_argument("--mem", action="append", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.addr, a.configs.split(","), a.names.split(","),
                      {k: float(v) for k, v in (x.split("=") for x in a.mem)}, a.streams, a.stats,
                      a.warm, a.warm_devices.split(",") if a.warm_devices else None)
    t_start = time.time()
    deadline = t_start + a.budget_s
    modes, policies = a.modes.split(","), a.policies.split(",")
    bad = [m for m in modes if m not in ("procs", "procs_eager", "streams")]
    if bad or any(p not in ("fifo", "phase") for p in policies):
        ap.error(f"modes are procs, procs_eager, streams and policies fifo, phase; got {a.modes!r}, {a.policies!r}")

    import torch

    if a.cpu:
        gpus, caps, uuids = [0], [64.0], None
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: use --cpu for a smoke run")
        gpus = list(range(torch.cuda.device_count())) if a.gpus == "all" else [int(x) for x in a.gpus.split(",")]
        caps = [a.capacity or torch.cuda.get_device_properties(g).total_memory / GiB * 0.92 for g in gpus]
        uuids = cuda_uuids(gpus)
    n = len(gpus)
    sampler = GpuSampler(gpus, uuids, enabled=not a.cpu)
    for e in sampler.errors:
        print(f"GPU sampling: {e}", flush=True)
    sampler.start()
    print(f"{a.jobs} jobs x {a.steps} steps (hidden {a.hidden}, {a.layers} layers, {a.prompts}x{a.group} samples, "
          f"{a.new_tokens} new tokens) on {n} {'CPU slot' if a.cpu else 'GPU'}(s); GPU sampling: {sampler.source}; "
          f"budget {a.budget_s:.0f} s", flush=True)

    warm = None
    if a.warmup:
        print("=== warm-up: 1 job x 2 steps, untimed (fills the kernel cache)", flush=True)
        cap = min(deadline, time.time() + 0.45 * a.budget_s)
        w = run_one("fifo", "procs", a, gpus, caps, sampler, cap, jobs=1, steps=min(2, a.steps), tag="warm-up")
        warm = {"wall_s": time.time() - t_start, "complete": w["complete"], "return_codes": w["return_codes"],
                "init_to_done_s": w["makespan_s"], **({"logs": w["logs"]} if "logs" in w else {})}
        print(f"    warm-up {warm['wall_s']:.1f} s, rc {w['return_codes']}", flush=True)
        if any(w["return_codes"]) and w["complete"]:
            print("warm-up job failed:\n" + "\n".join(w.get("logs", {}).values())[-4000:], flush=True)

    results = Path(a.out_dir) if a.out_dir else None
    if a.cpu:
        results = results or Path(tempfile.mkdtemp(prefix="rlcu-sched-smoke-"))
    else:
        from bench.common import RESULTS

        results = results or RESULTS
    results.mkdir(parents=True, exist_ok=True)
    name = (f"sched_{n}gpu" if not a.cpu else "sched_cpu") + (f"_{a.tag}" if a.tag else "") + ".json"
    old = {}
    prev = results / name
    if a.merge and prev.exists() and not a.cpu:
        try:
            d = json.loads(prev.read_text())
            if d.get("gpus") == n and d.get("meta", {}).get("device") == torch.cuda.get_device_name(0):
                old = d.get("runs", {})
        except (ValueError, KeyError, AttributeError):
            pass
    runs = dict(old)
    plan = [(m, p) for m in modes for p in policies]
    for i, (mode, policy) in enumerate(plan):
        key = f"{policy}-{mode}"
        left, todo = deadline - time.time(), len(plan) - i
        cap = min(left, max(a.min_run_s, left if todo == 1 else 1.5 * left / todo))
        if left < a.min_run_s:
            print(f"=== {key}: skipped, {left:.0f} s of the budget left", flush=True)
            runs[key] = {"policy": policy, "mode": mode, "skipped": True}
            continue
        print(f"=== {key}: {a.jobs} jobs x {a.steps} steps on {n} {'CPU slot' if a.cpu else 'GPU'}(s), "
              f"at most {cap:.0f} s", flush=True)
        r = run_one(policy, mode, a, gpus, caps, sampler, time.time() + cap,
                    warm=a.warm_workers and mode.startswith("procs"))
        runs[key] = r
        print(f"    makespan {r['makespan_s']:.1f} s  done {r['jobs_done']}/{r['jobs']}  "
              f"jobs/h {r['jobs_per_hour']:.1f}  "
              f"mean latency {r['mean_latency_s']:.1f} s  NVML idle {r['nvml_idle_frac']:.1%}  peak "
              f"{r['peak_mem_gib']:.1f} GiB  yields {r['yields']}  rc {r['return_codes']}", flush=True)
        if any(r["return_codes"]) and r["complete"]:
            print("    a job failed; the end of its log:\n" + "\n".join(r.get("logs", {}).values())[-3000:], flush=True)
    sampler.stop.set()
    sampler.join(timeout=5)
    summary = summarize_runs(runs)
    from bench.common import meta

    payload = {"meta": meta(), "gpus": n,
               "args": {k: v for k, v in vars(a).items() if k not in ("mem", "addr", "configs", "names")},
               "caps_gib": caps, "gpu_sampling": sampler.source, "gpu_sampling_errors": sampler.errors,
               "warmup": warm, "wall_s": time.time() - t_start, "summary": summary, "runs": runs}
    png = name.replace(".json", ".png").replace("sched_", "sched_timeline_")
    if a.cpu:
        (results / name).write_text(json.dumps(payload, indent=2, default=float))
        plot(runs, results / png)
        print(f"smoke run: {results}")
    else:
        plot(runs, results / png)
        if os.environ.get("OUT"):
            plot(runs, Path(os.environ["OUT"]) / png)
        if a.out_dir:
            (results / name).write_text(json.dumps(payload, indent=2, default=float))
        else:
            from bench.common import write_json
            write_json(name, payload)
    print(table(runs, summary))
    print(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
