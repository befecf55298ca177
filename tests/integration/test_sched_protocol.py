"""The scheduler's boundary (issue 13, items 1, 3 and 4): every field checked for type and
range before the core sees it, every failure an error reply on a live connection, the same
guards in the Ray actor, per-job secrets, and operation ids that make a resent call safe."""

import json
import socket
import time

import pytest
from support.sched_util import hello, services

from rlcu.sched.client import JobEnded, LeaseLost, SchedClient, SchedError
from rlcu.sched.core import Core
from rlcu.sched.protocol import MAX_HEAD, encode, validate
from rlcu.sched.service import ADMIN, Front

TOKEN = "t0ken"


@pytest.fixture
def service(tmp_path):
    with services(tmp_path, TOKEN) as start:
        yield start


class Raw:
    """One connection speaking raw frames (several messages may go over it), past its
    handshake with the token (`shake=False`: before it)."""

    def __init__(self, srv, shake: bool = True):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(5)
        self.s.connect(srv.address[len("unix:"):])
        self.hs = hello(self.s, TOKEN) if shake else None
        self.f = self.s.makefile("rb")

    def send(self, data: bytes) -> dict:
        try:
            self.s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the service refused a frame mid-way and closed; its error reply is already in our buffer
        line = self.f.readline()
        return json.loads(line) if line else None

    def call(self, **msg) -> dict:
        return self.send(encode(self.hs.sign(msg)))

    def close(self):
        self.f.close()
        self.s.close()


# ---------------------------------------------------------------------- item 1: the boundary
@pytest.mark.parametrize("field, value, msg", [
    ("pid", {"a": 1}, "pid must be a process id"),
    ("pid", 2 ** 70, "pid must be a process id"),
    ("pid", 0, "pid must be a process id"),
    ("host", {"x": 1}, "host must be a string of at most 255"),
    ("host", "h" * 256, "host must be a string of at most 255"),
    ("spec", {"a": float("nan")}, "not finite"),
    ("spec", {"a": 2 ** 70}, "beyond 64 bits"),
    ("clusters", {"c": {"devices": 1, "resident": float("inf")}}, "resident must be a finite number"),
    ("clusters", {"c": 2 ** 70}, "devices must be an integer"),
    ("queued", "yes", "queued must be true or false"),
])
def test_unstorable_register_is_an_error_reply_and_changes_nothing(service, field, value, msg):
    """A register whose pid or host SQLite cannot store used to raise past the handler: no
    reply, memory and database apart, and the ticker dead (no dead job reclaimed again)."""
    srv, c = service(capacity=(1.0,), hb=0.3)
    args = {"job": "bad", "clusters": {"c": 1}, "pid": 123, "host": "h", field: value}
    r = srv.front.handle({"op": "register", **args}, ADMIN, authenticated=True)  # (json cannot carry NaN)
    assert not r["ok"] and r["code"] == "invalid" and msg in r["error"], r
    if field in ("pid", "host"):  # and over the socket, which used to drop the connection
        raw = Raw(srv)
        r = raw.call(op="register", token=TOKEN, **args)
        assert not r["ok"] and msg in r["error"]
        assert raw.call(op="ping", token=TOKEN)["ok"]  # the same connection goes on
        raw.close()
    assert c.status()["jobs"] == []
    # the ticker is alive: a silent job is still reclaimed
    a = c.job("a", {"c": 1}, heartbeat_s=10)
    a.acquire("actor_train")
    a.close()
    deadline = time.monotonic() + 5
    while c.status()["jobs"][0]["state"] != "dead":
        assert time.monotonic() < deadline, "the silent job was never reclaimed"
        time.sleep(0.05)


def test_deep_nesting_is_an_error_reply(service):
    srv, c = service()
    raw = Raw(srv, shake=False)
    r = raw.send(b"[" * 200_000 + b"\n")  # as a head: refused at MAX_HEAD bytes, never parsed
    assert not r["ok"] and r["code"] == "protocol" and str(MAX_HEAD) in r["error"]
    raw.close()
    raw = Raw(srv)  # as the body of an authenticated message: parsed, and refused
    body = b"[" * 200_000
    head = json.dumps(raw.hs.sign({"op": "register", "token": TOKEN, "job": "a", "body": len(body)})).encode()
    r = raw.send(head + b"\n" + body)
    assert not r["ok"] and r["code"] == "protocol" and "nested too deeply" in r["error"]
    raw.close()
    deep = []
    for _ in range(200_000):  # the Ray actor's path: a Python object, checked without recursion
        deep = [deep]
    r = srv.front.handle({"op": "register", "job": "a", "clusters": {"c": 1}, "spec": {"x": deep}}, ADMIN,
                         authenticated=True)
    assert not r["ok"] and "nested deeper" in r["error"]
    assert c.ping()["ok"] and c.status()["jobs"] == []


def test_a_handler_error_is_an_error_reply(service, monkeypatch):
    srv, _ = service()

    def broken():
        raise OverflowError("Python int too large to convert to SQLite INTEGER")

    monkeypatch.setattr(srv.core, "_ops", {**srv.core._ops, "status": (broken, frozenset(), [])})
    raw = Raw(srv)
    r = raw.call(op="status", token=TOKEN)
    # the core rolls back
    assert not r["ok"] and r["code"] in ("internal", "invalid") and "OverflowError" in r["error"], r
    assert raw.call(op="ping", token=TOKEN)["ok"]
    raw.close()


def test_ray_actor_has_the_same_guards():
    """The Ray actor's class, run here without Ray: the same Front answers it, and its callers
    prove their keys over a session made by a hello, as a socket's connection does."""
    from rlcu.sched.auth import Handshake
    from rlcu.sched.ray_backend import _CoreActor

    actor = _CoreActor([1.0], ["cpu0"], "phase", 60.0, 30.0, None, 0.05, "tok")
    try:
        hs = Handshake({}, "tok")
        hs.accept(actor.hello(hs.hello), "the actor")

        def call(**msg):
            return actor.handle({**hs.sign(msg), "session": hs.snonce})

        r = call(op="register", token="tok", job="a", clusters={"c": 1}, pid={"x": 1})
        assert not r["ok"] and "pid must be" in r["error"]
        assert call(op="ping")["code"] == "auth"
        assert actor.handle({"op": "ping", "token": "tok", "session": hs.snonce})["code"] == "auth"  # in clear
        assert actor.handle({**hs.sign({"op": "ping", "token": "tok"})})["code"] == "hello"  # no session named
        assert actor.handle("not a dict")["code"] in ("auth", "protocol", "hello")
        v = call(op="register", token="tok", job="a", clusters={"c": 1})
        assert v["ok"] and v["secret"]
        assert call(op="heartbeat", token="tok", job="a")["code"] == "auth"
        assert call(op="heartbeat", job="a", secret=v["secret"])["ok"]
        other = Handshake({}, "tok")
        other.accept(actor.hello(other.hello), "the actor")
        assert actor.handle({**hs.sign({"op": "ping", "token": "tok"}), "session": other.snonce})["code"] == "auth"
    finally:
        actor.stop()


def test_validate_names_the_op_and_field():
    with pytest.raises(SchedError, match="op 'request': mem must be a finite number"):
        validate({"op": "request", "job": "a", "phase": "rollout", "mem": -1})
    with pytest.raises(SchedError, match="op 'release' needs 'lease'"):
        validate({"op": "release", "job": "a"})
    with pytest.raises(SchedError, match="takes no argument 'colour'"):
        validate({"op": "ping", "colour": 1})
    assert validate({"op": "wait", "job": "a", "timeout": 1.5, "id": "x-1"}) == ("wait", {"job": "a", "timeout": 1.5})


def test_a_large_message_goes_as_head_and_body(service):
    _, c = service()
    spec = {"notes": "x" * 50_000}
    assert len(encode({"op": "register", "job": "a", "clusters": {"c": 1}, "spec": spec}).split(b"\n")[0]) < MAX_HEAD
    j = c.job("a", {"c": 1}, spec=spec, heartbeat_s=10)
    j.finish()


# ---------------------------------------------------------------------- item 3: authority
def refused(tr, msg: dict) -> dict:
    """The answer to a message with a key the service does not take: an error reply, or (on a
    connection it opens, whose handshake the service cannot answer for that key) the error the
    transport raises, as a reply."""
    try:
        return tr.call(msg)
    except SchedError as e:
        return {"ok": False, "error": str(e), "code": e.code}


def test_a_job_acts_only_for_itself(service):
    srv, admin = service(capacity=(1.0,))
    a = SchedClient(srv.address, TOKEN).job("a", {"c": 1}, heartbeat_s=10)
    b_client = SchedClient(srv.address, TOKEN)
    b = b_client.job("b", {"c": 1}, heartbeat_s=10)
    la = a.acquire("actor_train")
    tr = b_client.transport
    for op, args in [("release", {"lease": la.id}), ("heartbeat", {}), ("finish", {}), ("cancel", {}),
                     ("register", {"clusters": {}, "attach": True}), ("request", {"phase": "rollout"})]:
        r = refused(tr, {"op": op, "job": "a", "secret": b.secret, **args})  # b's secret, a's name
        assert r["code"] == "auth", (op, r)
        if op == "cancel":
            continue  # (the admin may cancel any job: below)
        r = tr.call({"op": op, "job": "a", "token": TOKEN, **args})  # the token does not act for a job
        if op == "register":  # attaching to a running job: the token is not enough
            assert r["code"] == "auth" and "needs its secret" in r["error"], r
        else:
            assert r["code"] == "auth" and "needs the job's secret" in r["error"], (op, r)
    assert tr.call({"op": "heartbeat", "job": "a", "secret": a.secret})["ok"]
    assert refused(tr, {"op": "drain", "token": "wrong"})["code"] == "auth"
    r = tr.call({"op": "drain", "job": "b", "secret": b.secret})
    assert r["code"] == "auth" and "needs the service token" in r["error"]
    # the admin cancels a; a learns it at its next call
    assert admin.cancel("a")["state"] == "cancelled"
    with pytest.raises(JobEnded, match="cancelled"):
        a.release(la)
    b.finish()
    a.close()


def test_lease_lost_and_drain(service):
    _, admin = service(capacity=(1.0,))
    a = admin.job("a", {"c": 1}, heartbeat_s=10, poll_s=0.0)
    le = a.acquire("rollout")
    assert not a.should_yield(le)
    a.release(le)
    with pytest.raises(LeaseLost, match=f"lease {le.id}"):
        a.should_yield(le)
    assert admin.drain()["draining"] and admin.ping()["draining"]
    with pytest.raises(SchedError, match="draining") as e:
        admin.job("b", {"c": 1})
    assert e.value.code == "draining"
    assert admin.call("register", job="a", clusters={}, attach=True)["ok"]  # a live job may still attach
    admin.drain(False)
    admin.job("b", {"c": 1}).finish()
    a.finish()


def test_submitted_job_attaches_with_its_secret(service):
    srv, admin = service()
    sec = admin.submit("q", {"c": 1})["secret"]
    worker = SchedClient(srv.address, "not-the-token")
    h = worker.job("q", secret=sec, attach=True, heartbeat_s=10)
    assert h.state == "running"
    h.finish()


# ---------------------------------------------------------------------- item 4: operation ids
def test_a_resent_op_returns_the_first_reply(service):
    _, c = service(capacity=(1.0,))
    a = c.job("a", {"c": 1}, heartbeat_s=10)
    tr = c.transport
    msg = {"op": "request", "job": "a", "secret": a.secret, "phase": "actor_train", "id": "op-1"}
    first = tr.call(dict(msg))
    again = tr.call(dict(msg))  # the reply was lost: the same id, the first result
    assert first["ok"] and again["ok"] and again["request"] == first["request"] and again["replayed"]
    other = tr.call({**msg, "id": "op-2"})  # a new id is a new request: refused (the phase is held)
    assert not other["ok"] and "already holds or awaits" in other["error"]
    resent = tr.call({**msg, "id": "op-3", "retry": True})  # a resend whose first reply is not kept
    assert resent["ok"] and resent["request"] == first["request"] and resent["reconciled"]
    lid = c.call("heartbeat", job="a")["leases"][0]["id"]
    rel = {"op": "release", "job": "a", "secret": a.secret, "lease": lid, "id": "op-4"}
    assert tr.call(dict(rel))["ok"] and tr.call(dict(rel))["ok"]  # released once, answered twice
    assert tr.call({**rel, "id": "op-5", "retry": True})["reconciled"]
    assert not tr.call({**rel, "id": "op-6"})["ok"]  # a new release of it is an error
    a.finish()


def test_a_committed_op_whose_reply_is_lost_is_not_done_twice(service, monkeypatch):
    """The reply is lost after the op took effect (a service going down): the client resends
    with the same id, marked as a retry, and gets what the first call did. This used to fail
    with "already holds or awaits phase" and "already released"."""
    from rlcu.sched.protocol import error

    srv, c = service(capacity=(1.0,))
    a = c.job("a", {"c": 1}, heartbeat_s=10)
    real, lost = srv.front._do, []

    def lossy(op, args, msg, caller):
        reply = real(op, args, msg, caller)
        if op in ("request", "release") and op not in lost:
            lost.append(op)
            return error("the connection dropped", "unavailable")
        return reply

    monkeypatch.setattr(srv.front, "_do", lossy)
    le = a.acquire("actor_train")
    a.release(le)
    assert lost == ["request", "release"] and c.retries == 2
    st = c.status()
    assert st["devices"][0]["used"] == 0.0 and st["jobs"][0]["waiting"] == []
    a.finish()


def test_a_view_version_from_before_a_restart_is_not_current(tmp_path):
    """Versions used to restart at 0 with the service: a job waiting on the version it saw
    before the restart slept through the change that gave it the same number again."""
    core = Core([1.0], state=tmp_path / "s.db")
    v = Front(core, "t").handle({"op": "register", "job": "a", "clusters": {"c": 1}}, ADMIN, authenticated=True)
    core.close()
    core = Core(None, state=tmp_path / "s.db")  # the restarted service
    front = Front(core, "t")
    assert front.handle({"op": "request", "job": "a", "phase": "actor_train"}, "a", authenticated=True)["ok"]
    t = time.monotonic()
    r = front.handle({"op": "wait", "job": "a", "version": v["version"], "timeout": 3.0}, "a", authenticated=True)
    assert r["ok"] and r["leases"] and time.monotonic() - t < 1.0
    core.close()


def test_a_register_resent_after_a_restart_finds_its_job(service):
    srv, c = service()
    tr = c.transport
    msg = {"op": "register", "token": TOKEN, "job": "a", "clusters": {"c": 1}, "pid": 4242, "host": "h"}
    first = tr.call({**msg, "id": "r-1"})
    srv.front._ops.clear()  # what a restart forgets
    again = tr.call({**msg, "id": "r-1", "retry": True})
    assert again["ok"] and again["reconciled"] and again["secret"] == first["secret"]
    other = tr.call({**msg, "id": "r-2", "pid": 4243, "retry": True})  # another process: the name is taken
    assert not other["ok"] and "already exists" in other["error"]
