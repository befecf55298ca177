"""`rlcu sched serve`: the scheduler service on a Unix socket or on loopback TCP.

One thread per connection, JSON lines in and out, one `Core` behind a lock (core.py). Every
message must carry the service's token (compared in constant time); the token lives in
`<state>/token` (mode 0600) beside the database `<state>/sched.db` and, by default, the
socket `<state>/sched.sock`, so a client on the same machine finds all three. TCP is
refused on anything but a loopback address: several machines go through `--ray`.

A ticker thread calls `core.tick()` every `tick_s` (reclaiming the leases of jobs that stopped
heartbeating, and letting waits age).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import socketserver
import threading
from pathlib import Path

from rlcu.sched.client import MAX_LINE, is_loopback, parse_address
from rlcu.sched.core import Core


def load_token(state_dir: Path, token: str | None = None) -> str:
    """The given token (saved), or the saved one, or a new random one (saved, mode 0600)."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    p = state_dir / "token"
    if token is None and p.exists():
        return p.read_text().strip()
    token = token or secrets.token_hex(16)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(p, 0o600)
    return token


class _Handler(socketserver.StreamRequestHandler):
    def _send(self, reply: dict) -> None:
        self.wfile.write((json.dumps(reply) + "\n").encode())
        self.wfile.flush()

    def handle(self) -> None:
        srv = self.server.sched
        while True:
            try:
                line = self.rfile.readline(MAX_LINE + 1)
            except OSError:
                return
            if not line:
                return
            if len(line) > MAX_LINE:
                self._send({"ok": False, "error": f"message longer than {MAX_LINE} bytes", "code": "protocol"})
                return
            try:
                msg = json.loads(line)
            except ValueError as e:
                self._send({"ok": False, "error": f"not JSON: {e}", "code": "protocol"})
                continue
            if not isinstance(msg, dict):
                self._send({"ok": False, "error": "a message is a JSON object with an 'op'", "code": "protocol"})
                continue
            tok = msg.pop("token", None)
            if not isinstance(tok, str) or not hmac.compare_digest(tok.encode(), srv.token.encode()):
                self._send({"ok": False, "error": "bad or missing token (see <state>/token or $RLCU_SCHED_TOKEN)",
                            "code": "auth"})
                continue
            try:
                self._send(srv.core.handle(msg))
            except OSError:
                return


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    # the listen backlog: socketserver's default, 5, is full as soon as a few jobs call at once
    request_queue_size = 256


class _TCPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256


class SchedServer:
    """SchedServer(core, "unix:run/sched.sock", token).start() ... .stop()"""

    def __init__(self, core: Core, addr: str, token: str, tick_s: float | None = None):
        self.core, self.token = core, token
        self.kind, where = parse_address(addr)
        if self.kind == "unix":
            path = Path(where)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                if _alive(path):
                    raise OSError(f"a scheduler already listens on {path}")
                path.unlink()  # a stale socket from a service that died
            self.srv = _UnixServer(str(path), _Handler)
            os.chmod(path, 0o600)
            self.address = f"unix:{path}"
        elif self.kind == "tcp":
            host, port = where
            if not is_loopback(host):
                raise ValueError(f"refusing to listen on {host}: the service serves loopback only "
                                 "(127.0.0.1 / ::1); several machines go through `rlcu sched serve --ray`")
            cls = type("_TCP", (_TCPServer,), {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
            self.srv = cls((host, port), _Handler)
            self.address = f"{host}:{self.srv.server_address[1]}"
        else:
            raise ValueError(f"{addr!r} is a Ray address: use `rlcu sched serve --ray`")
        self.srv.sched = self
        self.tick_s = tick_s if tick_s is not None else max(0.05, min(1.0, core.heartbeat_timeout / 4))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _tick(self) -> None:
        self.core.run_ticks(self._stop, self.tick_s)  # never dies silently; a fatal state ends it

    def start(self) -> "SchedServer":
        serve = lambda: self.srv.serve_forever(poll_interval=0.05)  # noqa: E731  (stop() returns within 50 ms)
        for fn, name in ((serve, "sched-serve"), (self._tick, "sched-tick")):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        self.start()
        try:
            self._stop.wait()
        finally:
            self.stop()

    def stop(self, close_core: bool = True) -> None:
        if self._threads:
            self._stop.set()
            self.srv.shutdown()
            for t in self._threads:
                t.join(timeout=5)
            self._threads = []
        self.srv.server_close()
        if self.kind == "unix":
            Path(self.address[len("unix:"):]).unlink(missing_ok=True)
        if close_core:
            self.core.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _alive(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()
