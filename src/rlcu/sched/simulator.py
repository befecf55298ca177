"""Replay a job mix through the scheduling policy in simulated time.

    rlcu sched simulate TRACE.json --policy fifo|phase [--json] [--trace-out chrome.json]

Trace format (the issue's form stays valid; everything past it is optional):

    {"devices": 4,                                  # or {"count": 4, "mem": 80}, or [80, 80, 40]
     "aging_s": 60, "yield_cost_s": 0,              # aging of waiting requests; extra rollout
                                                    # seconds after each yield (KV recompute)
     "jobs": [{"name": "a", "arrival_s": 0, "steps": 20,
               "clusters": {"actor_infer": 2, "actor_train": 2},
                        # or {"actor": {"devices": 1, "resident": 30, "peak": 40}}
               "init": {"cluster": "actor_train", "seconds": 20, "mem": 5},   # once, first
               "step": [{"phase": "rollout", "cluster": "actor_infer", "seconds": 30},
                        {"phase": "actor_train", "cluster": "actor_train", "seconds": 10,
                         "mem": 30, "util": 1.0}]}]}

Semantics. Devices without `mem` have capacity 1 and phases without `mem` take whole
devices (no sharing); give `mem` to both to let phases share a device while their memory
fits. A phase's `seconds` are for its cluster's size at full speed. A rollout may be granted
from 1 device up to the whole pool (or its cluster's home devices if resident) and its time
scales with the devices granted. Phases sharing a device contend for its compute and its
memory bandwidth: each phase declares its demand on both, `util` (compute; default 1,
rollout 0.5) and `bw` (memory bandwidth; default 0.3, rollout 0.7: decoding streams the
weights and the KV cache), and every phase on a device runs at
1 / max(1, sum of util, sum of bw) of full speed there (on its slowest device): two rollouts
sharing a device each run at 1/1.4 of full speed, a rollout beside a training phase at 1/1.5.
The jobs' phases request and release leases exactly as the service's clients do.

Bounds: a trace is refused (the field named) when a count is not an integer (`{"count":
true}`, `steps: 6e6`), or when its jobs make more than `max_phases` phases in all (default
1,000,000; `simulate(..., max_phases=)`), so that a simulation always ends in bounded time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from rlcu.sched import metrics as mx
from rlcu.sched.policy import PHASES, RESIDENT, PolicyError, make_policy, parse_clusters

DEFAULT_UTIL = {"rollout": 0.5}
DEFAULT_BW = {"rollout": 0.7}
MAX_PHASES = 1_000_000
MAX_DEVICES = 65_536


class TraceError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Phase:
    phase: str
    cluster: str
    seconds: float
    mem: float | None
    util: float
    bw: float = 0.3


@dataclasses.dataclass
class JobSpec:
    name: str
    arrival_s: float
    clusters: dict
    phases: list[Phase]  # the whole life: init (if any), then steps x step


@dataclasses.dataclass
class Trace:
    capacity: list[float]
    jobs: list[JobSpec]
    aging_s: float = 60.0
    yield_cost_s: float = 0.0


def _num(x, where: str, lo: float = 0.0, strict: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < lo or (strict and x <= lo):
        raise TraceError(f"{where} must be a number {'>' if strict else '>='} {lo:g}, got {x!r}")
    return float(x)


def _phase(d, where: str, clusters: dict, default_phase: str | None = None) -> Phase:
    if not isinstance(d, dict):
        raise TraceError(f"{where} must be an object like {{'phase': 'rollout', 'cluster': ..., 'seconds': ...}}")
    bad = set(d) - {"phase", "cluster", "seconds", "mem", "util", "bw"}
    if bad:
        raise TraceError(f"{where}.{min(bad)} is not a phase key (allowed: phase, cluster, seconds, mem, util, bw)")
    ph = d.get("phase", default_phase)
    if ph not in PHASES:
        raise TraceError(f"{where}.phase must be one of {', '.join(PHASES)}, got {ph!r}")
    cl = d.get("cluster", next(iter(clusters)) if len(clusters) == 1 else None)
    if cl not in clusters:
        raise TraceError(f"{where}.cluster must be one of the job's clusters ({', '.join(clusters)}), got {cl!r}")
    mem = None if d.get("mem") is None else _num(d["mem"], f"{where}.mem")
    util = _num(d.get("util", DEFAULT_UTIL.get(ph, 1.0)), f"{where}.util", 0.0, strict=True)
    bw = _num(d.get("bw", DEFAULT_BW.get(ph, 0.3)), f"{where}.bw")
    return Phase(ph, cl, _num(d.get("seconds"), f"{where}.seconds"), mem, util, bw)


def _count(x, where: str, most: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= most:
        raise TraceError(f"{where} must be an integer in [1, {most:,}], got {x!r}")
    return x


def load_trace(src, max_phases: int = MAX_PHASES) -> Trace:
    """A trace from a path, a JSON string or a dict; errors name the offending entry. A trace
    of more than max_phases phases in all is refused."""
    if isinstance(src, (str, Path)) and not str(src).lstrip().startswith("{"):
        try:
            src = json.loads(Path(src).read_text())
        except FileNotFoundError:
            raise TraceError(f"no trace file {src}") from None
        except json.JSONDecodeError as e:
            raise TraceError(f"{src}: not JSON: {e}") from None
    elif isinstance(src, str):
        src = json.loads(src)
    if not isinstance(src, dict):
        raise TraceError("a trace is a JSON object with 'devices' and 'jobs'")
    bad = set(src) - {"devices", "jobs", "aging_s", "yield_cost_s"}
    if bad:
        raise TraceError(f"{min(bad)} is not a trace key (allowed: devices, jobs, aging_s, yield_cost_s)")
    dev = src.get("devices")
    if isinstance(dev, (int, float)) and not isinstance(dev, bool):
        cap = [1.0] * _count(dev, "devices", MAX_DEVICES)
    elif isinstance(dev, dict) and set(dev) <= {"count", "mem"}:
        n = _count(dev.get("count"), "devices.count", MAX_DEVICES)
        cap = [_num(dev.get("mem", 1.0), "devices.mem", 0.0, strict=True)] * n
    elif isinstance(dev, list) and 0 < len(dev) <= MAX_DEVICES:
        cap = [_num(m, f"devices[{i}]", 0.0, strict=True) for i, m in enumerate(dev)]
    else:
        raise TraceError(f"devices must be a count >= 1, {{'count': n, 'mem': m}} or a list of memories, got {dev!r}")
    jobs_in = src.get("jobs")
    if not isinstance(jobs_in, list) or not jobs_in:
        raise TraceError("jobs must be a non-empty list")
    jobs, names, total = [], set(), 0
    for i, j in enumerate(jobs_in):
        w = f"jobs[{i}]"
        if not isinstance(j, dict):
            raise TraceError(f"{w} must be an object")
        bad = set(j) - {"name", "arrival_s", "steps", "clusters", "step", "init"}
        if bad:
            raise TraceError(f"{w}.{min(bad)} is not a job key (allowed: name, arrival_s, steps, clusters, "
                             "step, init)")
        name = str(j.get("name", f"job{i}"))
        if name in names:
            raise TraceError(f"{w}.name {name!r} is used twice")
        names.add(name)
        try:
            clusters = parse_clusters(j.get("clusters"))
        except PolicyError as e:
            raise TraceError(f"{w}.clusters: {e}") from None
        steps = _count(j.get("steps", 1), f"{w}.steps", max_phases)
        step = j.get("step")
        if not isinstance(step, list) or not step:
            raise TraceError(f"{w}.step must be a non-empty list of phases")
        one = [_phase(p, f"{w}.step[{k}]", clusters) for k, p in enumerate(step)]
        init = [_phase(j["init"], f"{w}.init", clusters, "init")] if j.get("init") is not None else []
        total += len(init) + len(one) * steps
        if total > max_phases:
            raise TraceError(f"{w}.steps: {steps:,} steps of {len(one)} phases bring the trace to {total:,} phases; "
                             f"the simulator runs at most {max_phases:,} (max_phases)")
        jobs.append(JobSpec(name, _num(j.get("arrival_s", 0.0), f"{w}.arrival_s"), j["clusters"], init + one * steps))
    return Trace(cap, jobs, _num(src.get("aging_s", 60.0), "aging_s", 0.0, strict=True),
                 _num(src.get("yield_cost_s", 0.0), "yield_cost_s"))


@dataclasses.dataclass
class _Run:  # a job's progress
    spec: JobSpec
    i: int = 0  # index of its current phase
    left: float = 0.0  # nominal seconds left of the current phase
    req: int | None = None
    lease: int | None = None
    since: float | None = None  # the rollout's first request time (its age survives yields)
    finish: float | None = None


def simulate(trace: Trace, policy: str = "phase", max_events: int = 10_000_000, on_decision=None) -> dict:
    """Run the trace; returns the headline metrics, per-job results, spans and yields.
    on_decision(policy, now, decision), if given, is called after every scheduling pass
    (the tests audit the policy's books there)."""
    pol = make_policy(policy, trace.capacity, trace.aging_s)
    runs = {j.name: _Run(j) for j in trace.jobs}
    arrivals = sorted(trace.jobs, key=lambda j: (j.arrival_s, j.name))
    spans: dict[int, mx.Span] = {}
    yields: list[tuple[float, int, str]] = []
    t, k = 0.0, 0
    t0 = min(j.arrival_s for j in trace.jobs)

    def ask(run: _Run, now: float) -> None:
        ph = run.spec.phases[run.i]
        n = parse_clusters(run.spec.clusters)[ph.cluster].devices
        r = pol.request(run.spec.name, ph.phase, ph.cluster, mem=ph.mem, work=run.left * n, now=now,
                        since=run.since if ph.phase == "rollout" else None)
        run.req = r.id
        if ph.phase == "rollout" and run.since is None:
            run.since = now

    def end_lease(run: _Run, now: float, reason: str) -> None:
        pol.release(run.lease)
        spans[run.lease].end, spans[run.lease].reason = now, reason
        run.lease = None

    for _ in range(max_events):
        while k < len(arrivals) and arrivals[k].arrival_s <= t:
            run = runs[arrivals[k].name]
            try:
                pol.add_job(run.spec.name, run.spec.clusters)
            except PolicyError as e:
                raise TraceError(f"job {run.spec.name!r}: {e}") from None
            run.left = run.spec.phases[0].seconds
            ask(run, t)
            k += 1
        for _ in range(1000):  # grants and yields settle at one instant
            dec = pol.schedule(t)
            if on_decision is not None:
                on_decision(pol, t, dec)
            for le in dec.grants:
                if le.id in spans:  # a rollout grown within this decision
                    spans[le.id].devices, spans[le.id].mem = le.devices, le.mem
                    continue
                spans[le.id] = mx.Span(le.id, le.job, le.phase, le.cluster, le.devices, le.mem, t)
                if le.phase != RESIDENT:
                    runs[le.job].lease, runs[le.job].req = le.id, None
            for lid in dec.yields:  # the job stops at its next step boundary: here, at once
                run = runs[spans[lid].job]
                yields.append((t, lid, run.spec.name))
                end_lease(run, t, "yielded")
                run.left += trace.yield_cost_s
                ask(run, t)
            if not dec.grants and not dec.yields:
                break
        rate = _rates(pol, runs, spans)
        nxt = arrivals[k].arrival_s if k < len(arrivals) else math.inf
        ends = {name: t + r.left / rate[r.lease] for name, r in runs.items() if r.lease is not None}
        t_next = min([nxt, *ends.values()])
        if t_next == math.inf:
            break
        for r in runs.values():
            if r.lease is not None:
                r.left = max(0.0, r.left - (t_next - t) * rate[r.lease])
        t = t_next
        for name in sorted(ends, key=lambda n: (ends[n], n)):
            r = runs[name]
            if ends[name] > t and r.left > 1e-9:
                continue
            end_lease(r, t, "released")
            r.i, r.since = r.i + 1, None
            if r.i == len(r.spec.phases):
                r.finish = t
                for le in pol.remove_job(name):
                    spans[le.id].end, spans[le.id].reason = t, "finished"
            else:
                r.left = r.spec.phases[r.i].seconds
                ask(r, t)
    else:
        raise RuntimeError("simulation did not finish within max_events")
    stuck = [n for n, r in runs.items() if r.finish is None]
    if stuck:
        raise RuntimeError(f"jobs never finished (a policy bug): {', '.join(stuck)}")
    t1 = max(r.finish for r in runs.values())
    jobs = [{"name": n, "arrival": r.spec.arrival_s, "finish": r.finish} for n, r in runs.items()]
    out = {"policy": policy, **mx.summarize(list(spans.values()), trace.capacity, jobs, t0, t1),
           "yields": len(yields),
           "jobs": [{"name": j["name"], "arrival_s": j["arrival"], "finish_s": j["finish"],
                     "latency_s": j["finish"] - j["arrival"]} for j in jobs]}
    out["_spans"], out["_yields"], out["_devices"] = list(spans.values()), yields, len(trace.capacity)
    return out


def _rates(pol, runs: dict[str, _Run], spans: dict[int, mx.Span]) -> dict[int, float]:
    """Nominal seconds of work done per second by each running phase (contention: see the
    module docstring)."""
    util, bw = [0.0] * len(pol.capacity), [0.0] * len(pol.capacity)
    active = {}
    for r in runs.values():
        if r.lease is not None:
            ph = r.spec.phases[r.i]
            active[r.lease] = (r, ph)
            for d in spans[r.lease].devices:
                util[d] += ph.util
                bw[d] += ph.bw
    rate = {}
    for lid, (r, ph) in active.items():
        devs = spans[lid].devices
        speed = min(1.0 / max(1.0, util[d], bw[d]) for d in devs)
        if ph.phase == "rollout":
            speed *= len(devs) / parse_clusters(r.spec.clusters)[ph.cluster].devices
        rate[lid] = speed
    return rate


def report(res: dict) -> str:
    keys = ("makespan_s", "gpu_idle_frac", "jobs_per_hour", "mean_latency_s")
    return "\n".join(f"{k:<15} {res[k]:.4f}" for k in keys)


def public(res: dict) -> dict:
    """The result without its private span list (what --json prints)."""
    return {k: v for k, v in res.items() if not k.startswith("_")}


def trace_of(res: dict) -> dict:
    return mx.chrome_trace(res["_spans"], res["_devices"], 0.0, res["_yields"])
