"""What a schedule achieved, from its lease history: GPU idle fraction, jobs per hour, mean
job latency, memory in use and its fragmentation, and a Chrome/Perfetto trace.

The simulator and the service both keep a list of `Span`s (one per lease, with its start
and end) and call `summarize`; only phase leases count as work: a `resident` lease holds
memory but runs nothing.

- gpu_idle_frac: the fraction of device-time in [t0, t1] during which no phase lease is on
  the device.
- mem_used_frac: time-averaged sum of leased memory over the pool's capacity.
- frag: external fragmentation of the free memory, 1 - (largest free on one device) /
  (total free), time-averaged; 0 when everything free is on one device (or nothing is free).

`summarize` walks a span list (the simulator, the benches); the service keeps a `Tally`
instead, the same integrals advanced at every lease change, so its metrics cost O(devices)
however long its history (pruned history stays counted in the tally).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

RESIDENT = "resident"


@dataclasses.dataclass
class Span:
    id: int
    job: str
    phase: str
    cluster: str
    devices: tuple[int, ...]
    mem: tuple[float, ...]
    start: float
    end: float | None = None  # None: still held
    reason: str = ""  # how it ended: released, yielded, reclaimed, cancelled, finished

    def copy(self) -> Tally:
        t = Tally.__new__(Tally)  # (taken before every change, to put back on a failure: no __init__)
        t.__dict__.update({f: v[:] if isinstance(v, list) else v for f, v in self.__dict__.items()})
        return t

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["devices"], d["mem"] = list(self.devices), list(self.mem)
        return d


def _union_length(ivs: list[tuple[float, float]]) -> float:
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(ivs):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _clip(s: Span, t0: float, t1: float) -> tuple[float, float] | None:
    a, b = max(s.start, t0), min(t1 if s.end is None else s.end, t1)
    return (a, b) if b > a else None


def idle_fraction(spans: list[Span], n_devices: int, t0: float, t1: float) -> float:
    if t1 <= t0 or n_devices == 0:
        return 0.0
    busy = 0.0
    for d in range(n_devices):
        ivs = [iv for s in spans if s.phase != RESIDENT and d in s.devices and (iv := _clip(s, t0, t1))]
        busy += _union_length(ivs)
    return max(0.0, 1.0 - busy / (n_devices * (t1 - t0)))


def memory_stats(spans: list[Span], capacity: list[float], t0: float, t1: float) -> dict:
    """Time-averaged memory in use and fragmentation over [t0, t1], and the peak in use."""
    if t1 <= t0:
        return {"mem_used_frac": 0.0, "mem_peak": [0.0] * len(capacity), "frag": 0.0}
    events = []  # (time, device, +mem / -mem)
    for s in spans:
        iv = _clip(s, t0, t1)
        if iv is None:
            continue
        for d, m in zip(s.devices, s.mem):
            events.append((iv[0], 1, d, m))
            events.append((iv[1], 0, d, -m))
    events.sort()
    used = [0.0] * len(capacity)
    peak = [0.0] * len(capacity)
    cap = sum(capacity)
    t, used_int, frag_int = t0, 0.0, 0.0
    for time, _, d, dm in events + [(t1, 0, 0, 0.0)]:
        if time > t:
            free = [c - u for c, u in zip(capacity, used)]
            tot = sum(max(f, 0.0) for f in free)
            frag = 1.0 - max(free) / tot if tot > 1e-12 else 0.0
            used_int += sum(used) / cap * (time - t)
            frag_int += frag * (time - t)
            t = time
        used[d] += dm
        peak[d] = max(peak[d], used[d])
    return {"mem_used_frac": used_int / (t1 - t0), "mem_peak": peak, "frag": frag_int / (t1 - t0)}


def summarize(spans: list[Span], capacity: list[float], jobs: list[dict], t0: float, t1: float) -> dict:
    """jobs: [{"name", "arrival", "finish" (None while running)}]. Returns the headline metrics."""
    done = [j for j in jobs if j.get("finish") is not None]
    span = max(t1 - t0, 1e-12)
    out = {
        "makespan_s": t1 - t0,
        "gpu_idle_frac": idle_fraction(spans, len(capacity), t0, t1),
        "jobs_per_hour": len(done) / span * 3600.0,
        "mean_latency_s": sum(j["finish"] - j["arrival"] for j in done) / len(done) if done else 0.0,
        "jobs_done": len(done),
    }
    out.update(memory_stats(spans, capacity, t0, t1))
    return out


def _frag(capacity: list[float], used: list[float]) -> float:
    free = [c - u for c, u in zip(capacity, used)]
    tot = sum(max(f, 0.0) for f in free)
    return 1.0 - max(free) / tot if tot > 1e-12 else 0.0


@dataclasses.dataclass
class Tally:
    """The running integrals behind `summarize`, from `t0` to `t`: per device the phase leases
    on it and the memory leased; integrated busy device-time, memory and fragmentation;
    finished jobs and their latencies; yields. `add` / `remove` a lease at time `now` (times
    that go backwards count as no time), `result(now)` gives summarize's numbers."""

    capacity: list[float]
    t0: float
    t: float = 0.0
    busy_n: list[int] = dataclasses.field(default_factory=list)  # phase leases per device
    used: list[float] = dataclasses.field(default_factory=list)
    peak: list[float] = dataclasses.field(default_factory=list)
    busy_int: float = 0.0
    used_int: float = 0.0
    frag_int: float = 0.0
    jobs_done: int = 0
    latency_sum: float = 0.0
    yields: int = 0

    def __post_init__(self):
        n = len(self.capacity)
        self.t = max(self.t, self.t0)
        self.busy_n = self.busy_n or [0] * n
        self.used = self.used or [0.0] * n
        self.peak = self.peak or [0.0] * n

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt <= 0:
            return
        self.busy_int += sum(1 for b in self.busy_n if b > 0) * dt
        self.used_int += sum(self.used) / sum(self.capacity) * dt
        self.frag_int += _frag(self.capacity, self.used) * dt
        self.peak = [max(p, u) for p, u in zip(self.peak, self.used)]  # a state held for no time is no peak
        self.t = now

    def add(self, s: Span, now: float) -> None:
        self.advance(now)
        for d, m in zip(s.devices, s.mem):
            self.used[d] += m
            self.busy_n[d] += s.phase != RESIDENT

    def remove(self, s: Span, now: float) -> None:
        self.advance(now)
        for d, m in zip(s.devices, s.mem):
            self.used[d] = max(0.0, self.used[d] - m)
            if self.used[d] < 1e-9:
                self.used[d] = 0.0
            self.busy_n[d] -= s.phase != RESIDENT

    def job_done(self, arrival: float, finish: float) -> None:
        self.jobs_done += 1
        self.latency_sum += finish - arrival

    def restart(self, t0: float) -> None:
        """Begin the integrals again at t0 (the first job's arrival), keeping the leases held."""
        self.t0 = self.t = t0
        self.busy_int = self.used_int = self.frag_int = 0.0
        self.peak = [0.0] * len(self.capacity)

    def result(self, now: float) -> dict:
        """summarize()'s numbers over [t0, now] (without makespan_s)."""
        t = max(now, self.t)
        dt = t - self.t
        busy = self.busy_int + sum(1 for b in self.busy_n if b > 0) * dt
        used = self.used_int + sum(self.used) / sum(self.capacity) * dt
        frag = self.frag_int + _frag(self.capacity, self.used) * dt
        peak = [max(p, u) for p, u in zip(self.peak, self.used)] if dt > 0 else list(self.peak)
        span = t - self.t0
        ok = span > 0
        return {"gpu_idle_frac": max(0.0, 1.0 - busy / (len(self.capacity) * span)) if ok else 0.0,
                "jobs_per_hour": self.jobs_done / max(span, 1e-12) * 3600.0,
                "mean_latency_s": self.latency_sum / self.jobs_done if self.jobs_done else 0.0,
                "jobs_done": self.jobs_done, "mem_used_frac": used / span if ok else 0.0,
                "mem_peak": peak if ok else [0.0] * len(self.capacity), "frag": frag / span if ok else 0.0}

    def copy(self) -> Tally:
        t = Tally.__new__(Tally)  # (taken before every change, to put back on a failure: no __init__)
        t.__dict__.update({f: v[:] if isinstance(v, list) else v for f, v in self.__dict__.items()})
        return t

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}  # flat: no deep copy

    @classmethod
    def from_dict(cls, d: dict) -> Tally:
        return cls(**d)


def chrome_trace(spans: list[Span], n_devices: int, t0: float = 0.0, yields: list[tuple[float, int, str]] = (),
                 now: float | None = None) -> dict:
    """Chrome/Perfetto trace JSON: one process per device, one thread per job, one slice per
    lease and device (resident leases under category "resident"); yield requests as instants."""
    us = lambda x: round((x - t0) * 1e6, 3)  # noqa: E731
    end_default = now if now is not None else max([s.end or s.start for s in spans] + [t0])
    ev = [{"ph": "M", "name": "process_name", "pid": d, "args": {"name": f"device {d}"}} for d in range(n_devices)]
    tids: dict[str, int] = {}
    for s in sorted(spans, key=lambda s: (s.start, s.id)):
        tid = tids.setdefault(s.job, len(tids) + 1)
        end = s.end if s.end is not None else end_default
        for d, m in zip(s.devices, s.mem):
            ev.append({"ph": "X", "name": s.phase if s.phase != RESIDENT else f"resident:{s.cluster}",
                       "cat": RESIDENT if s.phase == RESIDENT else "phase", "pid": d, "tid": tid,
                       "ts": us(s.start), "dur": max(us(end) - us(s.start), 0.0),
                       "args": {"job": s.job, "cluster": s.cluster, "mem": m, "lease": s.id, "end": s.reason}})
    for d in range(n_devices):
        for job, tid in tids.items():
            ev.append({"ph": "M", "name": "thread_name", "pid": d, "tid": tid, "args": {"name": job}})
    for t, lease_id, job in yields:
        ev.append({"ph": "i", "s": "g", "name": f"yield {job} lease {lease_id}", "ts": us(t), "pid": 0, "tid": 0})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, trace: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(trace))
    return p
