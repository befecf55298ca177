"""The scheduling policy under random workloads (books balance, priorities hold, nobody
starves, decisions are deterministic), its refusals, and the simulator: fifo vs phase."""

import json
import random
from pathlib import Path

import pytest

from rlcu.sched.policy import PHASES, RESIDENT, FifoPolicy, PhasePolicy, PolicyError, check_invariants, make_policy
from rlcu.sched.simulator import TraceError, load_trace, public, simulate, trace_of

ROOT = Path(__file__).resolve().parents[2]


def random_trace(seed: int) -> dict:
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    shared = rng.random() < 0.6  # memory given: phases may share devices
    cap = 80.0
    jobs = []
    for j in range(rng.randint(2, 7)):
        if shared and rng.random() < 0.6:
            k = rng.randint(1, n)
            res = rng.choice([0.0, 5.0, 20.0])
            peak = rng.choice([30.0, 50.0])
            clusters = {"actor": {"devices": k, "resident": res, "peak": peak}}
            names = ["actor"]
        else:
            k = rng.randint(1, n)  # fifo needs every cluster's devices at once: they must fit the pool
            parts = [k] if k == 1 or rng.random() < 0.5 else [k - k // 2, k // 2]
            clusters = {f"c{i}": m for i, m in enumerate(parts)}
            names, peak = list(clusters), cap
        step = []
        for ph in rng.sample(PHASES[1:], rng.randint(1, 4)):
            d = {"phase": ph, "cluster": rng.choice(names), "seconds": rng.randint(1, 30)}
            if shared:
                d["mem"] = float(rng.randint(1, int(peak)))
                d["util"] = rng.choice([0.3, 0.5, 1.0])
            step.append(d)
        job = {"name": f"j{j}", "arrival_s": rng.randint(0, 60), "steps": rng.randint(1, 4),
               "clusters": clusters, "step": step}
        if rng.random() < 0.3:
            job["init"] = {"cluster": names[0], "seconds": 3, **({"mem": 2.0} if shared else {})}
        jobs.append(job)
    dev = {"count": n, "mem": cap} if shared else n
    return {"devices": dev, "jobs": jobs, "aging_s": rng.choice([5, 30, 120]), "yield_cost_s": rng.choice([0, 1])}


def tight_trace(seed: int) -> dict:
    """Memory-tight mixes: jobs with one or two resident clusters (placed together) or
    floating ones, peaks close to the device, phases up to the peak."""
    rng = random.Random(seed)
    n, cap = rng.randint(1, 3), 80.0
    jobs = []
    for j in range(rng.randint(3, 9)):
        clusters = {}
        for c in range(rng.choice([1, 1, 2])):
            res = rng.choice([0.0, 10.0, 25.0, 40.0])
            clusters[f"k{c}"] = {"devices": rng.randint(1, n), "resident": res,
                                 "peak": min(rng.choice([10.0, 30.0, 40.0]), cap - res)}
        step = []
        for ph in rng.sample(PHASES[1:], rng.randint(1, 4)):
            cn = rng.choice(list(clusters))
            step.append({"phase": ph, "cluster": cn, "seconds": rng.randint(1, 20),
                         "mem": float(rng.randint(1, int(clusters[cn]["peak"]))), "util": rng.choice([0.3, 1.0])})
        job = {"name": f"j{j}", "arrival_s": rng.randint(0, 40), "steps": rng.randint(1, 3), "clusters": clusters,
               "step": step}
        if rng.random() < 0.5:
            job["init"] = {"cluster": "k0", "seconds": 2, "mem": 1.0}
        jobs.append(job)
    return {"devices": {"count": n, "mem": cap}, "jobs": jobs, "aging_s": rng.choice([5, 60]), "yield_cost_s": 1}


def audit(pol, now, dec):
    """Per decision: the books balance; a second pass at the same instant changes nothing
    (every request that could be granted was); no grant of a worse score than a blocked
    request took memory that request had reserved."""
    check_invariants(pol)
    again = pol.schedule(now)
    assert not again.grants and not again.yields, f"a second pass at t={now} still granted {again.grants}"
    if not isinstance(pol, PhasePolicy):
        return
    granted = [g for g in dec.grants if g.phase != RESIDENT]
    for rid, tgt in pol.targets.items():
        r = pol.pending[rid]
        s = pol.score(r, now)
        for d, need in tgt.items():
            if pol.free(d) + 1e-9 >= need:
                continue
            worse = [g for g in granted if d in g.devices and pol.score(g.request, now) > s]
            assert not worse, f"lease {worse[0]} of a worse score took device {d} reserved by request {r}"


@pytest.mark.parametrize("policy", ["phase", "fifo"])
def test_random_workloads_invariants_and_completion(policy):
    for seed in range(40):
        tr = load_trace(random_trace(seed))
        seen = []
        res = simulate(tr, policy, on_decision=lambda p, t, d, seen=seen: (seen.append(p), audit(p, t, d)))
        pol = seen[-1]
        assert not pol.leases and not pol.pending and not pol.jobs and pol.used == [0.0] * len(tr.capacity)
        assert res["jobs_done"] == len(tr.jobs)
        assert 0.0 <= res["gpu_idle_frac"] <= 1.0
        assert all(p <= c + 1e-6 for p, c in zip(res["mem_peak"], tr.capacity))
        # every lease was released by the end, so all capacity is back
        assert all(s.end is not None for s in res["_spans"])


def test_memory_tight_mixes_never_deadlock():
    ran = 0
    for seed in range(150):
        try:
            tr = load_trace(tight_trace(seed))
            simulate(tr, "phase", on_decision=audit)  # raises if a job never finishes
            ran += 1
        except TraceError as e:  # a job whose residents cannot all fit the pool is refused up front
            assert "do not fit together" in str(e)
    assert ran > 60


def test_deterministic():
    tr = random_trace(7)
    a, b = simulate(load_trace(tr), "phase"), simulate(load_trace(tr), "phase")
    assert public(a) == public(b)
    assert [s.to_dict() for s in a["_spans"]] == [s.to_dict() for s in b["_spans"]]


def test_priorities_order_and_fifo_within_priority():
    p = PhasePolicy([1.0], aging_s=1e9)
    for j in "abcd":
        p.add_job(j, {"c": 1})
    p.request("a", "rollout", now=0)
    p.request("b", "values", now=1)
    p.request("c", "actor_train", now=2)
    p.request("d", "actor_train", now=3)
    order = []
    t = 4.0
    while p.pending or p.leases:
        for g in p.schedule(t).grants:
            order.append(g.job)
        for lid in sorted(p.leases):
            p.release(lid)
        t += 1
    assert order == ["c", "d", "b", "a"]


def test_aging_prevents_starvation():
    """A rollout behind an endless stream of training phases still runs, once it has aged."""
    p = PhasePolicy([1.0], aging_s=10.0)
    for j in ("low", "h1", "h2"):
        p.add_job(j, {"c": 1})
    p.request("low", "rollout", now=0)
    for j in ("h1", "h2"):
        p.request(j, "actor_train", now=0)
    ran_at = None
    for t in range(0, 400, 5):
        for g in p.schedule(float(t)).grants:
            if g.job == "low":
                ran_at = t
        if ran_at is not None:
            break
        for lid, le in sorted(p.leases.items()):
            p.release(lid)
            p.request(le.job, "actor_train", now=float(t))  # at once: the stream never stops
    assert ran_at is not None and ran_at <= 6 * 10 + 10


def test_yield_and_sharing_on_one_gpu():
    p = PhasePolicy([80.0])
    p.add_job("a", {"actor": {"devices": 1, "resident": 10, "peak": 40}})
    p.add_job("b", {"actor": {"devices": 1, "resident": 10, "peak": 40}})
    p.request("a", "init", mem=1, now=0)
    p.request("b", "init", mem=1, now=0)
    assert {g.job for g in p.schedule(0).grants} == {"a", "b"}  # both placed: 10+10+40 <= 80
    for lid in [i for i, le in p.leases.items() if le.phase == "init"]:
        p.release(lid)
    p.request("a", "rollout", mem=30, now=1)
    p.request("b", "rollout", mem=30, now=1)
    dec = p.schedule(1)
    assert len(dec.grants) == 2 and p.used[0] == 80  # two rollouts share the GPU
    p.request("a", "actor_train", mem=40, now=2)  # a's own rollout is over
    rid = [i for i, le in p.leases.items() if le.job == "a" and le.phase == "rollout"][0]
    p.release(rid)
    dec = p.schedule(2)
    # 30 free < 40: b's rollout holds the rest and is told to yield
    assert not dec.grants and len(dec.yields) == 1 and p.leases[dec.yields[0]].job == "b"
    assert not p.schedule(2).yields  # asked once
    p.release(dec.yields[0])
    p.request("b", "rollout", mem=30, now=3, since=1)
    dec = p.schedule(3)
    assert [(g.job, g.phase) for g in dec.grants] == [("a", "actor_train")]  # b's rollout waits
    check_invariants(p)


def test_placement_refuses_deadlock():
    """Two jobs whose residents leave too little for either one's peak are not co-placed."""
    p = PhasePolicy([80.0])
    p.add_job("a", {"actor": {"devices": 1, "resident": 30, "peak": 30}})
    p.add_job("b", {"actor": {"devices": 1, "resident": 30, "peak": 30}})
    p.request("a", "init", mem=1, now=0)
    p.request("b", "init", mem=1, now=0)
    assert [g.job for g in p.schedule(0).grants if g.phase == "init"] == ["a"]
    p.remove_job("a")
    assert [g.job for g in p.schedule(1).grants if g.phase == "init"] == ["b"]


def test_rollout_elastic_split_by_work():
    p = PhasePolicy([1.0] * 6)
    p.add_job("a", {"c": 2})
    p.add_job("b", {"c": 2})
    p.request("a", "rollout", work=100, now=0)
    p.request("b", "rollout", work=50, now=0)
    dec = p.schedule(0)
    n = {g.job: len(g.devices) for g in dec.grants}
    assert n == {"a": 4, "b": 2}  # 6 devices, split 2:1 by remaining work
    check_invariants(p)


@pytest.mark.parametrize("call, msg", [
    (lambda p: p.request("nope", "rollout"), "unknown job"),
    (lambda p: p.request("a", "warmup"), "unknown phase"),
    (lambda p: p.request("a", "rollout", "critic"), "no cluster"),
    (lambda p: p.request("a", "actor_train", devices=3), "the pool has 2"),
    (lambda p: p.request("a", "actor_train", mem=100), "only 0 devices have that much"),
    (lambda p: p.request("a", "actor_train", mem=-1), "mem must be"),
    (lambda p: p.release(999), "no lease 999"),
    (lambda p: p.add_job("a", {"c": 1}), "already exists"),
    (lambda p: p.add_job("z", {"c": 5}), "the pool has 2"),
    (lambda p: p.add_job("z", {"c": {"devices": 1, "resident": 90}}), "largest device"),
    (lambda p: p.add_job("z", {}), "non-empty"),
])
def test_refusals(call, msg):
    p = PhasePolicy([80.0, 80.0])
    p.add_job("a", {"c": 2})
    with pytest.raises(PolicyError, match=msg):
        call(p)


def test_double_release_and_double_request():
    p = PhasePolicy([1.0])
    p.add_job("a", {"c": 1})
    p.request("a", "actor_train")
    with pytest.raises(PolicyError, match="already holds or awaits"):
        p.request("a", "actor_train")
    (g,) = p.schedule(0).grants
    p.release(g.id)
    with pytest.raises(PolicyError, match="already released"):
        p.release(g.id)


def test_fifo_one_job_after_another():
    p = FifoPolicy([1.0, 1.0])
    p.add_job("a", {"x": 1, "y": 1})
    p.add_job("b", {"x": 1})
    p.request("a", "rollout", "x")
    p.request("b", "rollout", "x")
    got = [(g.job, g.phase) for g in p.schedule(0).grants]
    assert got == [("a", RESIDENT), ("a", RESIDENT), ("a", "rollout")]  # b waits for whole devices
    p.remove_job("a")
    assert ("b", "rollout") in [(g.job, g.phase) for g in p.schedule(1).grants]
    with pytest.raises(PolicyError):
        make_policy("lifo", [1.0])


def test_simulator_sample_trace_phase_beats_fifo(tmp_path):
    tr = load_trace(ROOT / "examples" / "sched_trace.json")
    fifo, phase = simulate(tr, "fifo"), simulate(tr, "phase")
    assert phase["jobs_per_hour"] >= 2 * fifo["jobs_per_hour"]
    assert phase["gpu_idle_frac"] < 0.05 < fifo["gpu_idle_frac"]
    assert phase["mean_latency_s"] < fifo["mean_latency_s"]
    ev = trace_of(phase)["traceEvents"]
    assert any(e["ph"] == "X" and e["name"] == "rollout" for e in ev)


def test_simulator_issue_form_and_cli(tmp_path, capsys):
    tr = {"devices": 4, "jobs": [{"name": "a", "arrival_s": 0, "steps": 20,
                                  "clusters": {"actor_infer": 2, "actor_train": 2},
                                  "step": [{"phase": "rollout", "cluster": "actor_infer", "seconds": 30},
                                           {"phase": "actor_train", "cluster": "actor_train", "seconds": 10}]}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(tr))
    from rlcu.sched.cli import main

    out = tmp_path / "chrome.json"
    assert main(["sched", "simulate", str(path), "--policy", "fifo", "--json", "--trace-out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["makespan_s"] == pytest.approx(800.0) and res["gpu_idle_frac"] == pytest.approx(0.5)
    assert json.loads(out.read_text())["traceEvents"]
    assert main(["sched", "simulate", str(path), "--policy", "phase"]) == 0
    text = capsys.readouterr().out
    for key in ("makespan_s", "gpu_idle_frac", "jobs_per_hour", "mean_latency_s"):
        assert key in text
    ph = simulate(load_trace(path), "phase")  # rollout widens to all 4 devices: 15 s + 10 s a step
    assert ph["makespan_s"] == pytest.approx(500.0) and ph["jobs_per_hour"] == pytest.approx(7.2)


@pytest.mark.parametrize("bad, msg", [
    ({"devices": 0, "jobs": []}, "devices must be"),
    ({"devices": 2, "jobs": [{"clusters": {"a": 1}, "step": [{"phase": "train", "seconds": 1}]}]}, "phase must"),
    ({"devices": 2, "jobs": [{"clusters": {"a": 1}, "step": [{"phase": "rollout", "seconds": -1}]}]}, "seconds"),
    ({"devices": 2, "jobs": [{"clusters": {"a": 1}, "step": [{"phase": "rollout", "cluster": "b", "seconds": 1}]}]},
     "cluster must"),
    ({"devices": 2, "jobs": [{"clusters": {"a": 1}, "stpe": []}]}, "stpe is not a job key"),
    ({"devices": 2, "gpus": 1, "jobs": []}, "gpus is not a trace key"),
])
def test_trace_errors(bad, msg):
    with pytest.raises(TraceError, match=msg):
        load_trace(bad)


def test_trace_job_bigger_than_pool():
    tr = load_trace({"devices": 1, "jobs": [{"clusters": {"a": 2}, "step": [{"phase": "rollout", "seconds": 1}]}]})
    with pytest.raises(TraceError, match="the pool has 1"):
        simulate(tr, "phase")


def test_big_placement_is_not_starved_by_small_ones():
    """A job whose resident memory fits only once others leave closes its device to newer
    placements, so a stream of small jobs cannot pass it forever."""
    p = PhasePolicy([100.0])
    p.add_job("small0", {"a": {"devices": 1, "resident": 20, "peak": 10}})
    p.request("small0", "init", mem=1, now=0)
    p.schedule(0)
    p.add_job("big", {"a": {"devices": 1, "resident": 80, "peak": 10}})
    p.request("big", "init", mem=1, now=1)
    p.add_job("small1", {"a": {"devices": 1, "resident": 20, "peak": 10}})
    p.request("small1", "init", mem=1, now=2)
    assert not [g for g in p.schedule(2).grants if g.phase == "init"]  # small1 fits, but big came first
    p.remove_job("small0")
    assert [g.job for g in p.schedule(3).grants if g.phase == "init"] == ["big"]
    check_invariants(p)
