"""`rlcu sched serve`: the scheduler service on a Unix socket or on loopback TCP.

One event-loop thread accepts connections, reads every frame and writes every reply without
blocking. The messages that became whole in one turn of the loop are run there, one after the
other, through the `Front` (service.py: authority, validation, op ids) and the `Core` (core.py),
under one group commit (`Core.deferred`): their replies are sent once the commit holding
their state is done, and a connection stays open for its next message (clients keep theirs).
A `wait` does not block either: it is answered at once or *held* (state in the loop, no
thread) until its job's view moves (after a batch or a tick) or its time is up. A reply longer
than the socket's buffer goes out as the socket takes it. So an idle, slow or waiting
connection costs a file descriptor and no thread, and a stranger is read for at most
`MAX_HEAD` bytes (a hello, then a head, which carries the proof of a key) before the service
knows who it is. Each connection opens with a handshake (auth.py) in which the service
proves it knows the token (or the job's secret), and whose nonces every later proof is bound
to: the token and secrets never travel.

    read_timeout   a head (and its body) must arrive within this many seconds of the
                   connection or of the last reply, else the connection is closed
    idle_timeout   an authenticated connection with no message for this long is closed
    max_conns      at the cap, the connection open longest without proving a key (a
                   *stranger*) is closed to make room: strangers cannot keep out a job
                   that holds its secret (conns.py)
    max_job_conns  the connections one job's secret may hold, and so its held waits
    accept errors  (EMFILE: out of file descriptors) pause accepting with a growing back-off
                   instead of spinning, while the open connections are still served

TCP is refused on anything but a loopback address (several machines go through `--ray`).
A Unix socket path that exists is replaced only when it is a stale socket. The token lives
in `<state>/token` (0600) beside `<state>/sched.db` and the socket `<state>/sched.sock`, in
a state folder of mode 0700, so a client of the same user finds all three.

A ticker thread calls `core.tick()` every `tick_s` (reclaiming the leases of jobs that stopped
heartbeating, and letting waits age), and wakes the loop after each (held waits).
"""

from __future__ import annotations

import errno
import os
import secrets
import selectors
import socket
import stat
import threading
import time
from pathlib import Path

from rlcu.files import atomic_write
from rlcu.sched.conns import Conn, Conns
from rlcu.sched.protocol import is_loopback, parse_address
from rlcu.sched.service import Front

_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# run ahead of a batch: reads (they change nothing kept) and waits (answered, or held: never a thread)
_FIRST = frozenset({"ping", "status", "metrics", "heartbeat", "wait"})


def secure_state_dir(state_dir: Path) -> Path:
    """Make the state folder (0700) and tighten what is in it: the database, its -wal/-shm,
    the token and the logs to 0600."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    for p in [*state_dir.glob("sched.db*"), state_dir / "token", *state_dir.glob("logs/*")]:
        if p.is_file():
            os.chmod(p, 0o600)
    if (state_dir / "logs").is_dir():
        os.chmod(state_dir / "logs", 0o700)
    return state_dir


def load_token(state_dir: Path, token: str | None = None) -> str:
    """The given token (saved), or the saved one, or a new random one (saved, mode 0600).

    The file is replaced atomically (a temporary file, fsynced, renamed over it), so a full
    disk leaves the old token or none, never part of one. A saved token that is empty, cut
    short (every token this writes ends in a newline) or unreadable is refused with a
    ValueError naming the file: a service must never take "" (or a fragment) as its token,
    since the token is admin authority and every job's secret is derived from it."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    p = state_dir / "token"
    if token is None and p.exists():
        return _read_saved_token(p)
    if token is not None:
        _check_token(token, "the token given")
    token = token or secrets.token_hex(16)
    def write(tmp: Path) -> None:  # created 0600: the token is never readable by others, not even briefly
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(token + "\n")

    atomic_write(p, write, mode=0o600)
    return token


def _check_token(token: str, what: str) -> None:
    """A token is one line of printable characters without spaces (ValueError naming `what`)."""
    if not token:
        raise ValueError(f"{what} is empty: a service token must be a non-empty secret")
    if not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"{what} holds spaces or control characters: a token is one word of printable characters")


def _read_saved_token(p: Path) -> str:
    fix = f"remove {p} to make a new token (every job's secret changes), or give the old one with --token-file"
    try:
        raw = p.read_bytes().decode()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "it is not text"
        raise ValueError(f"cannot read the service token {p} ({why}): refusing to start; {fix}") from None
    if not raw.strip():
        raise ValueError(f"the service token {p} is empty (a write cut short, e.g. by a full disk): refusing to "
                         f"start; {fix}")
    if not raw.endswith("\n"):
        raise ValueError(f"the service token {p} is cut short (it does not end in a newline, as every token the "
                         f"service writes does): refusing to start; {fix}")
    token = raw.strip()
    _check_token(token, f"the service token {p}")
    return token


class _Ticks:
    """The ticker's stop event, which also wakes the loop before each pause: the tick just run
    may have granted a held wait's phase (or reclaimed a dead job's leases)."""

    __slots__ = ("stop", "wake")

    def __init__(self, stop: threading.Event, wake):
        self.stop, self.wake = stop, wake

    def wait(self, timeout: float) -> bool:
        self.wake()
        return self.stop.wait(timeout)

    def is_set(self) -> bool:
        return self.stop.is_set()


class SchedServer:
    """SchedServer(core, "unix:run/sched.sock", token).start() ... .stop()"""

    def __init__(self, core, addr: str, token: str | None, tick_s: float | None = None, *,
                 read_timeout: float = 10.0, idle_timeout: float = 300.0, max_conns: int = 1024,
                 max_job_conns: int = 16):
        self.core, self.token = core, token
        self.front = Front(core, token)
        self.kind, where = parse_address(addr)
        if self.kind == "unix":
            path = Path(where)
            path.parent.mkdir(parents=True, exist_ok=True)
            _clear_stale_socket(path)
            self.lsn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.lsn.bind(str(path))
            os.chmod(path, 0o600)
            self.address = f"unix:{path}"
        elif self.kind == "tcp":
            host, port = where
            if not is_loopback(host):
                raise ValueError(f"refusing to listen on {host}: the service serves loopback only "
                                 "(127.0.0.1 / ::1); several machines go through `rlcu sched serve --ray`")
            self.lsn = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            self.lsn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.lsn.bind((host, port))
            self.address = f"{host}:{self.lsn.getsockname()[1]}"
        else:
            raise ValueError(f"{addr!r} is a Ray address: use `rlcu sched serve --ray`")
        self.lsn.listen(256)  # room for a pool's worth of jobs connecting at once
        self.lsn.setblocking(False)
        self.tick_s = tick_s if tick_s is not None else max(0.05, min(1.0, core.heartbeat_timeout / 4))
        self.accept_errors = 0  # accept() calls that failed for lack of descriptors (tests, metrics)
        self.accepted = 0  # connections accepted (tests, benches: clients keep theirs)
        self._backoff = 0.01  # the next pause after accept() ran out of descriptors
        self.failed: BaseException | None = None  # what stopped the loop or the ticker (serve_forever raises it)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._batch: list[tuple[Conn, dict]] = []  # messages read in this turn of the loop, run at its end
        self.conns = Conns(self._sel, self.front, lambda c, msg: self._batch.append((c, msg)),
                           read_timeout=read_timeout, idle_timeout=idle_timeout, max_conns=max_conns,
                           max_job_conns=max_job_conns)
        self._moved = False  # something ran that may have moved a held wait's job (a batch, a tick)
        self.batches = self.batched = 0  # group commits of the loop and the messages in them (benches, tests)

    # ------------------------------------------------------------------ the loop
    def _guard(self, fn) -> None:
        """Run a service thread; if it dies the whole service stops (and serve_forever raises)
        rather than going on half alive."""
        try:
            fn()
        except BaseException as e:
            if not self._stop.is_set():
                self.failed = e
                self._stop.set()
                raise

    def _loop(self) -> None:
        sel, conns = self._sel, self.conns
        sel.register(self.lsn, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        paused_until, paused_at, swept, polled = None, 0, 0.0, 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if paused_until is not None and (now >= paused_until or len(conns) < paused_at):  # (or one closed)
                sel.register(self.lsn, selectors.EVENT_READ, "accept")
                paused_until = None
            timeout = 0.05 if conns.held else 0.1
            for key, mask in sel.select(timeout if paused_until is None else min(timeout, paused_until - now)):
                if key.data == "accept":
                    pause = self._accept()
                    if pause is not None:  # stop accepting for a while (the newcomers wait in the listen queue)
                        sel.unregister(self.lsn)
                        paused_until, paused_at = time.monotonic() + pause, len(conns)
                elif key.data == "wake":
                    self._drain_wake()
                elif mask & selectors.EVENT_WRITE:
                    conns.flush(key.data)
                else:
                    conns.read(key.data)
            self._run_batch()
            now = time.monotonic()
            if conns.held and (self._moved or now - polled >= 0.05):
                self._moved, polled = False, now
                self._poll_held(now)
                self._run_batch()  # (what clients sent behind the waits just answered)
            if now - swept >= 0.02:
                swept = now
                conns.sweep(now)

    def _accept(self) -> float | None:
        """Accept what is waiting; how long to stop accepting for (None: go on): at the cap
        with every stranger in its grace, until the oldest one's is over; out of descriptors,
        a back-off growing to 1 s (the listening socket stays readable: it would spin)."""
        for _ in range(64):
            pause = self.conns.room(time.monotonic())
            if pause > 0:
                return pause
            try:
                sock, _ = self.lsn.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as e:
                if e.errno in _ACCEPT_ERRORS:
                    self.accept_errors += 1
                    pause, self._backoff = self._backoff, min(1.0, self._backoff * 2)
                    return pause
                if self._stop.is_set():
                    return None
                continue  # ECONNABORTED and the like: that one connection is gone
            self._backoff = 0.01
            self.accepted += 1
            self.conns.admit(sock)
        return None

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # (full: a wake is pending anyway; closed: stopping)
            pass

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        self._moved = True

    def _run_batch(self) -> None:
        """Run the messages read in this turn under one group commit, then send their replies
        (and run what their connections sent meanwhile, in a batch of its own). Reads and
        waits go first: they show what is committed, and leave (or are held) at once."""
        while self._batch:
            batch, self._batch = self._batch, []
            first = [(c, msg) for c, msg in batch if msg.get("op") in _FIRST]
            if first:
                batch = [(c, msg) for c, msg in batch if msg.get("op") not in _FIRST]
                for c, msg in first:
                    if msg.get("op") == "wait":
                        self._hold(c, msg)
                    else:
                        self._answer(c, self.front.handle(msg, c.caller, authenticated=True))
            with self.core.deferred() as done:
                replies = [self.front.handle(msg, c.caller, authenticated=True) for c, msg in batch]
            self.batches += 1
            self.batched += len(batch)
            self._moved = self._moved or bool(batch)
            for (c, _), reply in zip(batch, replies):
                self._answer(c, reply if done.failure is None else done.failure)

    def _answer(self, c: Conn, reply: dict) -> None:
        self.conns.answer(c, reply)

    def _close(self, c: Conn, reply: dict | None = None) -> None:
        self.conns.close(c, reply)

    # ------------------------------------------------------------------ held waits
    def _hold(self, c: Conn, msg: dict) -> None:
        """A wait: answered now, or held in the loop (its connection, no thread) until its
        job's view moves or its time is up."""
        reply, left = self.front.wait_now(msg, c.caller)
        if left <= 0 or c.sock.fileno() < 0:  # (final, or its client left meanwhile)
            self._answer(c, reply)
            return
        until = time.monotonic() + left
        c.held, c.deadline = (msg, reply["version"], until), until
        self.conns.held.add(c)

    def _poll_held(self, now: float) -> None:
        for c in [c for c in self.conns.held if c.held[2] <= now or self.front.settled(c.held[0]["job"], c.held[1])]:
            reply, left = self.front.wait_now(c.held[0], c.caller)
            if left > 0 and now < c.held[2]:
                continue  # (the hint was early: the view is where it was)
            self.conns.held.discard(c)
            c.held = None
            self._answer(c, reply)

    def _tick(self) -> None:
        self.core.run_ticks(_Ticks(self._stop, self._wake), self.tick_s)  # never dies silently; fatal ends it

    # ------------------------------------------------------------------ life
    def start(self) -> SchedServer:
        for fn, name in ((self._loop, "sched-serve"), (self._tick, "sched-tick")):
            t = threading.Thread(target=self._guard, args=(fn,), name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        self.start()
        try:
            self._stop.wait()
        finally:
            self.stop()
        if self.failed is not None:
            raise RuntimeError(f"the scheduler service stopped: {type(self.failed).__name__}: {self.failed}") \
                from self.failed

    def stop(self, close_core: bool = True) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        for c in list(self.conns.all.values()):
            self.conns.close(c)
        self._sel.close()
        self.lsn.close()
        self._wake_r.close()
        self._wake_w.close()
        if self.kind == "unix":
            Path(self.address[len("unix:"):]).unlink(missing_ok=True)
        if close_core:
            self.core.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _clear_stale_socket(path: Path) -> None:
    """Remove `path` when it is a socket nobody listens on; refuse anything else there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket: refusing to replace it (choose another --addr)")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        raise OSError(f"a scheduler already listens on {path}")
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink()  # a stale socket from a service that died
    finally:
        s.close()
