"""Helpers of the scheduler's tests: a settable clock, a call that must succeed, a raw handshake,
a `serve` fixture's servers, and a process's CPU share."""

import os

SPEC = {"c": {"devices": 1}}


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def ok(core, **msg):
    r = core.handle(msg)
    assert r["ok"], r
    return r


def hello(sock, token=None, job=None, secret=None):
    """A raw connection's handshake (rlcu.sched.auth); returns the Handshake whose `sign(msg)`
    turns a message's token or secret into its proof for this connection."""
    import json

    from rlcu.sched.auth import Handshake
    from rlcu.sched.protocol import encode

    hs = Handshake({"job": job, "secret": secret} if secret else {}, token)
    sock.sendall(encode(hs.hello))
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    hs.accept(json.loads(buf), "the test's service")
    return hs


def servers(tmp_path, token: str, devices: list[float]):
    """The body of a `serve` fixture: serve(core=None, addr=None, **kw) starts a SchedServer
    (by default on a Core of `devices` with its state in tmp_path, on a Unix socket there);
    every one still running is stopped at the end."""
    from rlcu.sched.core import Core
    from rlcu.sched.server import SchedServer

    started = []

    def start(core=None, addr=None, **kw):
        srv = SchedServer(core or Core(list(devices), state=tmp_path / "s.db"), addr or f"unix:{tmp_path / 's.sock'}",
                          token, tick_s=0.05, **kw).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        if not srv._stop.is_set():
            srv.stop()


def cpu_share(pid: int, seconds: float = 1.5) -> float:
    """The share of one core process `pid` used (user + system) over the next `seconds`."""
    import time
    from pathlib import Path

    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / tick

    c0, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - c0) / (time.monotonic() - t0)
