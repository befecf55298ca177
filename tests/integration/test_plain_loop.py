"""examples/plain_loop.py (a plain PyTorch loop on the job API) under a real service on one CPU
slot: two loops run at once and finish; each holds rollout and actor_train leases; no slot is
double-booked in the trace; a higher phase asked while one loop samples makes it yield at
its next chunk, and it goes on."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.sched_util import services

TOKEN = "loop-t0ken"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plain_loop.py"


@pytest.fixture
def service(tmp_path):
    with services(tmp_path, TOKEN) as start:
        yield start((1.0,), device_names=["cpu0"])


def _loop(addr: str, name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(EXAMPLE), "--addr", addr, "--token", TOKEN, "--name", name,
                             "--steps", "6", "--batch", "6", "--chunk", "16", "--heartbeat-s", "0.5", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _yielded(c, job: str) -> bool:
    return any(e["ph"] == "X" and e["args"]["job"] == job and e["name"] == "rollout" and e["args"]["end"] == "yielded"
               for e in c.trace()["traceEvents"])


def test_two_plain_loops_and_a_yield(service):
    srv, c = service
    procs = {"loop-a": _loop(srv.address, "loop-a", "--chunk-s", "0.05"), "loop-b": _loop(srv.address, "loop-b")}
    # once loop-a samples, a hog asks for 0.8 of the slot (more than is ever free beside a
    # rollout): loop-a's rollout must yield at its next chunk (asked again should the hog
    # have come just as that rollout ended)
    hog = c.job("hog", {"h": 1})
    for _ in range(5):
        end = time.monotonic() + 60
        while not any(j["job"] == "loop-a" and j["phases"] == ["rollout"] for j in c.status()["jobs"]):
            assert time.monotonic() < end and procs["loop-a"].poll() is None, "loop-a never sampled"
            time.sleep(0.02)
        hog.release(hog.acquire("actor_train", mem=0.8, timeout=30))
        if _yielded(c, "loop-a"):
            break
    hog.finish()
    outs = {}
    for name, p in procs.items():
        outs[name] = p.communicate(timeout=60)[0]
        assert p.returncode == 0, outs[name]
        assert f"plain_loop {name}: 6 steps" in outs[name]
    jobs = {j["job"]: j["state"] for j in c.status()["jobs"]}
    assert jobs == {"loop-a": "done", "loop-b": "done", "hog": "done"}
    ev = [e for e in c.trace()["traceEvents"] if e["ph"] == "X"]
    for name in procs:
        assert {"init", "rollout", "actor_train", "resident:actor"} <= {e["name"] for e in ev
                                                                        if e["args"]["job"] == name}
    assert _yielded(c, "loop-a")
    assert "yields 0" not in outs["loop-a"]
    for e0 in ev:  # one slot of 1.0: what is live at any lease's start fits
        live = sum(e["args"]["mem"] for e in ev if e["ts"] <= e0["ts"] < e["ts"] + e["dur"])
        assert live <= 1.0 + 1e-6, (e0, live)
