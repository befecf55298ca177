"""The audit of the scheduler's books: its checks are code, not `assert`s (`python -O` removed
them, and the service then served broken books), and the audit after each change, which looks
only at what changed when the pool is large, still catches every kind of broken book the
full one does; the full one also checks the per-job indexes and the placement aggregates."""

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest
from support.sched_util import ok

import rlcu.sched
from rlcu.sched.core import Core
from rlcu.sched.policy import PhasePolicy, check_invariants

SPEC = {"c": {"devices": 1, "resident": 0.01, "peak": 0.05}, "f": {"devices": 1, "peak": 0.05}}


def test_no_assert_in_the_library():
    """Every invariant is a real check (the scheduler's InvariantError, the engine's books'
    RuntimeError): python -O removes asserts. The whole library, not only rlcu.sched."""
    root = Path(rlcu.sched.__file__).parent.parent
    found = []
    for f in sorted(root.rglob("*.py")):
        found += [f"{f.relative_to(root)}:{n.lineno}" for n in ast.walk(ast.parse(f.read_text()))
                  if isinstance(n, ast.Assert)]
    assert not found, f"assert statements in rlcu (gone under python -O): {found}"


def test_the_books_are_checked_under_python_O():
    """check_invariants compiled as `python -O` compiles it (asserts stripped) still refuses
    double-booked books."""
    mod = importlib.import_module(check_invariants.__module__)
    spec = importlib.util.find_spec(mod.__name__)
    optimized = dict(vars(mod))
    exec(compile(Path(spec.origin).read_text(), spec.origin, "exec", optimize=1), optimized)
    p = PhasePolicy([8.0])
    p.add_job("a", {"c": 1})
    p.request("a", "values", mem=4.0)
    p.schedule(0.0)
    optimized["check_invariants"](p)  # balanced: passes
    p.used[0] -= 3.0  # the books say less is used than is leased
    with pytest.raises(Exception, match="books say"):
        optimized["check_invariants"](p)


@pytest.fixture
def big(tmp_path):
    """A core with 200 live jobs (a resident lease and a rollout each): its audit looks at
    what changed (a full audit only every ~500 changes)."""
    fatal = []
    core = Core([80.0] * 4, state=tmp_path / "s.db", heartbeat_timeout=1e9, on_fatal=fatal.append)
    for i in range(200):
        ok(core, op="register", job=f"j{i}", clusters=SPEC)
        ok(core, op="request", job=f"j{i}", phase="init", cluster="c", mem=0.01)
        ok(core, op="request", job=f"j{i}", phase="rollout", cluster="f", mem=0.01, devices=1)
    ok(core, op="register", job="x", clusters=SPEC)
    yield core, fatal
    core.close()


def _double_book(core):
    le = next(iter(core.pol.leases.values()))
    core.pol.used[le.devices[0]] -= 0.005


def _lease_without_span(core):
    le = next(le for le in core.pol.leases.values() if le.phase == "rollout")
    core.pol._pop_lease(le.id)
    core.pol._put_lease(dataclasses.replace(le, id=core.pol._id()))  # (the same memory: the books still balance)


def _phase_twice(core):
    le = next(le for le in core.pol.leases.values() if le.phase == "rollout")
    twin = dataclasses.replace(le, id=core.pol._id(), mem=(0.0,))
    core.pol._put_lease(twin)
    core.held[twin.id] = dataclasses.replace(core.held[le.id], id=twin.id, mem=(0.0,))


def _home_gone(core):
    key = next(iter(core.pol.homes))
    del core.pol.homes[key]


def _yield_of_a_resident(core):
    core.pol.yielding[next(le.id for le in core.pol.leases.values() if le.phase == "resident")] = 0.0


def _tally_off(core):
    core.tally.used[0] += 1.0


@pytest.mark.parametrize("corrupt, why", [
    (_double_book, "books say"), (_lease_without_span, "span"), (_phase_twice, "holds phase 'rollout' twice"),
    (_home_gone, "home None"), (_yield_of_a_resident, "not a held rollout"), (_tally_off, "metrics tally"),
])
def test_the_audit_of_what_changed_catches_broken_books(big, corrupt, why):
    core, fatal = big
    size = len(core.pol.leases) + len(core.pol.pending) + len(core.pol.jobs) + len(core.pol.homes)
    assert not core._auditor.full_due and (core._auditor.changes + 20) * core._auditor.FULL_EVERY < size  # incremental
    corrupt(core)
    r = core.handle({"op": "request", "job": "x", "phase": "init", "cluster": "c", "mem": 0.01})
    assert r["code"] == "fatal" and why in r["error"] and fatal


def test_the_full_audit_checks_the_indexes_and_the_aggregates(big):
    core, fatal = big
    core.pol.agg.base[1] += 1.0  # placement would misjudge device 1's load
    core._auditor.reset()
    r = core.handle({"op": "request", "job": "x", "phase": "init", "cluster": "c", "mem": 0.01})
    assert r["code"] == "fatal" and "compute load" in r["error"]


def test_a_grant_and_the_release_that_made_room_in_one_change_are_no_violation(tmp_path):
    """The release of a lease grants a waiting request in the same operation: the audit of
    what changed applies both before it compares leases with requests (it once took the
    granted request, not yet applied, for a phase awaited while held)."""
    core = Core([1.0, 1.0], state=tmp_path / "s.db", heartbeat_timeout=1e9)
    for i in range(300):
        ok(core, op="register", job=f"idle{i}", clusters={"c": 1})
    for j in "abc":
        ok(core, op="register", job=j, clusters={"c": 1})
    a = ok(core, op="request", job="a", phase="values", mem=1.0)
    ok(core, op="request", job="b", phase="values", mem=1.0)
    assert ok(core, op="request", job="c", phase="values", mem=1.0)["pending"]  # waits for a or b
    assert not core._auditor.full_due and (core._auditor.changes + 20) * core._auditor.FULL_EVERY < len(core.pol.jobs)
    ok(core, op="release", job="a", lease=a["leases"][0]["id"])  # c is granted in the same operation
    assert core.fatal is None and [le.job for le in core.pol.leases.values()] == ["b", "c"]
    core.close()


@pytest.mark.parametrize("policy", ["phase", "fifo"])
def test_the_audit_of_what_changed_agrees_with_the_full_one(tmp_path, policy):
    """Random operations (some in group-commit batches) on a pool large enough for the audit
    to look at what changed: it never stops the service, and the full audit passes after each."""
    import contextlib
    import random

    from rlcu.sched.audit import check_core

    rng = random.Random(7)
    core = Core([8.0, 8.0, 4.0], state=tmp_path / "s.db", heartbeat_timeout=1e9, policy=policy)
    for i in range(300):
        ok(core, op="register", job=f"idle{i}", clusters={"c": 1})
    specs = [{"c": {"devices": 1, "resident": 1.0, "peak": 3.0}}, {"c": 1}, {"c": {"devices": 2}}, SPEC]
    live: list[str] = []
    for step in range(500):
        with core.deferred() if step % 7 < 3 else contextlib.nullcontext():
            if rng.random() < 0.15 or not live:
                if core.handle({"op": "register", "job": f"j{step}", "clusters": rng.choice(specs)})["ok"]:
                    live.append(f"j{step}")
                continue
            j = rng.choice(live)
            v, k = ok(core, op="heartbeat", job=j), rng.random()
            held = [le["id"] for le in v["leases"] if le["phase"] != "resident"]
            if k < 0.45:
                core.handle({"op": "request", "job": j, "phase": rng.choice(["init", "values", "rollout"]),
                             "cluster": rng.choice(sorted(core.pol.jobs[j])), "mem": rng.choice([0.5, 1.0, 2.0])})
            elif k < 0.8 and held:
                ok(core, op="release", job=j, lease=rng.choice(held))
            elif k < 0.88 and v["pending"]:
                ok(core, op="withdraw", job=j, request=v["pending"][0]["id"])
            elif k < 0.95:
                ok(core, op="work", job=j, work=rng.random())
            else:
                ok(core, op=rng.choice(["finish", "cancel"]), job=j)
                live.remove(j)
        assert core.fatal is None, core.fatal
        with core.cond:
            check_invariants(core.pol)
            check_core(core)
    assert core._auditor.changes > 0  # (the last audits looked at what changed)
    core.close()
