"""The socket server's connections (server.py): framing, admission and replies, all without
blocking, in the server's one loop thread.

A connection reads one head line of at most `MAX_HEAD` bytes (a stranger is read for no more),
then the body it announces; a `hello` is answered at once (the handshake, auth.py), any other
head must prove a key against that handshake before its body is read, and each whole message
goes to the server (`on_message`). A reply the socket's buffer does not take goes out as the
socket takes it (the loop watches it for writing); a reader that takes nothing for
`read_timeout` is closed.

Admission. At `max_conns`, the connection open longest without proving a key (a *stranger*)
is closed to make room for the next one; a stranger younger than `grace` is not (it may be a
job on its way in): until the oldest one's grace is over the server accepts nothing, and the
newcomers wait in the listen queue, first come first served, rather than being refused. So
strangers, however many and however fast they reconnect, cannot keep out a job that holds its
secret: it gets a slot after those that came before it, and then keeps it by proving its
key. (At the cap with no stranger at all, a newcomer is answered "busy" at once.) One job's
secret holds at most `max_job_conns` connections: beyond it the job's least recently used
idle one is closed (its client opens another when it needs one), else the one holding the
held wait nearest its timeout, answered early (the client asks again); so one job holds that
many waits at most.
"""

from __future__ import annotations

import json
import selectors
import socket
import time

from rlcu.sched.protocol import MAX_BODY, MAX_HEAD, SchedError, body_length, decode, error, merge
from rlcu.sched.service import ADMIN


class Conn:
    __slots__ = ("authed", "born", "buf", "busy", "caller", "deadline", "head", "held", "jobs", "need", "out",
                 "session", "sock")

    def __init__(self, sock: socket.socket, now: float, read_timeout: float):
        self.sock, self.buf, self.born, self.deadline = sock, bytearray(), now, now + read_timeout
        self.head, self.need, self.caller, self.session = None, 0, None, None
        self.authed = False  # a message of it proved a key (until then it is a stranger, evicted first)
        self.busy = False  # its message is being answered: in this turn's batch, held, or its reply still going out
        self.out: memoryview | None = None  # the part of a reply the socket has not taken yet
        self.held: tuple[dict, int, float] | None = None  # a held wait (server.py): (message, version, until)
        self.jobs: tuple[str, ...] = ()  # the jobs whose secret it proved (it counts against each one's bound)


class Conns:
    """Every open connection of one server, by file descriptor."""

    def __init__(self, sel: selectors.BaseSelector, front, on_message, *, read_timeout: float, idle_timeout: float,
                 max_conns: int, max_job_conns: int):
        self.sel, self.front, self.on_message = sel, front, on_message
        self.read_timeout, self.idle_timeout = read_timeout, idle_timeout
        self.max_conns, self.max_job_conns = max_conns, max_job_conns
        self.grace = min(1.0, read_timeout)  # a stranger this young is not evicted
        self.all: dict[int, Conn] = {}
        self.strangers: dict[int, Conn] = {}  # oldest first: those that have proved no key yet
        self.by_job: dict[str, set[Conn]] = {}  # the connections that proved each job's secret
        self.held: set[Conn] = set()  # connections with a held wait (server.py)
        self.evicted = 0  # strangers closed to make room at the cap (tests)

    def __len__(self) -> int:
        return len(self.all)

    # ------------------------------------------------------------------ admission
    def room(self, now: float) -> float:
        """0 when a newcomer may be accepted now; else how long until the oldest stranger's
        grace is over (accept nothing until then: the newcomers wait in the listen queue)."""
        c = next(iter(self.strangers.values()), None) if len(self.all) >= self.max_conns else None
        return 0.0 if c is None else max(0.0, c.born + self.grace - now)

    def admit(self, sock: socket.socket) -> None:
        now = time.monotonic()
        if len(self.all) >= self.max_conns and not self._evict_stranger(now):
            _send_now(sock, error(f"the scheduler is at its {self.max_conns} connections, each authenticated: "
                                  "try again", "busy"))
            sock.close()
            return
        sock.setblocking(False)
        c = Conn(sock, now, self.read_timeout)
        self.all[sock.fileno()] = self.strangers[sock.fileno()] = c
        self.sel.register(sock, selectors.EVENT_READ, c)

    def _evict_stranger(self, now: float) -> bool:
        c = next(iter(self.strangers.values()), None)
        if c is None or now - c.born < self.grace:
            return False
        self.evicted += 1
        self.close(c, error(f"the scheduler is at its {self.max_conns} connections: this one, which never "
                            "authenticated, makes room", "busy"))
        return True

    def _count(self, c: Conn) -> bool:
        """Count `c` as authenticated, and among the connections of the job whose secret it
        proved; False when it was refused (closed)."""
        if not c.authed:
            c.authed = True
            self.strangers.pop(c.sock.fileno(), None)
        job = c.caller
        if job is ADMIN or job in c.jobs:
            return True
        mine = self.by_job.setdefault(job, set())
        if len(mine) >= self.max_job_conns:
            idle = [o for o in mine if not o.busy]
            held = [o for o in mine if o.held is not None]
            if idle:
                self.close(min(idle, key=lambda o: o.deadline))
            elif held:  # the wait nearest its timeout, answered as things are (as then): the client asks again
                o = min(held, key=lambda o: o.held[2])
                self.close(o, self.front.wait_now(o.held[0], o.caller)[0])
            else:  # (every one of them mid-reply: a moment)
                self.close(c, error(f"job {job!r} holds {self.max_job_conns} connections, each busy (the most one "
                                    "job may): try again", "busy"))
                return False
            mine = self.by_job.setdefault(job, set())
        mine.add(c)
        c.jobs += (job,)
        return True

    # ------------------------------------------------------------------ reading
    def read(self, c: Conn) -> None:
        try:
            data = c.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close(c)
            return
        if not c.buf and c.head is None and not c.busy:
            c.deadline = min(c.deadline, time.monotonic() + self.read_timeout)  # a message has begun
        c.buf += data
        if not c.busy:
            self.parse(c)
        elif len(c.buf) > MAX_HEAD + MAX_BODY:  # (busy: its message is not answered yet; the next waits for it)
            self.close(c, error("sent more than a message ahead of its reply", "protocol"))

    def parse(self, c: Conn) -> None:
        if c.head is None:
            i = c.buf.find(b"\n", 0, MAX_HEAD)
            if i < 0:
                if len(c.buf) >= MAX_HEAD:
                    self.close(c, error(f"the head line (the auth part of a message) is longer than {MAX_HEAD} "
                                        "bytes", "protocol"))
                return
            line, c.buf = bytes(c.buf[:i]), c.buf[i + 1:]
            try:
                head = decode(line, "head")
                c.need = body_length(head)
                if head.get("op") == "hello":
                    self._hello(c, head)
                    return
                c.caller = self.front.authenticate(head, c.session)
            except SchedError as e:
                self.close(c, error(str(e), e.code))
                return
            if not self._count(c):
                return
            c.head = head
        if len(c.buf) < c.need:
            return
        body, c.buf = bytes(c.buf[:c.need]), c.buf[c.need:]
        head, c.head, need, c.need = c.head, None, c.need, 0
        try:
            msg = merge(head, decode(body, "body") if need else {})
        except SchedError as e:
            self.close(c, error(str(e), e.code))
            return
        c.busy = True
        self.on_message(c, msg)

    def _hello(self, c: Conn, head: dict) -> None:
        """The handshake (auth.py): answered at once; it proves nothing of the client yet."""
        if c.session is not None or c.need:
            self.close(c, error("a hello opens a connection, once, in one line", "protocol"))
            return
        reply, c.session = self.front.hello(head)
        if c.session is None:
            self.close(c, reply)
            return
        c.busy = True
        self.answer(c, reply)

    # ------------------------------------------------------------------ replies
    def answer(self, c: Conn, reply: dict) -> None:
        data = (json.dumps(reply) + "\n").encode()
        try:
            n = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self.close(c)
            return
        if n < len(data):
            c.out, c.deadline = memoryview(data)[n:], time.monotonic() + self.read_timeout
            self.sel.modify(c.sock, selectors.EVENT_WRITE, c)
            return
        self._done(c)

    def flush(self, c: Conn) -> None:
        """Send more of a reply the socket did not take at once (it is writable now)."""
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close(c)
            return
        c.out, c.deadline = c.out[n:], time.monotonic() + self.read_timeout
        if len(c.out):
            return
        c.out = None
        self.sel.modify(c.sock, selectors.EVENT_READ, c)
        self._done(c)

    def _done(self, c: Conn) -> None:
        c.busy = False
        c.deadline = time.monotonic() + (self.idle_timeout if c.authed else self.read_timeout)
        if c.buf:  # a client that sent its next message before this reply
            self.parse(c)

    def sweep(self, now: float) -> None:
        """Close the connections past their deadline (held waits excepted: the server's)."""
        for c in [c for c in self.all.values() if c.deadline < now and c.held is None]:
            if c.out is not None:
                self.close(c)  # a reader too slow to take its reply
            elif not c.busy:
                self.close(c, error(f"no complete message within {self.read_timeout:g} s", "protocol")
                           if c.buf or not c.authed else None)

    def close(self, c: Conn, reply: dict | None = None) -> None:
        fd = c.sock.fileno()
        if fd < 0:  # (closed already: its peer left while its message was in a batch)
            self.held.discard(c)
            return
        if reply is not None:
            _send_now(c.sock, reply)
        self.all.pop(fd, None)
        self.strangers.pop(fd, None)
        self.held.discard(c)
        for job in c.jobs:
            mine = self.by_job.get(job)
            if mine is not None:
                mine.discard(c)
                if not mine:
                    del self.by_job[job]
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()


def _send_now(sock: socket.socket, reply: dict) -> None:
    """A short reply to a connection about to be closed, without waiting on a slow reader."""
    try:
        sock.setblocking(False)
        sock.send((json.dumps(reply) + "\n").encode())
    except OSError:
        pass
