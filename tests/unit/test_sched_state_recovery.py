"""What a failed commit leaves, the next start takes: a commit that fails (a full disk) stops
the service with nothing written after it, so a restart on the same state folder recovers
the last good state (jobs and leases the replies confirmed) instead of refusing it; a saved
metrics tally that disagrees with the leases is rebuilt from them."""

import json
import os
import sqlite3

from support.sched_util import SPEC, Clock, ok

from rlcu.sched.core import Core

RES = {"c": {"devices": 1, "resident": 1.0, "peak": 2.0}}


class FullDisk:
    """The store's connection on a disk that fills up: once armed, COMMIT fails with
    SQLITE_FULL after SQLite rolled the transaction back (as it may on SQLITE_FULL); later
    statements go through (the disk was freed, or a small write found room)."""

    def __init__(self, db):
        self.db, self.armed = db, False

    def execute(self, sql, *args):
        if self.armed and sql.strip().upper() == "COMMIT":
            self.armed = False
            self.db.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.db, name)


def crash(core):
    """The process ends where it stands (`rlcu sched serve` exits 70 from on_fatal): no close."""
    core.store.db.close()
    os.close(core._lock_fd)


def test_a_failed_commit_leaves_a_state_the_restart_takes(tmp_path):
    fatal = []
    core = Core([8.0, 8.0], state=tmp_path / "s.db", on_fatal=fatal.append)
    ok(core, op="register", job="a", clusters=RES)
    ok(core, op="register", job="b", clusters=RES)
    ok(core, op="request", job="a", phase="init", mem=0.5)  # a's resident lease and its init
    disk = core.store.db = FullDisk(core.store.db)
    disk.armed = True
    r = core.handle({"op": "request", "job": "b", "phase": "init", "mem": 1.5})
    assert not r["ok"] and r["code"] == "fatal" and "disk is full" in r["error"] and fatal
    crash(core)
    again = Core(None, state=tmp_path / "s.db")  # was: "the metrics tally has 2.5 in use, the books 0.5"
    assert sorted(s.job for s in again.held.values()) == ["a", "a"]  # the last good state: b's grant undone
    assert again.tally.used == again.pol.used and sum(again.pol.used) == 1.5
    ok(again, op="request", job="b", phase="init", mem=1.5)
    again.close()


def test_nothing_is_written_after_a_failed_commit_even_at_close(tmp_path):
    core = Core([8.0], state=tmp_path / "s.db", on_fatal=lambda why: None)
    ok(core, op="register", job="a", clusters=SPEC)
    core.store.db = FullDisk(core.store.db)
    core.store.db.armed = True
    assert core.handle({"op": "request", "job": "a", "phase": "values", "mem": 3})["code"] == "fatal"
    core.close()
    again = Core(None, state=tmp_path / "s.db")
    assert not again.held and again.tally.used == [0.0]
    again.close()


def test_a_disk_that_fills_mid_operation(tmp_path):
    """A real SQLITE_FULL (max_page_count): jobs are registered and granted until a write fails;
    the service stops, and the restart holds exactly what the replies confirmed."""
    core = Core([1e6], state=tmp_path / "s.db", on_fatal=lambda why: None)
    ok(core, op="register", job="j0", clusters=SPEC)
    pages = core.store.db.execute("PRAGMA page_count").fetchone()[0]
    core.store.db.execute(f"PRAGMA max_page_count={pages + 2}")
    acked, r = [], {"ok": True}
    for i in range(1, 200):
        r = core.handle({"op": "register", "job": f"j{i}", "clusters": SPEC, "spec": {"pad": "x" * 2000}})
        if not r["ok"]:
            break
        r = core.handle({"op": "request", "job": f"j{i}", "phase": "values", "mem": 1.0})
        if not r["ok"]:
            break
        acked.append(f"j{i}")
    assert r["code"] == "fatal" and "full" in r["error"] and acked
    crash(core)
    again = Core(None, state=tmp_path / "s.db")
    held = sorted(s.job for s in again.held.values())
    assert held == sorted(acked) and again.tally.used == again.pol.used == [float(len(acked))]
    again.close()


def test_a_failed_commit_of_a_tick_is_fatal(tmp_path):
    """A tick's commit that fails must stop the service: going on would leave the state in
    memory ahead of the database, and the next commit would save a tally ahead of its rows."""
    fatal = []
    mono = Clock()
    core = Core([8.0], state=tmp_path / "s.db", heartbeat_timeout=5.0, mono=mono, on_fatal=fatal.append)
    ok(core, op="register", job="a", clusters=SPEC)
    ok(core, op="request", job="a", phase="values", mem=3)
    core.store.db = FullDisk(core.store.db)
    core.store.db.armed = True
    mono.t += 10.0
    assert core.tick() == ["a"]  # a is silent: reclaimed, and that commit fails
    assert fatal and core.fatal is not None and not core.handle({"op": "ping"})["ok"]
    crash(core)
    again = Core(None, state=tmp_path / "s.db")
    assert again.tally.used == again.pol.used
    again.close()


def test_a_saved_tally_that_disagrees_with_the_leases_is_rebuilt(tmp_path, capsys):
    core = Core([8.0], state=tmp_path / "s.db")
    ok(core, op="register", job="a", clusters=SPEC)
    ok(core, op="request", job="a", phase="values", mem=0.5)
    core.close()
    db = sqlite3.connect(tmp_path / "s.db")
    live = json.loads(db.execute("SELECT value FROM meta WHERE key='live'").fetchone()[0])
    live["tally"]["used"], live["tally"]["busy_n"] = [2.5], [2]  # as an older version left it
    db.execute("UPDATE meta SET value=? WHERE key='live'", (json.dumps(live),))
    db.commit()
    db.close()
    again = Core(None, state=tmp_path / "s.db")
    assert again.tally.used == [0.5] and again.tally.busy_n == [1]
    assert "taken from the leases" in capsys.readouterr().err
    again.close()
