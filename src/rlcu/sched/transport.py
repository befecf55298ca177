"""The client's socket transport: persistent connections to `rlcu sched serve` (a Unix socket
or loopback TCP), one per thread, with the framing of protocol.py. `SchedClient` (client.py)
uses it for every address that is not a Ray one.

Each new connection opens with the handshake of auth.py: the transport sends a hello, checks
that the service proved it knows the token (or the job's secret) and only then sends the
message, whose token or secret goes as a proof bound to that connection, never itself. So a
process that took the service's port (it was down) gets a hello and nothing else, and the
call fails with an "auth" error naming the address."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
import weakref

from rlcu.sched.auth import Handshake
from rlcu.sched.protocol import MAX_REPLY, SchedError, encode, parse_address

__all__ = ["SocketTransport"]


class SocketTransport:
    """Persistent connections: each thread keeps one connection to the service and sends all
    its calls on it (connecting on its first call, retrying a refused or full socket within
    retry_s; a service never reached yet: within first_s). Every message carries the proof
    of its token or secret (the service authenticates each head). A kept connection the service
    closed while it sat idle (its idle timeout, a restart) is seen before the next send and
    replaced; one that breaks mid-call is replaced and the message sent once more at once,
    marked as a retry with its operation id, so nothing is done twice. `connects` counts the
    connections opened; `keep_alive=False` opens one per call."""

    def __init__(self, addr: str, token: str | None, timeout: float = 30.0, retry_s: float = 10.0,
                 first_s: float = 2.0, keep_alive: bool = True):
        self.kind, self.where = parse_address(addr)
        if self.kind == "ray":
            raise SchedError("a ray: address needs RayTransport")
        self.token, self.timeout, self.retry_s, self.first_s = token, timeout, retry_s, first_s
        self.keep_alive = keep_alive
        self.reached = False  # a reply came once: a later refusal is a restart, worth riding out
        self.connects = 0  # connections opened (tests, benches)
        self.resent = 0  # calls sent again at once after their kept connection broke under them
        self._local = threading.local()  # .kept: this thread's connection (closed when the thread ends)
        self._all: weakref.WeakSet = weakref.WeakSet()  # every thread's (closed with the transport)
        self._count = threading.Lock()

    def _connect(self, timeout: float, end: float) -> socket.socket:
        first_end = time.monotonic() + self.first_s
        while True:
            try:
                if self.kind == "tcp":
                    s = socket.create_connection(self.where, timeout=timeout)
                else:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        s.settimeout(timeout)
                        s.connect(self.where)
                    except OSError:
                        s.close()
                        raise
                with self._count:
                    self.connects += 1
                return s
            except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, BlockingIOError) as e:
                # (BlockingIOError: a Unix socket's listen backlog is full; the service is busy, not gone)
                now = time.monotonic()
                if now >= end or (not self.reached and not isinstance(e, BlockingIOError) and now >= first_end):
                    if isinstance(e, BlockingIOError):
                        raise SchedError(f"the scheduler at {self.kind}:{self.where} accepted no connection "
                                         f"for {self.retry_s:g} s (its listen backlog stayed full)",
                                         "unavailable") from None
                    raise SchedError(f"no scheduler at {self.kind}:{self.where} ({e.__class__.__name__}); "
                                     "start one with `rlcu sched serve`", "unavailable") from None
                time.sleep(0.05)

    def _kept(self) -> _Kept | None:
        """This thread's kept connection, if it is still good: not inherited through a fork, and
        with nothing to read between two calls (an end of file or a closing notice: the service
        closed it)."""
        k = getattr(self._local, "kept", None)
        if k is None:
            return None
        if k.pid == os.getpid():
            p = select.poll()
            p.register(k.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            if not p.poll(0):
                return k
        self.close()
        return None

    def _open(self, msg: dict, timeout: float, end: float) -> _Kept:
        """A new connection, past its handshake: the service proved it knows the key `msg`
        carries (or the transport's token) before anything else is sent."""
        s = self._connect(timeout, end)
        self.reached = True  # something listens: a refusal from now on is a restart
        k = _Kept(s, Handshake(msg, self.token))
        try:
            k.auth.accept(json.loads(_line(self._exchange(s, encode(k.auth.hello)))), f"{self.kind}:{self.where}")
        except (OSError, _Closed, ValueError, SchedError) as e:
            k.close()
            if isinstance(e, SchedError):
                raise
            if isinstance(e, ValueError):
                raise SchedError(f"the scheduler at {self.kind}:{self.where} answered the hello with something "
                                 f"that is not JSON: {e}", "protocol") from None
            raise SchedError(f"lost the scheduler at {self.kind}:{self.where} during the handshake: "
                             f"{e or type(e).__name__}", "unavailable") from None
        return k

    def close(self) -> None:
        """Close this thread's kept connection (the next call opens a new one)."""
        k, self._local.kept = getattr(self._local, "kept", None), None
        if k is not None:  # (a copy inherited through a fork: closing it here leaves the parent's open)
            k.close()

    def call(self, msg: dict, retry_s: float | None = None) -> dict:
        if "token" not in msg and "secret" not in msg and self.token is not None:
            msg = {**msg, "token": self.token}
        wait = float(msg.get("timeout", 0)) if msg.get("op") == "wait" else 0.0
        end = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        while True:
            k = self._kept() if self.keep_alive else None
            kept = k is not None
            if k is None:
                k = self._open(msg, self.timeout + wait, end)
                if self.keep_alive:
                    self._local.kept = k
                    self._all.add(k)
            else:
                k.sock.settimeout(self.timeout + wait)
            s = k.sock
            try:
                buf = self._exchange(s, encode(k.auth.sign(msg)))
            except (ConnectionResetError, BrokenPipeError, _Closed) as e:
                self._drop(s)
                if kept:  # the service dropped a kept connection under this call: once more, on a new one
                    with self._count:
                        self.resent += 1
                    if "id" in msg and not msg.get("retry"):
                        msg = {**msg, "retry": True}
                    continue
                if isinstance(e, _Closed):
                    raise SchedError("the scheduler closed the connection without a reply", "unavailable") from None
                raise SchedError(f"lost the scheduler at {self.kind}:{self.where}: {e}", "unavailable") from None
            except OSError as e:  # timed out mid-call (a service going down or stuck): the connection is spent
                self._drop(s)
                raise SchedError(f"lost the scheduler at {self.kind}:{self.where}: {e}", "unavailable") from None
            except SchedError:
                self._drop(s)
                raise
            break
        if buf.index(b"\n") != len(buf) - 1 or not self.keep_alive:  # more than one reply: not to reuse
            self._drop(s)
        try:
            return json.loads(_line(buf))
        except ValueError as e:
            raise SchedError(f"the scheduler's reply is not JSON: {e}", "protocol") from None

    def __del__(self):
        for k in list(getattr(self, "_all", ())):
            k.close()

    def _drop(self, s: socket.socket) -> None:
        k = getattr(self._local, "kept", None)
        if k is not None and k.sock is s:
            self._local.kept = None
        with contextlib.suppress(OSError):
            s.close()

    @staticmethod
    def _exchange(s: socket.socket, data: bytes) -> bytearray:
        """Send one message, read one reply line."""
        buf = bytearray()
        try:
            s.sendall(data)
        except OSError:  # refused mid-send (busy, or a head too long): its reply may be there
            with contextlib.suppress(OSError):
                buf += s.recv(1 << 16)
            if not buf:
                raise
        while b"\n" not in buf:
            chunk = s.recv(1 << 16)
            if not chunk:
                raise _Closed()
            buf += chunk
            if len(buf) > MAX_REPLY:
                raise SchedError("the scheduler's reply is too long", "protocol")
        return buf


def _line(buf: bytearray) -> bytes:
    return bytes(buf[:buf.index(b"\n")])


class _Kept:
    """A thread's kept connection and its handshake; closed when dropped (its thread ended,
    its transport went)."""

    __slots__ = ("__weakref__", "auth", "pid", "sock")

    def __init__(self, sock: socket.socket, auth: Handshake):
        self.sock, self.pid, self.auth = sock, os.getpid(), auth

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    __del__ = close


class _Closed(Exception):
    """The service closed the connection before its reply."""
