"""Chaos: a scheduler service and several job processes under load, on a Unix socket and on
loopback TCP; the service is killed with SIGKILL and restarted on the same state folder, job
processes are killed and replaced. The jobs that live ride every restart out (their calls are
resent with their operation ids), and afterwards the whole SQLite history holds the books'
invariants: no device's memory booked past its capacity at any instant, no phase held twice
at once by one job, nothing held or pending once every job has ended. A service whose books
fail their audit refuses the change and exits 70."""

import itertools
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.sched_util import SPEC

import rlcu.sched
from rlcu.sched.client import SchedClient, SchedError

SRC = str(Path(rlcu.sched.__file__).resolve().parents[1])
# children import the scheduler without rlcu/__init__ (which imports torch: seconds each here)
LIGHT = f"import sys, types; _p = types.ModuleType('rlcu'); _p.__path__ = [{SRC!r}]; sys.modules['rlcu'] = _p\n"
SERVE = LIGHT + "from rlcu.sched.cli import main\nsys.exit(main(sys.argv[1:]))\n"
TOKEN = "chaos-token"
CAP = 10.0
JOB = r"""
import os, random, sys, time
from rlcu.sched.client import SchedClient, SchedError
addr, name, until, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
end = time.time() + 10
while True:  # first contact (the service may be restarting right now)
    try:
        c = SchedClient(addr, os.environ["RLCU_SCHED_TOKEN"], retry_s=15)
        c.ping()
        break
    except SchedError:
        if time.time() > end:
            raise
        time.sleep(0.1)
k = cycles = 0
while time.time() < until:
    k += 1
    job = c.job(f"{name}-{k}", {"c": {"devices": 1, "resident": 1.0, "peak": 6.0}}, heartbeat_s=0.2, poll_s=0.0)
    for _ in range(rng.randint(3, 8)):
        lease = job.acquire(rng.choice(["rollout", "actor_train", "ref_logprobs"]), mem=rng.choice([2.0, 3.0, 5.0]))
        time.sleep(rng.random() * 0.01)
        job.should_yield(lease)
        job.release(lease)
        cycles += 1
    job.finish()
print(cycles, c.retries, flush=True)
"""


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Service:
    def __init__(self, state: Path, addr: str):
        self.state, self.addr, self.proc, self.starts = state, addr, None, 0
        self.env = dict(os.environ, RLCU_SCHED_TOKEN=TOKEN)

    def start(self) -> None:
        self.starts += 1
        log = open(self.state.parent / f"service{self.starts}.log", "wb")  # noqa: SIM115  (the child keeps it)
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, "sched", "serve", "--cpu-slots", "2", "--mem",
                                      str(CAP), "--state", str(self.state), "--addr", self.addr,
                                      "--heartbeat-timeout", "2"], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        end = time.monotonic() + 20
        while True:  # up (a first contact gives up after 2 s: a loaded machine may take longer)
            try:
                SchedClient(self.addr, TOKEN, retry_s=10, timeout=5).ping()
                return
            except SchedError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def audit(db_path: Path) -> dict:
    """The invariants over the whole history, from SQLite alone."""
    db = sqlite3.connect(db_path)
    cap = json.loads(db.execute("SELECT value FROM meta WHERE key='pool'").fetchone()[0])["capacity"]
    rows = db.execute("SELECT id, job, phase, cluster, devices, mem, start, end, reason FROM leases").fetchall()
    jobs = dict(db.execute("SELECT name, state FROM jobs").fetchall())
    pending = db.execute("SELECT count(*) FROM requests").fetchone()[0]
    db.close()
    assert rows, "no lease in the history"
    leaked = [r for r in rows if r[7] is None]
    assert not leaked, f"{len(leaked)} leases still held after every job ended: {leaked[:3]}"
    assert pending == 0, f"{pending} requests still pending after every job ended"
    live = {n: s for n, s in jobs.items() if s in ("queued", "running")}
    assert not live, f"jobs still live: {live}"
    events = []
    for _, _, _, _, devs, mem, start, end, _ in rows:
        for d, m in zip(json.loads(devs), json.loads(mem)):
            events += [(start, 1, d, m), (end, 0, d, -m)]  # at one instant, ends before starts
    used = [0.0] * len(cap)
    for t, _, d, m in sorted(events):
        used[d] += m
        assert used[d] <= cap[d] + 1e-6, f"device {d} booked {used[d]:g} > {cap[d]:g} at t={t}"
    held = {}
    for lid, job, phase, cluster, _, _, start, end, _ in rows:
        held.setdefault((job, phase, cluster), []).append((start, end, lid))
    for key, spans in held.items():
        spans.sort()
        for (_s0, e0, l0), (s1, _, l1) in itertools.pairwise(spans):
            assert s1 >= e0, f"job {key[0]!r} held phase {key[1]!r} twice at once (leases {l0}, {l1})"
    return {"leases": len(rows), "jobs": len(jobs), "states": sorted(set(jobs.values()))}


def test_calls_in_flight_ride_out_a_kill9_restart(tmp_path):
    """A job waiting for a phase and a release sent while the service is down both go on
    once the service is back on the same state (they used to fail, or wait out 30 s)."""
    import threading

    state = tmp_path / "state"
    svc = Service(state, f"unix:{state / 'sched.sock'}")
    svc.start()
    try:
        c = SchedClient(svc.addr, TOKEN, retry_s=20)
        holder, waiter = c.job("holder", {"c": 2}, heartbeat_s=0.2), c.job("waiter", {"c": 2}, heartbeat_s=0.2)
        held = holder.acquire("actor_train")  # both devices
        got, errs = [], []

        def run(fn, *a):
            try:
                got.append(fn(*a))
            except Exception as e:  # noqa: BLE001  (reported below)
                errs.append(e)

        w = threading.Thread(target=run, args=(waiter.acquire, "actor_train"))
        w.start()
        time.sleep(0.3)  # the waiter is in a long poll
        svc.kill9()
        r = threading.Thread(target=run, args=(holder.release, held))  # sent while the service is down
        r.start()
        time.sleep(0.5)
        t = time.monotonic()
        svc.start()
        r.join(20)
        w.join(20)
        assert not errs, errs
        lease = next(x for x in got if x is not None)  # (the release returns None)
        assert len(got) == 2 and lease.phase == "actor_train" and time.monotonic() - t < 10
        waiter.release(lease)
        holder.finish()
        waiter.finish()
        assert c.retries >= 1  # (the long poll cut by the kill; refused connects are retried inside a call)
    finally:
        svc.kill9()
    audit(state / "sched.db")


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_chaos_kill9_service_and_jobs(tmp_path, kind):
    state = tmp_path / "state"
    addr = f"unix:{state / 'sched.sock'}" if kind == "unix" else f"127.0.0.1:{free_port()}"
    svc = Service(state, addr)
    svc.start()
    rng = random.Random(13)
    until = time.time() + 7.0
    env = dict(os.environ, RLCU_SCHED_TOKEN=TOKEN)
    jobs, n = {}, 0

    def spawn():
        nonlocal n
        n += 1
        jobs[n] = subprocess.Popen([sys.executable, "-c", LIGHT + JOB, addr, f"w{n}", str(until), str(n)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    for _ in range(4):
        spawn()
    killed, plan = set(), ["service", "job"] * 4
    t_end = time.time() + 60
    try:
        for what in plan:
            time.sleep(rng.uniform(0.5, 1.0))
            if time.time() > until - 0.5:
                break
            if what == "service":
                svc.kill9()
                time.sleep(rng.uniform(0.0, 0.3))
                svc.start()
            else:
                alive = [k for k, p in jobs.items() if p.poll() is None and k not in killed]
                victim = rng.choice(alive)
                jobs[victim].send_signal(signal.SIGKILL)
                killed.add(victim)
                spawn()
        outs = {}
        for k, p in jobs.items():
            out, err = p.communicate(timeout=max(1.0, t_end - time.time()))
            if k not in killed:
                assert p.returncode == 0, f"job process w{k} failed:\n{err[-3000:]}"
                outs[k] = [int(x) for x in out.split()]
        assert svc.starts >= 3, "the chaos never restarted the service"
        assert sum(c for c, _ in outs.values()) >= 20, outs  # they got work done
        c = SchedClient(addr, TOKEN, retry_s=10)
        deadline = time.time() + 15
        while any(j["state"] in ("queued", "running") for j in c.status()["jobs"]):  # the killed ones: reclaimed
            assert time.time() < deadline, "a killed job's leases were never reclaimed"
            time.sleep(0.2)
    finally:
        for p in jobs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if svc.proc.poll() is None:
            svc.proc.send_signal(signal.SIGTERM)
            try:
                svc.proc.wait(10)
            except subprocess.TimeoutExpired:
                svc.kill9()
    got = audit(state / "sched.db")
    assert "dead" in got["states"] and "done" in got["states"], got
    try:
        SchedClient(addr, TOKEN, retry_s=0.2).ping()
        raise AssertionError("the service is still up")
    except SchedError:
        pass


def test_the_service_exits_non_zero_on_a_broken_invariant(tmp_path):
    """`rlcu sched serve` end to end: once the books fail their audit (a flag file makes the
    audit fail, through a sitecustomize), the next change is refused and the process exits 70."""
    hook = tmp_path / "hook"
    hook.mkdir()
    flag = tmp_path / "break"
    (hook / "sitecustomize.py").write_text(
        "import os, rlcu.sched.audit as a\n"
        "_real = a.check_invariants\n"
        "def _check(p):\n"
        f"    if os.path.exists({str(flag)!r}):\n"
        "        raise a.InvariantError('injected: books broken')\n"
        "    _real(p)\n"
        "a.check_invariants = _check\n")
    src = Path(__file__).resolve().parents[2] / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), str(src)]))
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "rlcu.cli", "sched", "serve", "--state", str(state),
                             "--cpu-slots", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 60
        while not (state / "sched.sock").exists():
            assert proc.poll() is None and time.monotonic() < end, proc.stderr.read().decode()
            time.sleep(0.05)
        c = SchedClient(f"unix:{state / 'sched.sock'}", retry_s=10.0)
        c.call("register", job="a", clusters=SPEC)
        flag.write_text("")
        with pytest.raises(SchedError):
            c.call("request", job="a", phase="values")
        assert proc.wait(timeout=20) == 70
        assert "FATAL: injected: books broken" in proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
