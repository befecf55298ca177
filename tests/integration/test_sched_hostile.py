"""The scheduler service against hostile local processes (issue 14, items 3-5): a job cannot
hide another job's grant by parking waits (a wait costs no thread; one job's connections are
bounded); strangers that hold every connection slot cannot keep a job out, before or after a
restart; nothing a client sends teaches an impostor on the service's port the token or a
job's secret, and nothing recorded on the way can be replayed."""

import select
import socket
import threading
import time

import pytest
from support.sched_util import servers

from rlcu.sched.client import SchedClient, SchedError
from rlcu.sched.core import Core

TOKEN = "h0stile-t0ken"
SPEC = {"c": 1}


@pytest.fixture
def serve(tmp_path):
    with servers(tmp_path, TOKEN, [1.0]) as serve:
        yield serve


# ---------------------------------------------------------------------- item 3: waits
def test_waits_cost_no_thread_and_one_job_cannot_hide_another_jobs_grant(serve):
    """560 waits parked by one job used to take all 512 of the service's worker threads: a
    grant to another job then never reached it (its acquire timed out, the lease booked to
    it). Now a wait is held in the loop (no thread), and one job's secret holds at most
    `max_job_conns` (16) connections: of the hog's 24 waits, 8 are answered early."""
    srv = serve()
    hog_client = SchedClient(srv.address, TOKEN, retry_s=1.0)
    hog = hog_client.job("hog", SPEC, heartbeat_s=30)
    victim = SchedClient(srv.address, TOKEN).job("victim", SPEC, heartbeat_s=30)
    lease = hog.acquire("actor_train")  # the one device: the victim waits for it
    version, outcomes = hog.view["version"], []

    def park():
        try:
            outcomes.append(hog_client.call("wait", job="hog", version=version, timeout=8.0)["version"] == version)
        except SchedError as e:
            outcomes.append(e.code)

    base = threading.active_count()
    parkers = [threading.Thread(target=park) for _ in range(24)]
    for t in parkers:
        t.start()
    end = time.monotonic() + 5
    while len(outcomes) < 24 - 16 and time.monotonic() < end:  # (the waits beyond the bound: answered)
        time.sleep(0.02)
    time.sleep(0.2)
    # the test's own 24 threads (or fewer), and none of the service's: it used to spawn one per wait
    assert threading.active_count() <= base + 24 + 2, threading.active_count() - base
    assert outcomes == [True] * 8 and len(srv.conns.held) == 16  # answered as things were: nothing moved
    got = []
    waiter = threading.Thread(target=lambda: got.append(victim.acquire("actor_train", timeout=5)))
    waiter.start()
    time.sleep(0.1)
    t = time.monotonic()
    hog.release(lease)  # the grant goes to the victim, and the hog's own view moves: its waits end
    waiter.join(6)
    assert got and time.monotonic() - t < 2.0
    for th in parkers:
        th.join(6)
    assert len(outcomes) == 24 and outcomes.count(False) >= 15, outcomes  # (the rest: moved)
    victim.release(got[0])
    victim.finish()
    hog.finish()


def test_the_ray_actor_bounds_the_threads_one_jobs_waits_hold():
    """The Ray actor long-polls a wait on one of its 256 threads: one job could take them all,
    and every other call (a grant's wait, a release) queued behind. Now one job holds 16 at
    most; a wait beyond is answered "busy" at once. (The actor's class, run without Ray.)"""
    from rlcu.sched.auth import Handshake
    from rlcu.sched.ray_backend import _CoreActor

    actor = _CoreActor([1.0], ["cpu0"], "phase", 60.0, 30.0, None, 0.05, TOKEN)
    try:
        hs = Handshake({}, TOKEN)
        hs.accept(actor.hello(hs.hello), "the actor")

        def call(**msg):
            return actor.handle({**hs.sign(msg), "session": hs.snonce})

        sec = call(op="register", token=TOKEN, job="hog", clusters=SPEC)["secret"]
        v = call(op="heartbeat", job="hog", secret=sec)["version"]
        replies = []
        waits = [threading.Thread(target=lambda: replies.append(
            call(op="wait", job="hog", secret=sec, version=v, timeout=5.0))) for _ in range(17)]
        for t in waits:
            t.start()
        end = time.monotonic() + 3
        while not replies:
            assert time.monotonic() < end, "every wait was held"
            time.sleep(0.02)
        time.sleep(0.2)
        assert [r["code"] for r in replies] == ["busy"]
        assert call(op="ping", token=TOKEN)["ok"]
        assert call(op="request", job="hog", secret=sec, phase="actor_train")["ok"]  # granted: its waits return
        for t in waits:
            t.join(5)
        assert len(replies) == 17 and sum(r["ok"] for r in replies) == 16
    finally:
        actor.stop()


# ---------------------------------------------------------------------- item 4: strangers
class Squatter:
    """A process without the token that keeps `n` connections open and reopens each one the
    moment it is closed."""

    def __init__(self, path: str, n: int):
        self.path, self.n, self.stop = path, n, threading.Event()
        self.socks: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.path)
            self.socks.append(s)
        except OSError:  # (the service is restarting)
            s.close()

    def _run(self) -> None:
        while not self.stop.is_set():
            while len(self.socks) < self.n and not self.stop.is_set():
                self._open()
                if len(self.socks) < self.n:
                    time.sleep(0.01)
            ready, _, _ = select.select(self.socks, [], [], 0.02)
            for s in ready:  # a "busy" notice or an end of file: closed by the service; at once again
                self.socks.remove(s)
                s.close()
        for s in self.socks:
            s.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def test_strangers_at_the_cap_cannot_keep_a_job_out(serve, tmp_path):
    """Strangers holding every slot, reopened as soon as closed, used to refuse every new
    connection: a new job's register failed after its retries, and across a restart a live
    job holding a lease could not reconnect and was declared dead."""
    srv = serve(core=Core([1.0], state=tmp_path / "s.db", heartbeat_timeout=3.0), max_conns=8)
    squat = Squatter(srv.address[len("unix:"):], 8)
    try:
        time.sleep(1.2)  # every slot held, past the grace a newcomer gets
        t = time.monotonic()
        job = SchedClient(srv.address, TOKEN, retry_s=3.0).job("a", SPEC, heartbeat_s=0.3)
        lease = job.acquire("actor_train")
        assert time.monotonic() - t < 2.5
        srv.stop()  # a restart on the same state, the squatter reconnecting as soon as it listens
        srv = serve(core=Core(None, state=tmp_path / "s.db", heartbeat_timeout=3.0), max_conns=8)
        time.sleep(3.5)  # past the heartbeat timeout: a job that could not get back in is dead by now
        assert job.state == "running"
        job.release(lease)
        job.finish()
        assert srv.conns.evicted > 0
    finally:
        squat.close()


# ---------------------------------------------------------------------- item 5: no key travels
class Impostor:
    """Whatever took the service's port while it was down: records every byte it is sent and
    answers each line as well as it can without the token."""

    def __init__(self, port: int):
        self.lsn = socket.create_server(("127.0.0.1", port))
        self.got = bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.lsn.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as f:
                for line in f:
                    self.got += line
                    conn.sendall(b'{"ok": true, "protocol": 2, "nonce": "%s", "proof": "%s", "version": 1}\n'
                                 % (b"ab" * 16, b"0" * 64))

    def close(self) -> None:
        self.lsn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_impostor_on_the_port_learns_neither_token_nor_secret(serve):
    port = free_port()
    srv = serve(core=Core([1.0]), addr=f"127.0.0.1:{port}")
    c = SchedClient(srv.address, TOKEN, retry_s=1.0)
    secret = c.job("a", SPEC, heartbeat_s=30).secret
    srv.stop()  # down: anyone may take the port now
    imp = Impostor(port)
    try:
        admin = SchedClient(f"127.0.0.1:{port}", TOKEN, retry_s=1.0)
        worker = SchedClient(f"127.0.0.1:{port}", retry_s=1.0)
        worker.set_secret("a", secret)
        for call in (admin.ping, lambda: worker.call("heartbeat", job="a"),
                     lambda: admin.call("register", job="b", clusters=SPEC)):
            with pytest.raises(SchedError, match="did not prove it knows the key") as e:
                call()
            assert e.value.code == "auth"
        assert imp.got  # it was asked (a hello), and told nothing of either key
        assert TOKEN.encode() not in imp.got and secret.encode() not in imp.got
        assert b'"register"' not in imp.got  # nothing past the hello either
    finally:
        imp.close()


class Recorder:
    """A relay between clients and the service that keeps what the clients sent."""

    def __init__(self, target: tuple[str, int]):
        self.lsn = socket.create_server(("127.0.0.1", 0))
        self.port, self.target, self.sent = self.lsn.getsockname()[1], target, []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                a, _ = self.lsn.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            rec = bytearray()
            self.sent.append(rec)
            threading.Thread(target=self._pipe, args=(a, b, rec), daemon=True).start()
            threading.Thread(target=self._pipe, args=(b, a, None), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, rec) -> None:
        try:
            while data := src.recv(65536):
                if rec is not None:
                    rec += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_what_a_client_sent_cannot_be_replayed(serve):
    srv = serve(core=Core([1.0]), addr="127.0.0.1:0")
    host, port = srv.address.rsplit(":", 1)
    rec = Recorder((host, int(port)))
    c = SchedClient(f"127.0.0.1:{rec.port}", TOKEN, retry_s=2.0)  # through the recorder: it works
    assert c.ping()["ok"]
    job = c.job("a", SPEC, heartbeat_s=30)
    job.release(job.acquire("actor_train"))
    c.close()
    assert rec.sent and all(TOKEN.encode() not in r and job.secret.encode() not in r for r in rec.sent)
    for sent in rec.sent:  # each recorded connection, replayed as it was to the service
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(bytes(sent))
            s.shutdown(socket.SHUT_WR)
            replies = b""
            while chunk := s.recv(65536):
                replies += chunk
        lines = replies.splitlines()
        assert all(b'"ok": false' in ln for ln in lines[1:]), lines  # the hello's answer, then refusals
    assert [j["job"] for j in c.status()["jobs"]] == ["a"]  # and the replays did nothing
    job.finish()
