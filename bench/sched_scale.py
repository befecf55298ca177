"""The scheduler's cost at many live jobs, in process (one `Core` on a state folder, as
`rlcu sched serve` runs it, without the transport): how long building N live jobs takes, and
what one request and one status cost at that size.

Each job registers with a resident cluster and a floating one, takes `init` (which places
its residents) and holds a rollout: 3 leases a job, all granted (the pool is large enough).
At that size: `request` is an actor_train phase asked and released by a random job (its
request, grant and release: two operations), `status` lists every job. With `--backlog K`,
K more jobs each wait for a rollout that cannot fit, so every pass of the policy walks K
blocked requests.

    python bench/sched_scale.py [--jobs 1000 10000] [--devices 8] [--backlog 0]

The issue's numbers before the fix (the tester's machine): 10,000 live jobs built in 418 s,
request 51 ms, status 138 ms. JSON: bench/results/sched_scale.json (and $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = {"c": {"devices": 1, "resident": 0.001, "peak": 0.01}, "f": {"devices": 1, "peak": 0.01}}


def _ok(core, **msg) -> dict:
    r = core.handle(msg)
    if not r.get("ok"):
        raise RuntimeError(f"{msg['op']} failed: {r}")
    return r


def build(core, n: int, every: int) -> list[tuple[int, float]]:
    """n jobs; (jobs built, seconds since the start) every `every` jobs."""
    t0, marks = time.perf_counter(), []
    for i in range(n):
        _ok(core, op="register", job=f"j{i}", clusters=SPEC)
        _ok(core, op="request", job=f"j{i}", phase="init", cluster="c", mem=0.001)
        _ok(core, op="request", job=f"j{i}", phase="rollout", cluster="f", mem=0.001, devices=1)
        if (i + 1) % every == 0 or i + 1 == n:
            marks.append((i + 1, time.perf_counter() - t0))
    return marks


def backlog(core, k: int) -> None:
    """k jobs each waiting for a rollout of nearly a whole device, which cannot fit beside the
    residents (a waiting rollout asks nobody to yield)."""
    for i in range(k):
        _ok(core, op="register", job=f"w{i}", clusters={"c": {"devices": 1}})
        r = _ok(core, op="request", job=f"w{i}", phase="rollout", mem=79.99, devices=1)
        if not r["pending"]:
            raise RuntimeError("a backlog request was granted: the pool has room for it")


def per_call_ms(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def run(n: int, devices: int, k: int, calls: int) -> dict:
    from rlcu.sched.core import Core

    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="rlcu-sched-scale-") as d:
        core = Core([80.0] * devices, state=Path(d) / "sched.db", heartbeat_timeout=1e9)
        marks = build(core, n, max(1, n // 10))
        if k:
            backlog(core, k)

        def request() -> None:
            job = f"j{rng.randrange(n)}"
            v = _ok(core, op="request", job=job, phase="actor_train", cluster="c", mem=0.001)
            lid = next(le["id"] for le in v["leases"] if le["phase"] == "actor_train")
            _ok(core, op="release", job=job, lease=lid)

        req = per_call_ms(request, calls) / 2  # two operations a cycle
        status = per_call_ms(lambda: _ok(core, op="status"), max(3, calls // 20))
        metrics = per_call_ms(lambda: _ok(core, op="metrics"), calls)
        core.close()
    total = marks[-1][1]
    tenth = marks[0][1]  # the first tenth of the jobs: per job as the last tenth, when linear
    last = total - marks[-2][1] if len(marks) > 1 else total
    return {"jobs": n, "backlog": k, "devices": devices, "build_s": total, "build_ms_per_job": total / n * 1e3,
            "first_tenth_s": tenth, "last_tenth_s": last, "request_ms": req, "status_ms": status,
            "metrics_ms": metrics, "marks": marks}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--backlog", type=int, default=0, help="jobs whose request waits (each pass walks them)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sched_scale.json"))
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    rows = []
    for n in a.jobs:
        rows.append(run(n, a.devices, a.backlog, a.calls))
        r = rows[-1]
        print(f"{n:>6} jobs (backlog {a.backlog}): built in {r['build_s']:.1f} s ({r['build_ms_per_job']:.2f} ms a "
              f"job; first tenth {r['first_tenth_s']:.2f} s, last {r['last_tenth_s']:.2f} s); request "
              f"{r['request_ms']:.2f} ms, status {r['status_ms']:.1f} ms, metrics {r['metrics_ms']:.3f} ms", flush=True)
    res = {"rows": rows, "loadavg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
           "note": "in process (Core.handle, no transport); loadavg_1m: the machine's load while it ran"}
    for out in [Path(a.out)] + ([Path(os.environ["OUT"]) / "sched_scale.json"] if os.environ.get("OUT") else []):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
