"""The service's cost does not grow with its history (issue 13, item 6): the metrics tally
equals `summarize` over the whole lease history, status and metrics read no history (a
history that raises when touched does not stop them), ended leases are pruned past the
retention while the tally keeps their counts, an old database without a tally gets one at
start, and the group commit: a failed operation's writes are undone alone."""

import random
import sqlite3

import pytest
from support.sched_util import SPEC, Clock, ok

from rlcu.sched import metrics as mx
from rlcu.sched.core import Core
from rlcu.sched.store import Store


def churn(core, clock, rng, n):
    """n random ops of 3 jobs on the pool, time moving on between them."""
    held = {}
    for _ in range(n):
        clock.t += rng.choice([0.0, 0.5, 1.0, 3.0])
        job = rng.choice(["a", "b", "c"])
        if job in held and rng.random() < 0.6:
            ok(core, op="release", job=job, lease=held.pop(job))
        elif job not in held:
            r = ok(core, op="request", job=job, phase=rng.choice(["values", "actor_train"]), mem=rng.choice([10, 30]))
            got = [le["id"] for le in r["leases"] if le["request"] == r["request"]]
            if got:
                held[job] = got[0]
            else:
                ok(core, op="withdraw", job=job, request=r["request"])
    return held


def summarized(core) -> dict:
    spans = [s for s, _r, _y in core.store.leases()]
    jobs = [{"name": j.name, "arrival": j.submitted, "finish": j.finished if j.state == "done" else None}
            for j in core.jobs.values()]
    t0 = min(j.submitted for j in core.jobs.values())
    return mx.summarize(spans, core.pool["capacity"], jobs, t0, core.clock())


def differences(a: dict, b: dict) -> dict:
    """{metric: (a's, b's)} for each metric on which the two summaries differ."""
    keys = ("gpu_idle_frac", "jobs_per_hour", "mean_latency_s", "jobs_done", "mem_used_frac", "frag")
    out = {k: (a[k], b[k]) for k in keys if a[k] != pytest.approx(b[k], rel=1e-9, abs=1e-12)}
    if a["mem_peak"] != pytest.approx(b["mem_peak"]):
        out["mem_peak"] = (a["mem_peak"], b["mem_peak"])
    return out


@pytest.mark.parametrize("seed", range(3))
def test_the_tally_equals_summarize_over_the_history(tmp_path, seed):
    rng, clock = random.Random(seed), Clock()
    core = Core([80.0, 40.0], state=tmp_path / "s.db", clock=clock, mono=clock)
    for j in "abc":
        ok(core, op="register", job=j, clusters=SPEC)
        clock.t += 1.0
    churn(core, clock, rng, 200)
    clock.t += 2.0
    ok(core, op="finish", job="a")
    clock.t += 5.0
    assert not differences(core.ops.op_metrics(), summarized(core))
    core.close()
    again = Core(None, state=tmp_path / "s.db", clock=clock, mono=clock)  # the tally survives a restart
    clock.t += 1.0
    assert not differences(again.ops.op_metrics(), summarized(again))
    again.close()


def test_status_and_metrics_read_no_history(tmp_path):
    clock = Clock()
    core = Core([80.0] * 4, state=tmp_path / "s.db", clock=clock, mono=clock)
    for j in "abc":
        ok(core, op="register", job=j, clusters=SPEC)
    churn(core, clock, random.Random(0), 300)

    class Untouchable(dict):
        def _no(self, *a, **k):
            raise AssertionError("status read the lease history")

        __iter__ = values = items = keys = __len__ = _no

    core.ended = Untouchable()  # the remembered history: any scan of it fails the test
    core.store.db = None  # and the database
    st, m = core.ops.op_status(), core.ops.op_metrics()
    assert len(st["jobs"]) == 3 and m["jobs_live"] == 3


def test_history_is_pruned_and_the_metrics_keep_it(tmp_path):
    clock = Clock()
    core = Core([80.0], state=tmp_path / "s.db", clock=clock, mono=clock, keep_spans=20, history_s=50.0,
                history_rows=30)
    ok(core, op="register", job="a", clusters=SPEC)
    for _ in range(100):
        r = ok(core, op="request", job="a", phase="values", mem=10)
        clock.t += 1.0
        ok(core, op="release", job="a", lease=r["leases"][-1]["id"])
    assert len(core.ended) == 20  # memory: the last keep_spans
    before = core.ops.op_metrics()
    assert core.prune() == 70  # the database: the last history_rows (within history_s)
    rows = sqlite3.connect(tmp_path / "s.db").execute("SELECT COUNT(*) FROM leases").fetchone()[0]
    assert rows == 30
    assert core.ops.op_metrics() == before
    clock.t += 40.0  # and those that ended more than history_s ago: ends 1071..1089 of 1071..1100
    before = core.ops.op_metrics()
    assert core.prune() == 19
    assert core.ops.op_metrics() == before
    core.close()


def test_a_database_without_a_tally_gets_one_at_start(tmp_path):
    clock = Clock()
    core = Core([80.0, 80.0], state=tmp_path / "s.db", clock=clock, mono=clock)
    for j in "abc":
        ok(core, op="register", job=j, clusters=SPEC)
    churn(core, clock, random.Random(1), 150)
    clock.t += 1.0
    want = summarized(core)
    core.close()
    con = sqlite3.connect(tmp_path / "s.db")
    con.execute("DELETE FROM meta WHERE key='live'")  # as a database of the previous version
    con.commit()
    con.close()
    again = Core(None, state=tmp_path / "s.db", clock=clock, mono=clock)
    assert not differences(again.ops.op_metrics(), want)
    again.close()


def test_a_failed_operation_is_undone_alone_in_a_group_commit(tmp_path):
    st = Store(tmp_path / "s.db")
    st.set_meta("first", 1)
    tx = st.end_op()  # kept, not committed yet
    st.set_meta("second", 2)
    st.rollback_op()  # the second operation failed
    st.set_meta("third", 3)
    assert st.end_op() == tx and st.done_tx < tx
    st.commit()
    assert st.done_tx == tx and st.commits == 1
    assert [st.get_meta(k) for k in ("first", "second", "third")] == [1, None, 3]
    st.close()


def test_replies_wait_for_the_commit_that_holds_them(tmp_path):
    core = Core([80.0], state=tmp_path / "s.db")
    ok(core, op="register", job="a", clusters=SPEC)
    ok(core, op="request", job="a", phase="values", mem=10)
    assert not core.store.in_tx  # nothing the reply showed is left uncommitted
    other = sqlite3.connect(tmp_path / "s.db")
    assert other.execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 1
    other.close()
    core.close()


def test_the_tick_prunes_a_backlog_batch_by_batch(tmp_path, monkeypatch):
    import rlcu.sched.core as core_mod

    monkeypatch.setattr(core_mod, "PRUNE_BATCH", 10)
    clock, mono = Clock(), Clock(0.0)
    core = Core([80.0], state=tmp_path / "s.db", clock=clock, mono=mono, history_rows=5,
                heartbeat_timeout=1e9)
    ok(core, op="register", job="a", clusters=SPEC)
    for _ in range(30):
        r = ok(core, op="request", job="a", phase="values", mem=10)
        ok(core, op="release", job="a", lease=r["leases"][-1]["id"])

    def rows():
        return sqlite3.connect(tmp_path / "s.db").execute("SELECT COUNT(*) FROM leases").fetchone()[0]

    core.tick()
    assert rows() == 30  # not due yet
    mono.t = 61.0
    counts = []
    for _ in range(4):
        core.tick()
        counts.append(rows())
    assert counts == [20, 10, 5, 5]  # a full batch is followed by another at the next tick
    core.close()


def test_checkpoints_run_on_their_own_connection(tmp_path):
    """The ticker copies the WAL into the database from a second connection (off the
    service's lock), and the automatic checkpoint is only a backstop."""
    core = Core([80.0], state=tmp_path / "s.db")
    ok(core, op="register", job="a", clusters=SPEC)
    for _ in range(50):
        r = ok(core, op="request", job="a", phase="values", mem=10)
        ok(core, op="release", job="a", lease=r["leases"][-1]["id"])
    wal = tmp_path / "s.db-wal"
    assert wal.stat().st_size > 0
    assert core.store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] >= 10_000
    core.store.checkpoint()
    busy, log, done = core.store._ckpt.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and log == done  # everything in the WAL is in the database
    core.close()
    core.store.checkpoint()  # after close: a no-op, not an error


def test_ids_are_never_reused_once_their_history_is_pruned(tmp_path):
    core = Core([80.0], state=tmp_path / "s.db", history_rows=0, history_s=0.0)
    ok(core, op="register", job="a", clusters=SPEC)
    seen = []
    for _ in range(5):
        r = ok(core, op="request", job="a", phase="values", mem=10)
        seen.append(r["leases"][-1]["id"])
        ok(core, op="release", job="a", lease=seen[-1])
    core.prune()
    assert sqlite3.connect(tmp_path / "s.db").execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
    core.close()
    again = Core(None, state=tmp_path / "s.db")
    r = ok(again, op="request", job="a", phase="values", mem=10)
    assert r["request"] > max(seen)
    again.close()
