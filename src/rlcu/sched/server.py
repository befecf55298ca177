"""`rlcu sched serve`: the scheduler service on a Unix socket or on loopback TCP.

One event-loop thread accepts connections and reads every frame without blocking. The
messages that became whole in one turn of the loop are run there, one after the other,
through the `Front` (service.py: authority, validation, op ids) and the `Core` (core.py),
under one group commit (`Core.deferred`): their replies are sent once the commit holding
their state is done, and a connection stays open for its next message (clients keep theirs).
Only a `wait`, which blocks, goes to a worker thread (and a reply too long for the socket's
buffer: a worker finishes sending it), so an idle or slow connection costs a file
descriptor and no thread, and a stranger is read for at most `MAX_HEAD` bytes (the head,
which carries the token or job secret) before the service knows who it is:

    read_timeout   a head (and its body) must arrive within this many seconds of the
                   connection or of the last reply, else the connection is closed
    idle_timeout   an authenticated connection with no message for this long is closed
    max_conns      connections beyond this are answered "busy" and closed at once
    accept errors  (EMFILE: out of file descriptors) pause accepting with a growing back-off
                   instead of spinning, while the open connections are still served

TCP is refused on anything but a loopback address (several machines go through `--ray`).
A Unix socket path that exists is replaced only when it is a stale socket. The token lives
in `<state>/token` (0600) beside `<state>/sched.db` and the socket `<state>/sched.sock`, in
a state folder of mode 0700, so a client of the same user finds all three.

A ticker thread calls `core.tick()` every `tick_s` (reclaiming the leases of jobs that stopped
heartbeating, and letting waits age).
"""

from __future__ import annotations

import errno
import json
import os
import queue
import secrets
import selectors
import socket
import stat
import threading
import time
from pathlib import Path

from rlcu.sched.protocol import (
    MAX_HEAD,
    SchedError,
    body_length,
    decode,
    error,
    is_loopback,
    merge,
    parse_address,
)
from rlcu.sched.service import Front

_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_TO_WORKER = frozenset({"wait"})  # ops that may block: run by a worker thread, not the loop
_READS_FIRST = frozenset({"ping", "status", "metrics", "heartbeat"})  # change nothing kept: run ahead of a batch


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
    tmp = p.with_name(f".token.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself survives a crash
    finally:
        os.close(dfd)
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


class _Conn:
    __slots__ = ("authed", "broken", "buf", "busy", "caller", "deadline", "head", "need", "sock")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.buf, self.deadline = sock, bytearray(), deadline
        self.head, self.need, self.caller, self.authed = None, 0, None, False
        self.busy = self.broken = False  # busy: a worker has it (no deadline); broken: its reply failed


class SchedServer:
    """SchedServer(core, "unix:run/sched.sock", token).start() ... .stop()"""

    def __init__(self, core, addr: str, token: str | None, tick_s: float | None = None, *,
                 read_timeout: float = 10.0, idle_timeout: float = 300.0, max_conns: int = 1024,
                 max_workers: int = 512):
        self.core, self.token = core, token
        self.front = Front(core, token)
        self.read_timeout, self.idle_timeout, self.max_conns = read_timeout, idle_timeout, max_conns
        self.max_workers = max_workers
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
        self._accept_failed = False
        self.failed: BaseException | None = None  # what stopped the loop or the ticker (serve_forever raises it)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: dict[int, _Conn] = {}  # by fd: every open connection, in the loop or in a worker
        self._back: queue.SimpleQueue = queue.SimpleQueue()  # connections a worker hands back to the loop
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._pool_lock = threading.Lock()
        self._workers = self._idle = 0
        self._batch: list[tuple[_Conn, dict]] = []  # messages read in this turn of the loop, run at its end
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
        sel = self._sel
        sel.register(self.lsn, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        paused_until, backoff, swept = None, 0.01, 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if paused_until is not None and now >= paused_until:
                sel.register(self.lsn, selectors.EVENT_READ, "accept")
                paused_until = None
            for key, _ in sel.select(timeout=0.1):
                if key.data == "accept":
                    if self._accept():
                        backoff = 0.01
                    elif self._accept_failed:
                        sel.unregister(self.lsn)  # out of descriptors: stop accepting for a while
                        paused_until = time.monotonic() + backoff
                        backoff = min(1.0, backoff * 2)
                elif key.data == "wake":
                    self._drain_wake()
                else:
                    self._read(key.data)
            self._run_batch()
            now = time.monotonic()
            if now - swept >= 0.02:
                swept = now
                for c in [c for c in self._conns.values() if c.deadline < now and not c.busy]:
                    self._close(c, error(f"no complete message within {self.read_timeout:g} s", "protocol")
                                if c.buf or not c.authed else None)

    def _accept(self) -> bool:
        """Accept what is waiting; False when nothing was (or accept failed: see _accept_failed)."""
        self._accept_failed = False
        got = False
        for _ in range(64):
            try:
                sock, _ = self.lsn.accept()
            except (BlockingIOError, InterruptedError):
                return got
            except OSError as e:
                if e.errno in _ACCEPT_ERRORS:
                    self.accept_errors += 1
                    self._accept_failed = True
                    return False
                if self._stop.is_set():
                    return got
                continue  # ECONNABORTED and the like: that one connection is gone
            got = True
            self.accepted += 1
            if len(self._conns) >= self.max_conns:
                _send_now(sock, error(f"the scheduler is at its {self.max_conns} connections: try again", "busy"))
                sock.close()
                continue
            sock.setblocking(False)
            c = _Conn(sock, time.monotonic() + self.read_timeout)
            self._conns[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)
        return got

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                c = self._back.get_nowait()
            except queue.Empty:
                return
            c.busy = False
            if c.sock.fileno() < 0:
                continue
            if c.broken:
                self._close(c)
                continue
            c.deadline = time.monotonic() + self.idle_timeout
            self._sel.register(c.sock, selectors.EVENT_READ, c)
            if c.buf:  # a client that sent its next message before this reply
                self._parse(c)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(c)
            return
        if not c.buf and c.head is None:
            c.deadline = min(c.deadline, time.monotonic() + self.read_timeout)  # a message has begun
        c.buf += data
        if not c.busy:  # (busy: its message of this turn is not answered yet; the next waits for it)
            self._parse(c)

    def _parse(self, c: _Conn) -> None:
        if c.head is None:
            i = c.buf.find(b"\n", 0, MAX_HEAD)
            if i < 0:
                if len(c.buf) >= MAX_HEAD:
                    self._close(c, error(f"the head line (the auth part of a message) is longer than {MAX_HEAD} "
                                         "bytes", "protocol"))
                return
            line, c.buf = bytes(c.buf[:i]), c.buf[i + 1:]
            try:
                head = decode(line, "head")
                c.caller, c.authed = self.front.authenticate(head), True
                c.need = body_length(head)
            except SchedError as e:
                self._close(c, error(str(e), e.code))
                return
            c.head = head
        if len(c.buf) < c.need:
            return
        body, c.buf = bytes(c.buf[:c.need]), c.buf[c.need:]
        head, c.head, need, c.need = c.head, None, c.need, 0
        try:
            msg = merge(head, decode(body, "body") if need else {})
        except SchedError as e:
            self._close(c, error(str(e), e.code))
            return
        c.busy = True
        if msg.get("op") in _TO_WORKER:
            self._sel.unregister(c.sock)
            self._submit(c, msg)
        else:
            self._batch.append((c, msg))

    def _run_batch(self) -> None:
        """Run the messages read in this turn under one group commit, then send their replies
        (and run what their connections sent meanwhile, in a batch of its own)."""
        while self._batch:
            batch, self._batch = self._batch, []
            reads = [(c, msg) for c, msg in batch if msg.get("op") in _READS_FIRST]
            if reads:  # before the batch's changes: they show what is committed, and leave at once
                batch = [(c, msg) for c, msg in batch if msg.get("op") not in _READS_FIRST]
                for c, msg in reads:
                    self._answer(c, self.front.handle(msg, c.caller, authenticated=True))
            with self.core.deferred() as done:
                replies = [self.front.handle(msg, c.caller, authenticated=True) for c, msg in batch]
            self.batches += 1
            self.batched += len(batch)
            for (c, _), reply in zip(batch, replies):
                self._answer(c, reply if done.failure is None else done.failure)

    def _answer(self, c: _Conn, reply: dict) -> None:
        """Send a reply from the loop without blocking; a worker sends what the socket's buffer
        does not take."""
        data = (json.dumps(reply) + "\n").encode()
        try:
            n = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._close(c)
            return
        if n < len(data):
            self._sel.unregister(c.sock)
            self._submit(c, None, data[n:])
            return
        c.busy = False
        c.deadline = time.monotonic() + self.idle_timeout
        if c.buf:  # a client that sent its next message before this reply
            self._parse(c)

    def _close(self, c: _Conn, reply: dict | None = None) -> None:
        if reply is not None:
            _send_now(c.sock, reply)
        self._conns.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    # ------------------------------------------------------------------ workers
    def _submit(self, c: _Conn, msg: dict | None, data: bytes | None = None) -> None:
        """To a worker: run `msg` and send its reply, or (msg None) send the rest of one, `data`."""
        with self._pool_lock:
            spawn = self._idle == 0 and self._workers < self.max_workers
            if spawn:
                self._workers += 1
        if spawn:
            t = threading.Thread(target=self._work, name="sched-worker", daemon=True)
            t.start()
        self._tasks.put((c, msg, data))

    def _work(self) -> None:
        while True:
            with self._pool_lock:
                self._idle += 1
            task = self._tasks.get()
            with self._pool_lock:
                self._idle -= 1
            if task is None:
                with self._pool_lock:
                    self._workers -= 1
                return
            c, msg, data = task
            if msg is not None:
                data = (json.dumps(self.front.handle(msg, c.caller, authenticated=True)) + "\n").encode()
            try:
                c.sock.settimeout(self.read_timeout)
                c.sock.sendall(data)
                c.sock.setblocking(False)
            except OSError:
                c.broken = True  # the loop closes it
            self._back.put(c)
            try:
                self._wake_w.send(b"x")
            except (BlockingIOError, OSError):
                pass

    def _tick(self) -> None:
        self.core.run_ticks(self._stop, self.tick_s)  # never dies silently; a fatal state ends it

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
        with self._pool_lock:
            n = self._workers
        for _ in range(n):
            self._tasks.put(None)
        for c in list(self._conns.values()):
            self._close(c)
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


def _send_now(sock: socket.socket, reply: dict) -> None:
    """A short reply to a connection about to be closed, without waiting on a slow reader."""
    try:
        sock.setblocking(False)
        sock.send((json.dumps(reply) + "\n").encode())
    except OSError:
        pass


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
