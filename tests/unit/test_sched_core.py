"""The scheduler core under faults (issue 13): a failing handler leaves no trace, the tick
loop survives a failing tick, a broken invariant stops the service (fail fast), one state
folder takes one service, a missing/empty/corrupt database is refused unless fresh,
heartbeats run on the monotonic clock, a submitted job gets a start-up grace, and the
typed job records and snapshots. All in-process, on tmp folders, with fake clocks."""

import sqlite3
import threading

import pytest
from support.sched_util import SPEC, Clock, ok

from rlcu.sched.cli import main
from rlcu.sched.core import Core, StateLocked, StoreError
from rlcu.sched.pool import InvariantError
from rlcu.sched.store import Job


def lease_of(r):
    return next(le["id"] for le in r["leases"] if le["request"] == r["request"])


def db_rows(path, sql):
    con = sqlite3.connect(path)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


# ---------------------------------------------------------------------- item 1: errors, the tick, invariants
@pytest.mark.parametrize("bad", [{"pid": 2**70}, {"pid": {"a": 1}}, {"host": {"a": 1}}, {"spec": {"x": {1, 2}}}])
def test_malformed_register_is_an_error_reply_and_changes_nothing(tmp_path, bad):
    core = Core([80.0], state=tmp_path / "s.db")
    r = core.handle({"op": "register", "job": "a", "clusters": SPEC, **bad})
    assert not r["ok"] and r["code"] == "invalid"
    assert "a" not in core.jobs and "a" not in core.pol.jobs
    assert db_rows(tmp_path / "s.db", "SELECT name FROM jobs") == []
    ok(core, op="register", job="a", clusters=SPEC)  # the name is still free, the service still serves
    assert core.tick() == []
    core.close()


def test_a_handler_failing_midway_rolls_back_memory_and_database(tmp_path, monkeypatch):
    core = Core([80.0], state=tmp_path / "s.db")
    ok(core, op="register", job="a", clusters=SPEC)
    held = lease_of(ok(core, op="request", job="a", phase="values", mem=10))

    def boom(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr(core.store, "end_lease", boom)  # fails after the policy has released the lease
    r = core.handle({"op": "release", "job": "a", "lease": held})
    assert not r["ok"] and "disk on fire" in r["error"]
    monkeypatch.undo()
    assert core.pol.used == [10.0] and held in core.pol.leases and core.held[held].end is None
    assert core.tally.used == [10.0]
    ok(core, op="release", job="a", lease=held)  # and the real release goes through
    assert core.pol.used == [0.0]
    assert db_rows(tmp_path / "s.db", f"SELECT reason FROM leases WHERE id={held}") == [("released",)]
    core.close()


def test_tick_loop_survives_a_failing_tick_and_goes_on_reclaiming(tmp_path, monkeypatch, capsys):
    mono = Clock(0.0)
    core = Core([80.0], state=tmp_path / "s.db", heartbeat_timeout=5.0, mono=mono)
    ok(core, op="register", job="a", clusters=SPEC)
    calls = []
    real = core.pol.schedule

    def flaky(now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("a policy bug")
        return real(now)

    monkeypatch.setattr(core.pol, "schedule", flaky)
    stop = threading.Event()
    ticks = []
    real_tick = core.tick

    def counted():
        ticks.append(1)
        if len(ticks) == 3:
            mono.t = 100.0  # a's heartbeat is long gone
        if len(ticks) >= 5:
            stop.set()
        return real_tick()

    monkeypatch.setattr(core, "tick", counted)
    t = threading.Thread(target=core.run_ticks, args=(stop, 0.001))
    t.start()
    t.join(10)
    assert not t.is_alive() and len(ticks) >= 5
    assert "tick failed" in capsys.readouterr().err
    assert core.jobs["a"].state == "dead"  # reclaim still works after the failed tick
    core.close()


def test_a_broken_invariant_is_fatal_and_commits_nothing(tmp_path, monkeypatch):
    fatal = []
    core = Core([80.0], state=tmp_path / "s.db", on_fatal=fatal.append)
    ok(core, op="register", job="a", clusters=SPEC)
    ok(core, op="register", job="b", clusters=SPEC)
    real = core.pol._grant

    def double_book(*a, **k):  # a policy bug: the books say less is used than is leased
        le = real(*a, **k)
        core.pol.used[le.devices[0]] -= 5.0
        return le

    monkeypatch.setattr(core.pol, "_grant", double_book)
    r = core.handle({"op": "request", "job": "a", "phase": "values", "mem": 10})
    assert not r["ok"] and r["code"] == "fatal" and "books say" in r["error"]
    assert len(fatal) == 1
    r = core.handle({"op": "ping"})
    assert not r["ok"] and r["code"] == "fatal"  # nothing more is served
    assert core.tick() == []
    core.close()
    assert db_rows(tmp_path / "s.db", "SELECT COUNT(*) FROM leases") == [(0,)]  # the bad grant never committed
    again = Core(None, state=tmp_path / "s.db")  # the last good state
    assert set(again.jobs) == {"a", "b"} and again.pol.used == [0.0]
    again.close()


def test_a_state_that_fails_the_invariants_is_refused_at_start(tmp_path):
    core = Core([80.0], state=tmp_path / "s.db")
    ok(core, op="register", job="a", clusters=SPEC)
    ok(core, op="request", job="a", phase="values", mem=60)
    core.close()
    con = sqlite3.connect(tmp_path / "s.db")  # a second lease on the device, past its memory
    con.execute("INSERT INTO leases(id, job, phase, cluster, devices, mem, start) "
                "VALUES(99, 'a', 'actor_train', 'c', '[0]', '[60]', 0)")
    con.commit()
    con.close()
    with pytest.raises(StoreError, match="fails the scheduler's invariants.*double-booked"):
        Core(None, state=tmp_path / "s.db")
    Core([80.0], state=tmp_path / "s.db", fresh=True).close()  # fresh: begin anew


# ---------------------------------------------------------------------- item 2: one service per state folder
def test_a_second_service_on_the_same_state_folder_is_refused(tmp_path, capsys):
    first = Core([1.0], state=tmp_path / "sched.db")
    with pytest.raises(StateLocked, match="in use by another service"):
        Core(None, state=tmp_path / "sched.db")
    rc = main(["sched", "serve", "--state", str(tmp_path), "--cpu-slots", "1", "--addr", "127.0.0.1:0"])
    assert rc == 2 and "in use by another service" in capsys.readouterr().err
    first.close()
    Core(None, state=tmp_path / "sched.db").close()  # free once the first is gone


# ---------------------------------------------------------------------- item 7: the database, the clocks, the grace
def test_a_deleted_database_is_refused_unless_fresh(tmp_path):
    Core([1.0], state=tmp_path / "sched.db").close()
    (tmp_path / "sched.db").unlink()
    with pytest.raises(StoreError, match="is gone.*--fresh"):
        Core([1.0], state=tmp_path / "sched.db")
    Core([1.0], state=tmp_path / "sched.db", fresh=True).close()


@pytest.mark.parametrize("content,msg", [(b"", "empty"), (b"garbage" * 1000, "not a readable SQLite database")])
def test_an_empty_or_corrupt_database_is_refused_unless_fresh(tmp_path, content, msg):
    (tmp_path / "sched.db").write_bytes(content)
    with pytest.raises(StoreError, match=msg):
        Core([1.0], state=tmp_path / "sched.db")
    core = Core([1.0], state=tmp_path / "sched.db", fresh=True)
    assert core.store.moved is not None and core.store.moved.read_bytes() == content  # kept aside, not deleted
    core.close()


def test_the_cli_refuses_a_corrupt_database_with_a_clear_message(tmp_path, capsys):
    (tmp_path / "sched.db").write_bytes(b"\x00not sqlite" * 100)
    rc = main(["sched", "serve", "--state", str(tmp_path), "--cpu-slots", "1", "--addr", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2 and "sched.db" in err and "--fresh" in err and "Traceback" not in err


def test_heartbeats_use_the_monotonic_clock(tmp_path):
    wall, mono = Clock(1000.0), Clock(0.0)
    core = Core([1.0], state=tmp_path / "s.db", heartbeat_timeout=10.0, clock=wall, mono=mono)
    ok(core, op="register", job="a", clusters=SPEC)
    wall.t += 86400.0  # the wall clock steps a day forward
    assert core.tick() == []
    mono.t += 11.0
    assert core.tick() == ["a"]
    core.close()


def test_a_submitted_job_gets_a_start_up_grace(tmp_path):
    mono = Clock(0.0)
    core = Core([1.0], state=tmp_path / "s.db", heartbeat_timeout=5.0, start_grace_s=60.0, mono=mono)
    ok(core, op="register", job="q", clusters=SPEC, queued=True)
    ok(core, op="register", job="r", clusters=SPEC)
    mono.t = 30.0  # past the heartbeat timeout, within the grace
    assert core.tick() == ["r"]
    ok(core, op="register", job="q", clusters=SPEC, attach=True)  # the worker attaches: heartbeats from now
    mono.t = 36.0
    assert core.tick() == ["q"]
    core.close()


def test_an_unattached_submitted_job_dies_after_the_grace(tmp_path):
    mono = Clock(0.0)
    core = Core([1.0], state=tmp_path / "s.db", heartbeat_timeout=5.0, start_grace_s=60.0, mono=mono)
    ok(core, op="register", job="q", clusters=SPEC, queued=True)
    mono.t = 61.0
    assert core.tick() == ["q"]
    core.close()


# ---------------------------------------------------------------------- the layers: Job, restore, snapshot
def test_jobs_are_typed_records_and_snapshots_are_copies(tmp_path):
    core = Core([80.0], state=tmp_path / "s.db")
    ok(core, op="register", job="a", clusters=SPEC, pid=123, host="h")
    lid = lease_of(ok(core, op="request", job="a", phase="values", mem=10))
    snap = core.snapshot()
    assert isinstance(snap.jobs["a"], Job) and snap.jobs["a"].pid == 123 and snap.held == (lid,)
    snap.jobs["a"].state = "done"
    snap.spans[0].end = 1.0
    assert core.jobs["a"].state == "running" and core.held[lid].end is None
    with pytest.raises(AttributeError):
        snap.used = ()
    ok(core, op="release", job="a", lease=lid)
    assert [s.reason for s in core.snapshot().spans] == ["released"]
    assert core.snapshot().trace()["traceEvents"]
    core.close()


def test_restart_restores_the_policy_through_its_public_restore(tmp_path):
    core = Core([80.0], state=tmp_path / "s.db")
    ok(core, op="register", job="a", clusters={"c": {"devices": 1, "resident": 10, "peak": 60}})
    lid = lease_of(ok(core, op="request", job="a", phase="rollout", mem=60))
    ok(core, op="register", job="b", clusters={"c": {"devices": 1, "resident": 5, "peak": 60}})
    ok(core, op="request", job="b", phase="actor_train", mem=60)  # a's rollout is asked to yield
    assert lid in core.pol.yielding
    top = core.pol.next_id
    core.close()
    again = Core(None, state=tmp_path / "s.db")
    assert lid in again.pol.yielding and again.pol.next_id == top
    assert again.view("a")["leases"][-1]["yield"]
    again.close()


def test_a_waiting_job_is_told_when_the_service_stops_on_a_broken_invariant(tmp_path, monkeypatch):
    core = Core([80.0], state=tmp_path / "s.db", on_fatal=lambda why: None)
    ok(core, op="register", job="a", clusters=SPEC)
    ok(core, op="register", job="b", clusters=SPEC)
    ok(core, op="request", job="a", phase="values", mem=80)
    v = ok(core, op="request", job="b", phase="values", mem=80)  # waits for a's lease
    got = []
    t = threading.Thread(target=lambda: got.append(core.handle({"op": "wait", "job": "b", "version": v["version"],
                                                                 "timeout": 10})))
    t.start()
    monkeypatch.setattr(core, "_audit", lambda: (_ for _ in ()).throw(InvariantError("books broken")))
    r = core.handle({"op": "finish", "job": "a"})
    t.join(5)
    assert r["code"] == "fatal" and got and got[0]["code"] == "fatal" and "books broken" in got[0]["error"]
    core.close()
