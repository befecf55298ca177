"""Persistent connections and the loop's group commit (issue 13, item 6): a client keeps one
connection per thread for all its calls, finds a new one when the service dropped it (idle
timeout, restart, a break mid-call) without doing an op twice; the messages of one turn of
the server's loop share one commit, audited before it, and no reply leaves before it."""

import threading
import time

import pytest
from support.sched_util import servers

from rlcu.sched.client import SchedClient
from rlcu.sched.core import Core
from rlcu.sched.server import SchedServer

TOKEN = "t0ken"
SPEC = {"c": {"devices": 1}}


@pytest.fixture
def serve(tmp_path):
    with servers(tmp_path, TOKEN, [80.0]) as serve:
        yield serve


def test_the_client_reuses_one_connection_for_many_calls(serve):
    srv = serve()
    c = SchedClient(srv.address, TOKEN)
    job = c.job("a", SPEC, heartbeat_s=30)
    for _ in range(20):
        job.release(job.acquire("actor_train", mem=10))
        assert c.ping()["ok"]
    assert c.transport.connects == 1 and srv.accepted == 1  # used to be one connection per call: 61
    other = []  # another thread gets its own connection, kept too
    t = threading.Thread(target=lambda: other.extend(c.ping()["ok"] for _ in range(5)))
    t.start()
    t.join()
    assert other == [True] * 5 and srv.accepted == 2
    job.finish()
    assert srv.accepted == 2
    per_call = SchedClient(srv.address, TOKEN, keep_alive=False)
    for _ in range(3):
        per_call.ping()
    assert srv.accepted == 5


def test_the_client_reconnects_after_the_service_drops_its_connection(serve):
    srv = serve(idle_timeout=0.2)
    c = SchedClient(srv.address, TOKEN)
    assert c.ping()["ok"]
    time.sleep(0.6)  # the service closes the idle connection
    assert len(srv.conns) == 0
    assert c.ping()["ok"] and c.transport.connects == 2 and srv.accepted == 2
    assert c.retries == 0  # found closed before the send: nothing to resend


def test_a_connection_broken_mid_call_is_replaced_and_the_op_done_once(serve):
    srv = serve()
    c = SchedClient(srv.address, TOKEN)
    job = c.job("a", SPEC, heartbeat_s=30)
    le = job.acquire("actor_train", mem=10)
    real, dropped = srv._answer, []

    def drop_first_release(conn, reply):  # the release is committed, then its connection breaks
        if "leases" in reply and not reply["leases"] and not dropped:
            dropped.append(reply)
            srv._close(conn)
            return
        real(conn, reply)

    srv._answer = drop_first_release
    job.release(le)  # resent at once on a new connection, with its op id: not released twice
    assert dropped and c.transport.connects == 2 and c.retries == c.transport.resent == 1
    st = c.status()
    assert st["devices"][0]["used"] == 0.0
    job.release(job.acquire("actor_train", mem=10))
    job.finish()


def test_the_client_finds_a_restarted_service_on_a_new_connection(serve, tmp_path):
    srv = serve()
    c = SchedClient(srv.address, TOKEN)
    job = c.job("a", SPEC, heartbeat_s=30)
    le = job.acquire("actor_train", mem=10)
    srv.stop()
    srv = serve(Core(None, state=tmp_path / "s.db"))
    job.release(le)
    assert c.transport.connects == 2 and srv.accepted == 1
    job.finish()


def test_one_turn_of_the_loop_is_one_commit(serve):
    srv = serve(core=Core([80.0] * 4))
    clients = [SchedClient(srv.address, TOKEN) for _ in range(12)]
    jobs = [c.job(f"j{i}", SPEC, heartbeat_s=30) for i, c in enumerate(clients)]
    commits0, stop, errors = srv.core.store.commits, time.monotonic() + 1.0, []
    counts = [0] * len(jobs)

    def cycle(i):
        try:
            while time.monotonic() < stop:
                jobs[i].release(jobs[i].acquire("actor_train", mem=10))
                counts[i] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=cycle, args=(i,)) for i in range(len(jobs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    ops = 2 * sum(counts)
    assert srv.batched > srv.batches  # several messages in one turn, one commit for them
    assert srv.core.store.commits - commits0 < ops
    assert srv.accepted == 2 * len(clients)  # (registered from this thread, cycled from its own)
    for j in jobs:
        j.finish()


def test_no_reply_leaves_before_its_commit(serve, monkeypatch):
    srv = serve(core=Core([80.0], on_fatal=lambda why: None))
    c = SchedClient(srv.address, TOKEN, retry_s=1.0)
    job = c.job("a", SPEC, heartbeat_s=30)

    def full_disk(meta=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(srv.core.store, "commit", full_disk)
    r = c.transport.call({"op": "request", "job": "a", "secret": job.secret, "phase": "actor_train", "mem": 10})
    assert not r["ok"] and r["code"] == "fatal" and "could not commit" in r["error"]
    job.close()
    monkeypatch.undo()  # (the service closes its database as it stops)


def test_a_batch_is_audited_before_its_commit(tmp_path, monkeypatch):
    """The ops of a group-commit batch are audited once, before their commit: a broken
    invariant in any of them makes every reply of the batch fatal and commits none of it."""
    core = Core([80.0], state=tmp_path / "s.db", on_fatal=lambda why: None)
    for j in ("a", "b"):
        assert core.handle({"op": "register", "job": j, "clusters": SPEC})["ok"]
    real = core.pol._grant

    def double_book(*a, **k):
        le = real(*a, **k)
        if le.job == "b":
            core.pol.used[le.devices[0]] -= 5.0
        return le

    monkeypatch.setattr(core.pol, "_grant", double_book)
    with core.deferred() as batch:
        good = core.handle({"op": "request", "job": "a", "phase": "values", "mem": 10})
        bad = core.handle({"op": "request", "job": "b", "phase": "values", "mem": 10})
    assert good["ok"] and bad["ok"]  # (computed, not sent: the batch's failure replaces them)
    assert batch.failure is not None and batch.failure["code"] == "fatal" and "books say" in batch.failure["error"]
    assert core.fatal is not None and not core.handle({"op": "ping"})["ok"]
    core.close()
    again = Core(None, state=tmp_path / "s.db")  # the last good state: neither request of the batch
    assert again.pol.used == [0.0] and not again.held
    again.close()


def test_a_turns_replies_leave_after_its_commit_and_reads_go_first(tmp_path):
    """Within one turn: the reads are answered first, showing only committed state; every
    other reply is sent only once the commit holding its op is done."""
    from rlcu.sched.service import ADMIN

    srv = SchedServer(Core([80.0], state=tmp_path / "s.db"), f"unix:{tmp_path / 's.sock'}", TOKEN)  # (not started)
    try:
        store = srv.core.store
        assert srv.front.handle({"op": "register", "job": "a", "clusters": SPEC}, ADMIN, authenticated=True)["ok"]
        sent = []

        class Conn:
            def __init__(self, caller):
                self.caller = caller

        srv._answer = lambda c, reply: sent.append((c, reply, store.in_tx, store.done_tx))
        a, b = Conn("a"), Conn(ADMIN)
        commits = store.commits
        srv._batch = [(a, {"op": "request", "job": "a", "phase": "actor_train", "mem": 10, "id": "q-1"}),
                      (a, {"op": "release", "job": "a", "lease": 999, "id": "q-2"}),
                      (b, {"op": "status"})]
        srv._run_batch()
        (c0, st, tx0, _), (c1, req, tx1, done1), (_, rel, tx2, _) = sent
        assert c0 is b and st["ok"] and st["devices"][0]["used"] == 0.0 and not tx0  # before the batch's changes
        assert c1 is a and req["ok"] and not tx1 and done1 > 0 and not rel["ok"] and not tx2
        assert store.commits == commits + 1  # one commit for the turn
    finally:
        srv.stop()
